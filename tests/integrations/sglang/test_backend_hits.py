"""A get the backend calls a hit carries the bytes that were set (issue 23, defects 1 and 6).

Each test forces one interleaving that used to hand SGLang wrong bytes as hits, then compares the
host pages with the bytes set (snapshots of the source pages, taken before anything was read):

* a thread with no staging buffer reads over gRPC while another thread ends and gives its buffer
  back (the injected hook: the gRPC read's wrapper ends that thread before returning);
* a read while the daemon is down, the daemon restarted on the same socket and disk, a read;
* a v1 read refused (float host indices) followed by the v2 indexer read of the same pages.
"""

from __future__ import annotations

import gc
import threading

import torch
from hosts import HostPools, indexer, load, make_backend, page_keys, store
from sglang.srt.mem_cache.hicache_storage import PoolName

from kvtier.client import KVTierError
from kvtier.client.spawn import DaemonProcess


def same_pages(pools: HostPools, idx: torch.Tensor, want) -> list[bool]:
    """Per page at ``idx``: its KV and indexer bytes equal ``want`` (a :meth:`HostPools.snapshot`)."""
    return [bool(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])) for g, w in zip(pools.snapshot(idx), want)]


def wait_reachable(b, keys) -> None:
    """Until the backend's gRPC channel reaches the restarted daemon, asked past the transport (so
    the backend itself learns nothing of the restart: its next read meets it as SGLang's would)."""
    for _ in range(600):
        try:
            assert b.transport.client.exist_units(b._stage(), [k.encode() for k in keys]) == len(keys)
            return
        except KVTierError:
            threading.Event().wait(0.1)
    raise AssertionError("the backend's gRPC channel never reached the restarted daemon")


def test_a_grpc_read_copies_its_own_bytes_while_another_thread_gives_back_its_staging_buffer(tmp_path):
    """Regression (issue 23, defect 1a): the session's 4 staging buffers are lent (this thread and 3
    readers that wait); a 5th thread reads 8 stored pages, over gRPC. Injected hook: when its gRPC
    read returns, one waiting reader ends and its buffer goes back to the free list. The backend used
    to ask for a staging buffer a second time, got the freed one and copied the other reader's page
    out of it: 8 x True, pages wrong. Now the read copies from the buffer it filled."""
    d = DaemonProcess(f"unix://{tmp_path}/k.sock", extra_args=["--device", "cpu", "--host-memory", "64MiB"])
    d.start()
    try:
        pools = HostPools()
        b = make_backend(pools, {"address": d.address, "timeout_s": 30})
        keys, src = page_keys(8, salt=71), pools.alloc(8)
        pools.fill(src, seed=71)
        want = pools.snapshot(src)
        store(b, keys, src)                       # this thread now holds staging buffer 1 of 4
        other_key, other_src = page_keys(1, salt=72), pools.alloc(1)
        pools.fill(other_src, seed=72)
        store(b, other_key, other_src)
        go_home = [threading.Event() for _ in range(3)]
        lent = [threading.Event() for _ in range(3)]
        errors: list[BaseException] = []

        def reader(n: int) -> None:               # holds a buffer (with other_key's page in it) until told
            try:
                dst = pools.alloc(1)
                assert load(b, other_key, dst) == ([True], [True])
                lent[n].set()
                go_home[n].wait(120)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                lent[n].set()

        readers = [threading.Thread(target=reader, args=(n,)) for n in range(3)]
        for th in readers:
            th.start()
        assert all(e.wait(120) for e in lent) and errors == []
        shm = b.transport
        assert shm.name == "shm" and shm._lent == shm._max_buffers == 4   # every buffer is lent

        grpc_get = shm.grpc.get

        def get_then_free_a_buffer(*args, **kwargs):   # the hook: a reader ends as this read returns
            out = grpc_get(*args, **kwargs)
            if go_home[0].is_set():
                return out
            go_home[0].set()
            readers[0].join(120)
            for _ in range(1000):                  # the ended thread's buffer is given back
                gc.collect()
                if shm._free or getattr(shm, "_returned", None):
                    break
                threading.Event().wait(0.01)
            assert shm._free or shm._returned, "the ended reader's staging buffer was never given back"
            return out

        shm.grpc.get = get_then_free_a_buffer
        dst = pools.alloc(8)
        pools.zero(dst)
        got: list = []
        t = threading.Thread(target=lambda: got.append(load(b, keys, dst)))
        t.start()
        t.join(120)
        shm.grpc.get = grpc_get
        for e in go_home:
            e.set()
        for th in readers:
            th.join(120)
        assert errors == [] and got == [([True] * 8, [True] * 8)]
        assert same_pages(pools, dst, want) == [True] * 8
    finally:
        d.stop()
        d.cleanup()


