"""Prefix calls over the attach connection (``AttachedPool.load_prefix`` / ``store_prefix`` /
``release_prefix``: one SEQPACKET message each way, kvtier.attach_wire) against a real daemon
process (the pytest plugin's tiny daemon, one for the module: a pool of 8 pages): they act on the cache as the gRPC
methods do, their leases are the session's own, a malformed message is INVALID_ARGUMENT and changes
nothing, a second call while one runs on the connection is RESOURCE_EXHAUSTED (a daemon of its own,
the first call held by LMDB's write lock, which the test takes), and detach releases what they pinned."""

from __future__ import annotations

import os
import time

import pytest
import torch

from kvtier.attach_wire import decode_slots, encode_keys, encode_slots, recv_message, send_message
from kvtier.client import KVTierClient, NotFoundError
from kvtier.page_keys import page_keys
from kvtier.pytest_plugin import start_tiny_daemon, stop_tiny_daemon

PAGE = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = start_tiny_daemon(tmp_path_factory.mktemp("tiny"), device_pages=8, host_pages=2, disk_pages=24)
    try:
        yield d
    finally:
        stop_tiny_daemon(d)


def keys_of(seed: int, pages: int) -> list[bytes]:
    return page_keys(list(range(seed * 10_000, seed * 10_000 + pages * PAGE)), PAGE)


def device_use(c: KVTierClient, pool_id: str) -> dict[str, int]:
    return dict(c.tier_stats(pool_id).device)


def test_prefix_calls_over_the_channel_act_as_the_grpc_ones(tiny):
    """A miss, a store with release, then a hit: over the channel and over gRPC (in the same
    session), the same tiers, the hit on exactly the pages stored, nothing left pinned."""
    c = tiny.client
    with c.attach(tiny.pool_id) as ap:
        for seed, (load, store) in enumerate([
                (ap.load_prefix, ap.store_prefix),
                (lambda k: ap.client.load_prefix(tiny.pool_id, k), ap.client.store_prefix)]):
            keys = keys_of(seed + 1, 3)
            first = load(keys)
            assert first.tiers == [] and first.slots.numel() == 3 * PAGE and first.slots.dtype == torch.int64
            assert store(first, keys, first.slots, release=True) == 3
            assert c.where_is(tiny.pool_id, keys) == [["device"]] * 3
            again = load(keys)
            assert again.tiers == ["device"] * 3
            assert torch.equal(again.slots, first.slots)  # the very pages stored
            ap.release_prefix(again) if seed == 0 else ap.client.release_prefix(again)
        use = device_use(c, tiny.pool_id)
        assert use["open_leases"] == 0 and use["pinned_pages"] == 0


def test_a_channel_lease_is_the_sessions_own(tiny):
    """A lease taken over the channel cannot be stored or released by a client outside the session
    (NOT_FOUND, as for an unknown lease); the session releases it once, a second release is NOT_FOUND."""
    c = tiny.client
    with c.attach(tiny.pool_id) as ap:
        keys = keys_of(7, 2)
        lease = ap.load_prefix(keys)
        with pytest.raises(NotFoundError):
            c.store_prefix(lease, keys, lease.slots)
        with pytest.raises(NotFoundError):
            c.release_prefix(lease)
        assert device_use(c, tiny.pool_id)["open_leases"] == 1
        ap.release_prefix(lease)
        with pytest.raises(NotFoundError):
            ap.release_prefix(lease)
        assert device_use(c, tiny.pool_id)["open_leases"] == 0


