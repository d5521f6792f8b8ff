"""Local attach with real processes: a worker process maps the daemon's pool and computes on it.

The daemon is a real subprocess with tiny budgets (the pytest plugin's, ``kvtier.pytest_plugin``):
a pool ``tiny`` of GLM-5.2's first 4 layers (live indexer layers 0, 1, 2) holding 8 pages, a host
tier of 2 page records, an LMDB disk tier of 24. Workers are separate processes
(``attach_worker.py``); the expected bytes are worked out here from the seeds (``kv_helpers``),
never asked of the daemon.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from kv_helpers import LAYERS4, LIVE4, PAGE_SIZE, random_kv

from kvtier.client import FailedPreconditionError, KVTierClient, NotFoundError
from kvtier.client.spawn import DaemonProcess
from kvtier.pytest_plugin import start_tiny_daemon, stop_tiny_daemon

WORKER = Path(__file__).with_name("attach_worker.py")
SESSION_END_BOUND_S = 2.0  # README "Local attach": a dead worker's slots and leases are back within this


def expected_digest(seed: int) -> str:
    """sha256 of the seeded page in the order the worker reads it (latent layers, then keys+scales)."""
    latent, index = random_kv(PAGE_SIZE, seed, layers=LAYERS4, live=LIVE4)
    h = hashlib.sha256()
    for layer in LAYERS4:
        h.update(latent[layer].numpy().tobytes())
    for layer in LIVE4:
        keys, scales = index[layer]
        h.update(keys.numpy().tobytes())
        h.update(scales.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_worker(address: str, pool_id: str, scenario: str, **args) -> dict:
    r = subprocess.run([sys.executable, str(WORKER), address, pool_id, scenario, json.dumps(args)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def start_worker(address: str, pool_id: str, scenario: str, **args) -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen([sys.executable, str(WORKER), address, pool_id, scenario, json.dumps(args)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line:
        p.kill()
        raise AssertionError(f"worker died: {p.stderr.read()}")
    return p, json.loads(line)


@pytest.fixture()
def tiny(tmp_path):
    d = start_tiny_daemon(tmp_path, device_pages=8, host_pages=2, disk_pages=24)
    try:
        yield d
    finally:
        stop_tiny_daemon(d)


def wait_for(cond, bound: float) -> float:
    """Poll ``cond`` until true; returns the seconds it took (fails past ``bound`` seconds)."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > bound:
            raise AssertionError(f"not within {bound} s")
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_worker_writes_through_its_tensors_the_daemon_evicts_to_disk_and_loads_back_byte_exact(tiny):
    """Scenario: worker 1 stores 14 one-page requests written through its tensors (no WriteKV); the
    pool holds 8 pages and the host 2 records, so the first pages go down to the disk tier. Worker 2
    (another process) loads the first four back and reads them through its own tensors: every byte
    is the seeded page's."""
    keys = tiny.page_keys(14, seed=5)
    seeds = list(range(100, 114))
    assert run_worker(tiny.address, tiny.pool_id, "store", keys=[k.hex() for k in keys], seeds=seeds) == {"stored": 14}
    c = tiny.client
    assert c.where_is(tiny.pool_id, keys[:4]) == [["disk"]] * 4
    assert c.describe_pool(tiny.pool_id).used_pages == 8  # the cache's pages; the worker's session left nothing
    got = run_worker(tiny.address, tiny.pool_id, "read", keys=[k.hex() for k in keys[:4]])
    assert got["tiers"] == ["disk"] * 4
    assert got["digests"] == [expected_digest(s) for s in seeds[:4]]
    moves = c.tier_stats(tiny.pool_id).moves
    assert moves["disk->device"]["count"] >= 4 and moves["host->disk"]["count"] >= 4
    # the bytes through gRPC agree with what the workers wrote and read (a second, independent path)
    lease = c.load_prefix(tiny.pool_id, keys[:1])
    try:
        kv = c.read_kv(tiny.pool_id, lease.slots)
        latent, index = random_kv(PAGE_SIZE, seeds[0], layers=LAYERS4, live=LIVE4)
        assert all(torch.equal(kv.latent[x].view(PAGE_SIZE, -1), latent[x]) for x in LAYERS4)
        assert all(torch.equal(kv.index_k[x], index[x][0]) for x in LIVE4)
    finally:
        c.release_prefix(lease)