def test_after_a_read_while_the_daemon_was_down_and_a_restart_hits_carry_the_stored_bytes(tmp_path, monkeypatch):
    """Regression (issue 23, defect 1b): a read while the daemon is down (the storage-session
    handshake fails), the daemon restarted on the same socket and disk, a read of 4 stored pages: it
    went over gRPC (no session yet), the gRPC call reaching the daemon let a session open, and the
    backend copied out of that new session's empty buffer: 4 x True, all zeros (the v2 read after it:
    True too). ``REOPEN_AFTER_S`` is made an hour so the interleaving does not depend on how long
    the restart takes."""
    from kvtier.integrations.sglang import transport as transport_module

    monkeypatch.setattr(transport_module, "REOPEN_AFTER_S", 3600.0)
    d = DaemonProcess(f"unix://{tmp_path}/k.sock", extra_args=[
        "--device", "cpu", "--host-memory", "16MiB", "--disk-path", str(tmp_path / "disk"), "--disk-size", "64MiB"])
    d.start()
    try:
        pools = HostPools()
        b = make_backend(pools, {"address": d.address, "timeout_s": 10})
        keys, src = page_keys(4, salt=81), pools.alloc(4)
        pools.fill(src, seed=81)
        want = pools.snapshot(src)
        store(b, keys, src)
        d.stop()                                  # graceful: the disk tier keeps the units
        dst = pools.alloc(4)
        assert load(b, keys, dst) == ([False] * 4, [False] * 4)   # down: misses
        d.start()
        wait_reachable(b, keys)
        pools.zero(dst)
        got = load(b, keys, dst)
        assert got == ([True] * 4, [True] * 4) and same_pages(pools, dst, want) == [True] * 4
        pools.zero(dst)                           # and again, now through the new session's buffer
        assert load(b, keys, dst) == ([True] * 4, [True] * 4) and same_pages(pools, dst, want) == [True] * 4
    finally:
        d.stop()
        d.cleanup()


def test_a_refused_v1_read_leaves_nothing_for_the_v2_read_after_it(tmp_path):
    """Regression (issue 23, defect 6): a v1 read of pages P (it delivers their indexer rows too and
    remembers it), then a v1 read refused for float host indices, then the v2 indexer read of P:
    it answered True from the first read's memo and moved no byte, though the host pages had been
    zeroed since. Now a v1 read clears the memo when it starts, so the v2 read reads from the
    daemon; and a memo answers one v2 read only."""
    d = DaemonProcess(f"unix://{tmp_path}/k.sock", extra_args=["--device", "cpu", "--host-memory", "16MiB"])
    d.start()
    try:
        pools = HostPools()
        b = make_backend(pools, {"address": d.address, "timeout_s": 30})
        keys, src = page_keys(3, salt=91), pools.alloc(3)
        pools.fill(src, seed=91)
        want = pools.snapshot(src)
        store(b, keys, src)
        dst = pools.alloc(3)
        assert b.batch_get_v1(keys, dst) == [True] * 3
        pools.zero(dst)
        assert b.batch_get_v1(keys, dst.to(torch.float32)) == [False] * 3      # refused: float indices
        assert b.batch_get_v2(indexer(keys, dst))[PoolName.INDEXER] == [True] * 3
        got = [bool(torch.equal(g[1], w[1])) for g, w in zip(pools.snapshot(dst), want)]
        assert got == [True] * 3                  # the indexer rows really came (from the daemon)
        # a memo answers one v2 read: the second reads again (the rows were zeroed in between)
        assert load(b, keys, dst) == ([True] * 3, [True] * 3)
        pools.zero(dst)
        assert b.batch_get_v2(indexer(keys, dst))[PoolName.INDEXER] == [True] * 3
        assert [bool(torch.equal(g[1], w[1])) for g, w in zip(pools.snapshot(dst), want)] == [True] * 3
    finally:
        d.stop()
        d.cleanup()


