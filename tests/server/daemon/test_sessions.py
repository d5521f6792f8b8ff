"""Attach sessions in process: what a session owns, who may touch it, and what its end gives back.

The daemon is a real in-process ``Daemon`` (CPU, host tier); sessions are opened through
``AttachService.attach`` as the attach channel opens them (the peer is this process).
"""

from __future__ import annotations

import os
import time

import pytest
from daemonkit import A, B, PS, daemon, keys, pool, rows, store_prefix

from kvtier.server.daemon import kv_ops, kv_write
from kvtier.server.daemon.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unauthenticated
from kvtier.server.daemon.kv_ops import KVSelection
from kvtier.server.daemon.sessions import PeerCredentials
from kvtier.server.daemon.tier_settings import TierSettings

ME = PeerCredentials(os.getpid(), os.getuid(), os.getgid())


def attach(d, caller, pool_id="p"):
    grant = d.attach.attach(ME, {"kind": "attach", "version": 1, "token": caller.token, "pool_id": pool_id})
    return caller.in_session(grant.session), grant


def write_rows(d, caller, pool_id, slots, seed):
    buf = kv_write.begin_write(d.pools, caller, KVSelection(pool_id, slots, (0,), ()))
    data = rows(len(slots), 656, seed).numpy().tobytes()
    for off in range(0, len(data), 1 << 20):
        buf.add(0, "latent", off, data[off:off + (1 << 20)])
    return kv_write.write_kv(d.pools, caller, buf)


def tokens_file(path):
    path.write_text(f'[tokens]\n"{A.token}" = "team-a"\n"{B.token}" = "team-b"\n')
    os.chmod(path, 0o600)
    return str(path)


@pytest.fixture()
def d(tmp_path):
    dm = daemon(host_memory_bytes=8 << 20, tiers=TierSettings(lease_ttl_seconds=0.2),
                auth_tokens=tokens_file(tmp_path / "tokens.toml"))
    pool(dm, A, "p")
    try:
        yield dm
    finally:
        dm.close()


def test_the_reply_describes_the_pool_and_passes_its_memfds(d):
    caller, grant = attach(d, A)
    r = grant.reply
    assert r["pool_id"] == "p" and r["tenant"] == "team-a" and r["device"] == "cpu" and len(r["session_id"]) == 32
    assert [a["component"] for a in r["arenas"]] == ["latent", "index_k"] and len(grant.fds) == 2
    entry = d.pools.get(A, "p")
    assert [a["nbytes"] for a in r["arenas"]] == [entry.pool.arena_nbytes()["latent"], entry.pool.arena_nbytes()["index_k"]]
    for fd in grant.fds:
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvtier-")
    assert r["geometry"]["skip_topk_layers"] == [False, False, False, True]
    assert r["views"]["kv_buffer"][1] == [(512 + PS) * 656, [512 + PS, 1, 656], "uint8"]  # layer 1 after layer 0's rows
    assert r["views"]["index_k_with_scale_buffer"][3] == [0, [0, 8448], "uint8"]