def test_a_sigkilled_worker_gives_its_slots_and_leases_back_and_the_daemon_keeps_serving(tiny):
    """Scenario: two cached pages; a worker allocates 3 pages and loads the two cached pages plus one
    fresh page under a lease, then is killed with SIGKILL. Within the bound its 3 + 1 pages are free,
    the lease's pins are gone, /dev/shm holds what it held before, and a new worker attaches and
    uses the whole pool."""
    shm_before = sorted(os.listdir("/dev/shm"))
    keys = tiny.page_keys(3, seed=9)
    tiny.put_pages(keys[:2])
    c, pool = tiny.client, tiny.pool_id
    cached = c.describe_pool(pool).used_pages
    proc, ready = start_worker(tiny.address, pool, "hold", slots=3 * PAGE_SIZE, keys=[k.hex() for k in keys])
    try:
        assert ready["ready"] and len(ready["slots"]) == 3 * PAGE_SIZE
        assert c.describe_pool(pool).used_pages == cached + 3 + 1
        dev = c.tier_stats(pool).device
        assert dev["pinned_pages"] == 2 and dev["open_leases"] == 1
        with pytest.raises(FailedPreconditionError, match="another worker's attach session"):
            c.free_slots(pool, ready["slots"])  # not ours to free while the worker lives
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        took = wait_for(lambda: c.describe_pool(pool).used_pages == cached, SESSION_END_BOUND_S)
        dev = c.tier_stats(pool).device
        assert dev["pinned_pages"] == 0 and dev["open_leases"] == 0, dev
        assert took < SESSION_END_BOUND_S
    finally:
        proc.kill()
        proc.wait()
    assert sorted(os.listdir("/dev/shm")) == shm_before
    counters = c.stats().counters
    assert counters["attach_pages_freed"] == 3 and counters["attach_leases_released"] == 1  # its lease freed the 4th
    with KVTierClient(tiny.address) as c2, c2.attach(pool) as ap:  # still serving: attach again, use every free page
        free = c2.describe_pool(pool).free_pages * PAGE_SIZE
        slots = ap.allocate_slots(free)
        assert slots.numel() == free


def test_the_attached_pool_looks_like_the_pool_to_engine_code(tiny):
    """Shapes, dtypes, skip mask, sizes and buffer infos (addresses in this process, inside the mapped
    arenas) are those of a pool of the same geometry; the layout is GLM-5.2's (DESIGN.md)."""
    from kvtier.server.model_config import DSAModelConfig
    from kvtier.server.pool import create_pool

    ref = create_pool(DSAModelConfig.from_preset("glm-5.2", num_layers=4), 8 * PAGE_SIZE, device="cpu")
    with tiny.client.attach(tiny.pool_id) as ap:
        assert (ap.page_size, ap.size, ap.start_layer, ap.layer_num) == (64, 512, 0, 4)
        assert list(ap.skip_topk_layers) == [False, False, False, True]
        for a, b in zip(ap.kv_buffer + ap.index_k_with_scale_buffer, ref.kv_buffer + ref.index_k_with_scale_buffer):
            assert (tuple(a.shape), a.dtype) == (tuple(b.shape), b.dtype)
        assert tuple(ap.kv_buffer[0].shape) == (512 + 64, 1, 656) and ap.kv_buffer[0].dtype == torch.uint8
        assert tuple(ap.index_k_with_scale_buffer[0].shape) == (9, 64 * 132)  # (512 + 64 + 1) // 64 pages
        assert tuple(ap.index_k_with_scale_buffer[3].shape) == (0, 64 * 132)
        ptrs, lens, items = ap.get_state_buf_infos()
        assert lens == ref.get_state_buf_infos()[1] and items == [8448, 8448, 8448, 0] and ptrs[3] == 0
        lat = ap.pool.arena("latent")
        for p, n in zip(*ap.get_contiguous_buf_infos()[:2]):
            assert lat.data_ptr() <= p and p + n <= lat.data_ptr() + lat.numel()
        assert ap.get_kv_size_bytes() == ref.get_kv_size_bytes()
        maps = Path("/proc/self/maps").read_text()
        assert "memfd:kvtier-latent" in maps and "memfd:kvtier-index_k" in maps