def test_a_staged_call_without_its_answer_abandons_its_buffer(tmp_path):
    """A staged read that ends without the daemon's answer (here: DEADLINE_EXCEEDED, injected) may
    leave the daemon still copying into the thread's staging buffer. Injected hook: the session's
    ``get_units_staged`` raises DEADLINE_EXCEEDED once, and on every later call in that session the
    late copy lands (0xAB over the buffer) after the daemon's answer and before the backend copies
    out. The backend used to reuse the buffer: the next read's hits carried 0xAB. Now a call
    without its answer abandons the session: the next read uses a fresh session and buffer."""
    from kvtier.client import DeadlineExceededError

    d = DaemonProcess(f"unix://{tmp_path}/k.sock", extra_args=["--device", "cpu", "--host-memory", "16MiB"])
    d.start()
    try:
        pools = HostPools()
        b = make_backend(pools, {"address": d.address, "timeout_s": 30})
        keys, src = page_keys(3, salt=95), pools.alloc(3)
        pools.fill(src, seed=95)
        want = pools.snapshot(src)
        store(b, keys, src)                        # this thread holds a staging buffer of session S
        held = b.transport._local.held
        client, buf = held.session.client, held.buffer
        real = client.get_units_staged
        calls = []

        def late_copy(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise DeadlineExceededError("injected: the deadline passed before the daemon answered")
            found = real(*args, **kwargs)
            buf.tensor.fill_(0xAB)                 # the first call's copy, landing late
            return found

        client.get_units_staged = late_copy
        dst = pools.alloc(3)
        assert b.batch_get_v1(keys, dst) == [False] * 3          # the deadline: a miss
        pools.zero(dst)
        assert load(b, keys, dst) == ([True] * 3, [True] * 3)
        assert same_pages(pools, dst, want) == [True] * 3
        assert b.transport._local.held.session is not held.session   # S was abandoned
    finally:
        d.stop()
        d.cleanup()


def test_a_staged_store_without_its_answer_never_has_its_buffer_refilled(tmp_path):
    """The same for a store: a staged put that ends without the daemon's answer may leave the daemon
    still reading the buffer. Injected hook: the session's ``put_units_staged`` raises
    DEADLINE_EXCEEDED once (units A's indexer parts), and the daemon's late read of that call
    happens at the session's next put, after the backend refilled the buffer with units B's parts.
    The backend used to refill the same buffer: unit A got B's indexer rows and a read of A hit with
    them. Now the session is abandoned: a read of A hits only with A's own bytes (here it misses:
    its indexer part never arrived)."""
    from kvtier.client import DeadlineExceededError

    d = DaemonProcess(f"unix://{tmp_path}/k.sock", extra_args=["--device", "cpu", "--host-memory", "16MiB"])
    d.start()
    try:
        pools = HostPools()
        b = make_backend(pools, {"address": d.address, "timeout_s": 30})
        first, first_src = page_keys(1, salt=97), pools.alloc(1)
        pools.fill(first_src, seed=97)
        store(b, first, first_src)                 # this thread holds a staging buffer of session S
        held = b.transport._local.held
        client = held.session.client
        real = client.put_units_staged
        late: list = []

        def late_read(*args, **kwargs):
            if not late:
                late.append((args, kwargs))
                raise DeadlineExceededError("injected: the deadline passed before the daemon answered")
            if late[0] is not None:
                a, k = late[0]
                late[0] = None
                real(*a, **k)                      # the first call's read of the buffer, landing late
            return real(*args, **kwargs)

        client.put_units_staged = late_read
        keys_a, src_a = page_keys(2, salt=98), pools.alloc(2)
        keys_b, src_b = page_keys(2, salt=99), pools.alloc(2)
        pools.fill(src_a, seed=98)
        pools.fill(src_b, seed=99)
        want_a = pools.snapshot(src_a)
        assert b.batch_set_v2(indexer(keys_a, src_a))[PoolName.INDEXER] == [False, False]   # the deadline
        store(b, keys_b, src_b)
        b.batch_set_v1(keys_a, src_a)
        dst = pools.alloc(2)
        pools.zero(dst)
        kv, ix = load(b, keys_a, dst)
        right = same_pages(pools, dst, want_a)
        assert all(r for r, k, i in zip(right, kv, ix) if k or i), f"hits {kv}, {ix} with bytes right: {right}"
        assert (kv, ix) == ([False] * 2, [False] * 2)   # A's indexer parts never arrived: not whole units
    finally:
        d.stop()
        d.cleanup()


def test_a_buffer_given_back_by_the_garbage_collector_inside_the_transport_lock_does_not_deadlock(tmp_path):
    """A lent buffer goes back when its thread's holder dies, by a finalizer that runs wherever the
    holder dies: inside the garbage collector, possibly in a thread that holds the transport's lock
    (a holder kept alive by an exception's traceback cycle). The finalizer took that lock (not
    reentrant): the thread blocked on itself and every later call of the backend with it (a 32-thread
    run of the stress test hung so). Here the give-back runs under the lock, as the collector would
    run it; it must return, and the buffer must be lent again afterwards."""
    d = DaemonProcess(f"unix://{tmp_path}/k.sock", extra_args=["--device", "cpu", "--host-memory", "16MiB"])
    d.start()
    try:
        pools = HostPools()
        b = make_backend(pools, {"address": d.address, "timeout_s": 30})
        keys, src = page_keys(2, salt=93), pools.alloc(2)
        pools.fill(src, seed=93)
        want = pools.snapshot(src)
        shm = b.transport
        holders: list = []

        def lend() -> None:
            store(b, keys, src)
            holders.append(shm._local.held)

        t = threading.Thread(target=lend)
        t.start()
        t.join(60)
        held = holders.pop()
        done = threading.Event()

        def give_back_under_the_lock() -> None:
            with shm._lock:
                shm._give_back(held.buffer, held.generation)
            done.set()

        g = threading.Thread(target=give_back_under_the_lock, daemon=True)
        g.start()
        g.join(60)
        assert done.is_set(), "giving a buffer back under the transport's lock deadlocked"
        dst = pools.alloc(2)
        got: list = []
        r = threading.Thread(target=lambda: got.append((load(b, keys, dst), shm._local.held.buffer.index)))
        r.start()
        r.join(60)
        assert got == [(([True] * 2, [True] * 2), held.buffer.index)]   # the given-back buffer, lent again
        assert same_pages(pools, dst, want) == [True] * 2
    finally:
        d.stop()
        d.cleanup()