@pytest.mark.parametrize("message", [
    {"kind": "load_prefix", "keys": "not a list"},
    {"kind": "load_prefix", "keys": ["zz"]},
    {"kind": "load_prefix", "keys": encode_keys([b"k" * 16] * 2)},  # a repeated key
    {"kind": "load_prefix", "keys": encode_keys([b"k" * 16]), "total_tokens": "64"},
    {"kind": "load_prefix", "keys": encode_keys([b"k" * 16]), "total_tokens": True},
    {"kind": "store_prefix", "lease_id": 5, "keys": [], "slots": ""},
    {"kind": "store_prefix", "lease_id": "x" * 32, "keys": [], "slots": "***"},
    {"kind": "store_prefix", "lease_id": "x" * 32, "keys": [], "slots": encode_slots(b"\0" * 12)},
    {"kind": "store_prefix", "lease_id": "x" * 32, "keys": [], "slots": "", "release": "yes"},
    {"kind": "release_prefix", "lease_id": ""},
])
def test_a_malformed_prefix_message_is_invalid_argument_and_changes_nothing(tiny, message):
    c = tiny.client
    with c.attach(tiny.pool_id) as ap:
        before = device_use(c, tiny.pool_id)
        with ap._lock:  # noqa: SLF001 - the raw connection, as a misbehaving client would use it
            send_message(ap._sock, {**message, "id": 99})  # noqa: SLF001
            reply, _ = recv_message(ap._sock)  # noqa: SLF001
        assert reply["error"]["code"] == "INVALID_ARGUMENT" and reply["id"] == 99, reply
        assert device_use(c, tiny.pool_id) == before
        lease = ap.load_prefix(keys_of(9, 1))  # the connection still serves
        ap.release_prefix(lease)


def test_detach_releases_the_leases_the_channel_took(tiny):
    c = tiny.client
    ap = c.attach(tiny.pool_id)
    lease = ap.load_prefix(keys_of(11, 4))
    assert lease.tiers == [] and device_use(c, tiny.pool_id)["open_leases"] == 1
    ap.detach()
    deadline = time.monotonic() + 10
    while device_use(c, tiny.pool_id)["open_leases"] and time.monotonic() < deadline:
        time.sleep(0.02)
    use = device_use(c, tiny.pool_id)
    assert use["open_leases"] == 0 and use["pinned_pages"] == 0


def test_a_call_too_large_for_one_message_goes_over_grpc_and_nothing_breaks(tiny):
    """Scenario (the new-user pass): LoadPrefix of a 20,480-token prompt made a reply larger than one
    SEQPACKET message (the socket buffer, ~208 KiB); the daemon ended the session, and closing a
    connection the selector still watched later crashed the attach listener for everyone. Now the
    client sends such calls over gRPC; a raw one gets RESOURCE_EXHAUSTED, its lease is released, the
    session goes on, and new attaches still work."""
    c = tiny.client
    c.create_pool("glm-5.2", num_layers=1, size_tokens=32768, pool_id="big")
    try:
        with c.attach("big") as ap:
            lease = ap.load_prefix([], total_tokens=20480)  # over gRPC, in the session
            assert lease.slots.numel() == 20480 and device_use(c, "big")["open_leases"] == 1
            ap.release_prefix(lease)
            with ap._lock:  # noqa: SLF001 - the same call sent raw on the attach connection
                send_message(ap._sock, {"kind": "load_prefix", "keys": [], "total_tokens": 20480, "id": 7})  # noqa: SLF001
                reply, _ = recv_message(ap._sock)  # noqa: SLF001
            assert reply["error"]["code"] == "RESOURCE_EXHAUSTED" and reply["id"] == 7, reply
            assert device_use(c, "big")["open_leases"] == 0  # the unsent reply's lease was released
            small = ap.load_prefix([], total_tokens=PAGE)  # the session goes on
            ap.release_prefix(small)
            for _ in range(3):  # the listener still takes new connections
                with c.attach("big") as again:
                    again.release_prefix(again.load_prefix([], total_tokens=PAGE))
    finally:
        c.delete_pool("big", force=True)