def test_slots_of_a_session_are_its_own(d):
    """Anyone else -- a caller in no session, or another session -- is refused (FAILED_PRECONDITION)
    every change to the session's pages; reads stay open; the session itself may do all of it."""
    mine, _ = attach(d, A)
    other, _ = attach(d, A)
    slots, _ = kv_ops.allocate_slots(d.pools, mine, "p", 2 * PS)
    spare, _ = kv_ops.allocate_slots(d.pools, A, "p", PS)
    entry = d.pools.get(A, "p")
    assert entry.page_owner[slots // PS].unique().tolist() == [mine.session.number]
    write_rows(d, mine, "p", slots, seed=1)
    kv_ops.offload(d.pools, d.offload_store, A, "p", "copy", spare, free_slots=False)
    for who in (A, other):
        with pytest.raises(FailedPrecondition, match="another worker's attach session"):
            kv_ops.free_slots(d.pools, who, "p", slots)
        with pytest.raises(FailedPrecondition, match="another worker's attach session"):
            write_rows(d, who, "p", slots[:PS], seed=2)
        with pytest.raises(FailedPrecondition, match="another worker's attach session"):
            kv_ops.move_kv(d.pools, who, "p", slots[:PS], spare)
        with pytest.raises(FailedPrecondition, match="another worker's attach session"):
            kv_ops.offload(d.pools, d.offload_store, who, "p", "k", slots, free_slots=True)
        with pytest.raises(FailedPrecondition, match="another worker's attach session"):
            kv_ops.restore(d.pools, d.offload_store, who, "p", "copy", slots[:PS].tolist(), drop=False)
        kv_ops.offload(d.pools, d.offload_store, who, "p", f"read-{id(who)}", slots, free_slots=False)  # a read: open
    got = kv_ops.read_kv(d.pools, A, KVSelection("p", slots, (0,), ()))[0][1]
    assert got.tobytes() == rows(2 * PS, 656, 1).numpy().tobytes()  # untouched by the refused writes
    kv_ops.move_kv(d.pools, mine, "p", slots[:PS], spare)  # the owner may
    kv_ops.restore(d.pools, d.offload_store, mine, "p", "copy", slots[PS:].tolist(), drop=False)
    assert kv_ops.free_slots(d.pools, mine, "p", slots) == 2
    assert int(entry.page_owner.sum()) == 0


def test_the_end_of_a_session_frees_its_slots_and_releases_its_leases(d):
    store_prefix(d, A, "p", keys(2), seed=3)
    caller, grant = attach(d, A)
    kv_ops.allocate_slots(d.pools, caller, "p", 3 * PS)
    restored_key = "r"
    kv_ops.offload(d.pools, d.offload_store, A, "p", restored_key, kv_ops.allocate_slots(d.pools, A, "p", PS)[0],
                   free_slots=True)
    kv_ops.restore(d.pools, d.offload_store, caller, "p", restored_key, None, drop=True)  # fresh slots: the session's
    ld = d.tiers.load(caller, "p", keys(3), None)
    assert ld.tiers == ["device", "device"]
    entry = d.pools.get(A, "p")
    cache = entry.prefix_cache
    assert entry.allocator.used_pages == 2 + 3 + 1 + 1 and cache.pinned_pages == 2 and cache.open_leases == 1
    assert d.end_session(grant.session, "test") is True
    assert entry.allocator.used_pages == 2 and cache.pinned_pages == 0 and cache.open_leases == 0
    assert d.end_session(grant.session, "again") is False  # once
    with pytest.raises(NotFound, match="attach session has ended"):
        kv_ops.allocate_slots(d.pools, caller, "p", PS)  # a call that was already past the interceptor
    with pytest.raises(NotFound, match="attach session has ended"):
        d.tiers.load(caller, "p", keys(1, seed=9), None)
    assert d.sessions.get("team-a", grant.session.session_id) is None
    c = d.counters.snapshot(A)
    assert (c["attach_pages_freed"], c["attach_leases_released"], c["attach_sessions_ended"]) == (4, 1, 1)


def test_a_sessions_lease_never_expires_by_the_lease_ttl(d):
    """Regression guard: the lease TTL frees pages of clients that vanished; a session's end is
    known exactly, and a worker still computing on its pages must never see them evicted under it."""
    caller, _ = attach(d, A)
    mine = d.tiers.load(caller, "p", keys(1, seed=1), None)
    plain = d.tiers.load(A, "p", keys(1, seed=2), None)
    time.sleep(0.3)
    d.tiers.lookup(A, "p", keys(1, seed=3))  # expiry runs at the next lookup or load
    cache = d.pools.get(A, "p").prefix_cache
    assert cache.open_leases == 1 and cache.counters["expired_leases"] == 1
    d.tiers.release(caller, "p", mine.lease)
    with pytest.raises(NotFound):
        d.tiers.release(A, "p", plain.lease)


def test_who_may_attach(d):
    pool(d, B, "b-only")
    with pytest.raises(NotFound, match="no pool 'b-only'"):
        attach(d, A, "b-only")
    stranger = PeerCredentials(1, os.getuid() + 4242, 1)
    with pytest.raises(NotFound, match="no pool 'p'"):
        d.attach.attach(stranger, {"version": 1, "token": A.token, "pool_id": "p"})
    with pytest.raises(InvalidArgument):
        d.attach.attach(ME, {"version": 1, "token": A.token, "pool_id": 7})
    with pytest.raises(FailedPrecondition, match="protocol version"):
        d.attach.attach(ME, {"version": 2, "token": A.token, "pool_id": "p"})


def test_tokens_are_checked_as_grpc_checks_them(d):
    with pytest.raises(Unauthenticated, match="no token"):
        d.attach.attach(ME, {"version": 1, "token": None, "pool_id": "p"})
    with pytest.raises(Unauthenticated, match="unknown token"):
        d.attach.attach(ME, {"version": 1, "token": "x" * 20, "pool_id": "p"})
    assert d.attach.attach(ME, {"version": 1, "token": A.token, "pool_id": "p"}).reply["tenant"] == "team-a"


def test_staging_buffers_are_the_sessions_own_and_bounded(d):
    import dataclasses

    d.config = dataclasses.replace(d.config, attach_staging_bytes=1 << 20)
    _, grant = attach(d, A)
    reply, shm = d.attach.staging(grant.session, {"nbytes": 600 << 10})
    assert reply == {"staging": {"index": 0, "nbytes": 600 << 10}} and shm.sealed
    with pytest.raises(ResourceExhausted, match="at most 1048576 bytes"):
        d.attach.staging(grant.session, {"nbytes": 600 << 10})
    with pytest.raises(InvalidArgument):
        d.attach.staging(grant.session, {"nbytes": 0})
    d.end_session(grant.session, "test")
    assert shm.fd == -1 and grant.session.staging == []


def test_a_sessions_lease_pages_are_written_by_that_session_only(d):
    """Issue 23, defect 4 (the session side of tests/client/test_daemon_write_ownership.py): a lease
    taken in session ``mine`` has a fresh page (to fill) and a hit page (cached under key 0). A caller
    in no session and another session are refused (FAILED_PRECONDITION) writing, moving onto and
    restoring into either; ``mine`` may write its fresh page but never the cached hit page. A new
    LoadPrefix then serves exactly the bytes ``mine`` wrote (seed 5) and the cached ones (seed 3)."""
    mine, _ = attach(d, A)
    other, _ = attach(d, A)
    ks = keys(2, seed=7)
    store_prefix(d, A, "p", ks[:1], seed=3)  # key 0 cached: every layer seed 3
    spare, _ = kv_ops.allocate_slots(d.pools, A, "p", PS)
    kv_ops.offload(d.pools, d.offload_store, A, "p", "copy", spare, free_slots=False)
    ld = d.tiers.load(mine, "p", ks, None)
    hit, fresh = ld.slots[:PS], ld.slots[PS:]
    for who in (A, other):
        for slots, why in ((fresh, "another client's prefix lease"), (hit, "cached prefix page")):
            with pytest.raises(FailedPrecondition, match=why):
                write_rows(d, who, "p", slots, seed=4)
            with pytest.raises(FailedPrecondition, match=why):
                kv_ops.move_kv(d.pools, who, "p", slots, spare)
            with pytest.raises(FailedPrecondition, match=why):
                kv_ops.restore(d.pools, d.offload_store, who, "p", "copy", slots.tolist(), drop=False)
    for attempt in (lambda: write_rows(d, mine, "p", hit, seed=4), lambda: kv_ops.move_kv(d.pools, mine, "p", hit, spare)):
        with pytest.raises(FailedPrecondition, match="cached prefix page"):
            attempt()
    write_rows(d, mine, "p", fresh, seed=5)  # the lease's holder fills its fresh page
    d.tiers.store(mine, "p", ld.lease, ks[1:], fresh.tolist(), release=True)
    again = d.tiers.load(A, "p", ks, None)
    got = kv_ops.read_kv(d.pools, A, KVSelection("p", again.slots, (0,), ()))[0][1]
    assert got.tobytes() == rows(PS, 656, 3).numpy().tobytes() + rows(PS, 656, 5).numpy().tobytes()
    d.tiers.release(A, "p", again.lease)