def test_tensors_used_after_detach_never_reach_the_daemon(tiny):
    """Scenario: a worker keeps a tensor of its pool past detach() and writes 0xFF through it; the page
    it had written meanwhile went to another session, which wrote its own bytes. The stale tensor
    reads zeros, and the other session's bytes and the daemon's copy (over gRPC) are untouched."""
    c, pool = tiny.client, tiny.pool_id
    used = c.describe_pool(pool).used_pages
    ap = c.attach(pool)
    slots = ap.allocate_slots(PAGE_SIZE)
    stale = ap.kv_buffer[1]
    stale[slots] = 7
    ap.detach()
    assert not ap.attached
    wait_for(lambda: c.describe_pool(pool).used_pages == used, SESSION_END_BOUND_S)  # the session's end frees it
    with pytest.raises(RuntimeError, match="detached"):
        ap.kv_buffer
    with KVTierClient(tiny.address) as c2, c2.attach(pool) as other:
        mine = other.allocate_slots(PAGE_SIZE)
        assert torch.equal(mine, slots)  # the freed page is handed out again
        rows = torch.randint(0, 256, (PAGE_SIZE, 656), dtype=torch.uint8)
        other.set_kv_buffer(1, mine, rows)
        assert int(stale.sum()) == 0
        stale.fill_(0xFF)
        assert torch.equal(other.kv_buffer[1][mine].view(PAGE_SIZE, 656), rows)
        assert torch.equal(c.read_kv(pool, mine, latent_layers=[1], index_layers=[]).latent[1], rows)


def test_a_tcp_client_and_a_tcp_daemon_cannot_attach(tiny, tmp_path):
    with KVTierClient("127.0.0.1:1") as c:  # nothing is asked of a TCP address: refused before any call
        with pytest.raises(FailedPreconditionError, match="attach needs the daemon's unix socket"):
            c.attach("default")
    with DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=["--device", "cpu", "--pool", "glm-5.2:256", "--pool-layers", "2"]) as d:
        with KVTierClient(d.address) as c:
            assert c.stats().attach_socket == ""
            with pytest.raises(FailedPreconditionError, match="attach needs the daemon's unix socket"):
                c.attach("default")
    assert tiny.client.stats().attach_socket == tiny.address.removeprefix("unix://") + ".attach"


def test_deleting_a_pool_ends_its_sessions(tiny):
    c = tiny.client
    c.create_pool("glm-5.2", num_layers=2, size_tokens=4 * PAGE_SIZE, pool_id="doomed")
    ap = c.attach("doomed")
    ap.allocate_slots(PAGE_SIZE)
    c.delete_pool("doomed", force=True)
    with pytest.raises(NotFoundError, match="attach session is unknown or has ended"):
        ap.allocate_slots(PAGE_SIZE)
    assert c.stats().attach_sessions == 0
    ap.detach()


def test_prefix_calls_on_the_attach_connection_carry_their_timeout(tiny, monkeypatch):
    """Attack pass 8, A8-6: the client's prefix calls on the attach connection carried no deadline,
    so the daemon applied a store_prefix the client had reported as DeadlineExceededError. Each now
    sends its timeout (``timeout_s``: the call's ``timeout``, else the client's), which the daemon
    accepts: the three calls go through, and each message carried the timeout its call was given."""
    import kvtier.client.attach as client_attach

    sent: list[dict] = []
    send = client_attach.send_message

    def recording(sock, message, fds=()):
        sent.append(dict(message))
        return send(sock, message, fds)

    pool = tiny.client.attach(tiny.pool_id)
    try:
        monkeypatch.setattr(client_attach, "send_message", recording)
        keys = tiny.page_keys(2, seed=41)
        lease = pool.load_prefix(keys, timeout=7.5)
        assert pool.store_prefix(lease, keys, lease.slots, timeout=8.5) == 2
        pool.release_prefix(lease)
    finally:
        monkeypatch.undo()
        pool.detach()
    assert [(m["kind"], m.get("timeout_s")) for m in sent] == [
        ("load_prefix", 7.5), ("store_prefix", 8.5), ("release_prefix", tiny.client.timeout)]


def test_a_staging_reply_that_comes_after_its_request_timed_out_is_not_taken_for_the_next(tiny):
    """A staging request that timed out leaves its reply (a buffer's descriptor) on the connection;
    the next staging request read that reply as its own and handed back a buffer of the earlier
    request's size (and every later request the one before it). Requests are now numbered and the
    reply echoes the number: here a 4096-byte request whose reply nobody read (as after a timeout)
    is followed by an 8192-byte one, which gets an 8192-byte buffer; a prefix call after it skips
    nothing of its own."""
    from kvtier.attach_wire import send_message

    pool = tiny.client.attach(tiny.pool_id)
    try:
        send_message(pool._sock, {"kind": "staging", "nbytes": 4096, "id": 10_000})  # noqa: SLF001 - timed out
        buf = pool.staging_buffer(8192)
        assert buf.numel() == 8192
        keys = tiny.page_keys(1, seed=43)
        lease = pool.load_prefix(keys)
        assert len(lease.slots) == PAGE_SIZE
        pool.release_prefix(lease)
    finally:
        pool.detach()