def test_a_second_prefix_call_while_the_first_runs_is_refused_and_the_first_completes(tmp_path):
    """Scenario: a daemon without disk write-behind (a disk write commits in the call) whose 8-page
    pool is full of cached prefix pages and whose host tier holds no record, so a load of a new key
    must evict a page straight to LMDB. The test holds LMDB's one write lock itself (a write
    transaction of its own process on the daemon's environment) and sends two requests back to back
    on one raw attach connection: that load (id 1), then a load of two cached keys (id 2, which would
    pin both). The first load waits inside the daemon for the lock the test holds, so the second
    always arrives while it runs: it must be answered first, RESOURCE_EXHAUSTED ("one prefix call at
    a time"), and change nothing (no lease, no pin); once the test lets the lock go, the first load
    completes with one fresh page and the evicted page is on disk. The refusal is also counted in the
    RPC metrics under its method and code."""
    import lmdb

    from kvtier.attach_wire import PROTOCOL_VERSION
    from kvtier.client.attach import open_channel
    from kvtier.client.spawn import DaemonProcess
    from metrics_kit import metrics_flags, scrape, value

    disk = tmp_path / "disk"
    args = ["--device", "cpu", "--pool", "glm-5.2:512", "--pool-layers", "4", "--host-memory", "4KiB",
            "--disk-path", str(disk), "--disk-size", "64MiB", "--no-disk-write-behind", *metrics_flags(tmp_path)]
    keys = keys_of(7, 9)
    with DaemonProcess(extra_args=args) as d, KVTierClient(d.address, timeout=60) as c:
        cached = c.load_prefix("default", keys[:8])
        assert c.store_prefix(cached, keys[:8], cached.slots, release=True) == 8
        assert c.describe_pool("default").free_pages == 0 and c.tier_stats("").tiers["disk"]["entries"] == 0
        sock, reply, fds = open_channel(c.attach_socket(), {"kind": "attach", "version": PROTOCOL_VERSION,
                                                            "token": None, "pool_id": "default"}, 30)
        for fd in fds:
            os.close(fd)  # the pool's memory: not needed here
        env = lmdb.open(str(disk), max_dbs=4, map_size=64 << 20)
        try:
            sock.settimeout(60)
            held = env.begin(write=True)  # LMDB's writer lock, across processes
            try:
                send_message(sock, {"kind": "load_prefix", "id": 1, "keys": encode_keys(keys[8:]), "total_tokens": None})
                send_message(sock, {"kind": "load_prefix", "id": 2, "keys": encode_keys(keys[1:3]), "total_tokens": None})
                second, _ = recv_message(sock)
            finally:
                held.abort()
            first, _ = recv_message(sock)
            assert second == {"id": 2, "error": {"code": "RESOURCE_EXHAUSTED", "message": second["error"]["message"]}}
            assert "one prefix call at a time" in second["error"]["message"]
            assert first["id"] == 1 and "error" not in first and first["tiers"] == []
            assert len(decode_slots(first["slots"])) == PAGE * 8  # one fresh page of int64 slots
            assert c.where_is("default", keys[:1]) == [["disk"]]  # the LRU page went to LMDB in the load
            use = device_use(c, "default")
            assert (use["open_leases"], use["pinned_pages"]) == (1, 0)  # the first load's fresh page only
            send_message(sock, {"kind": "release_prefix", "id": 3, "lease_id": first["lease_id"]})
            assert recv_message(sock)[0] == {"id": 3}
            assert device_use(c, "default")["open_leases"] == 0
        finally:
            env.close()
            sock.close()
        m = scrape(c.stats().metrics_address)
    rpc = "kvtier_rpc_duration_seconds_count"
    assert value(m, rpc, method="kvtier.attach/LoadPrefix", code="RESOURCE_EXHAUSTED", tenant="default") == 1
    assert value(m, rpc, method="kvtier.attach/LoadPrefix", code="OK", tenant="default") == 1
    assert value(m, rpc, method="kvtier.attach/ReleasePrefix", code="OK", tenant="default") == 1
