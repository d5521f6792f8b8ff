"""ReadKV's messages in process: the streamed read carries read_kv's bytes in either form, whatever
the slots (contiguous runs read as views of the pool, scattered ones gathered), checks everything
before it returns, and gives the pool's shared lock back when the reader falls behind or stops
(a writer waits for the copy, not for the stream)."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
from daemonkit import A, daemon, fill, pool

from kvtier.server.daemon import kv_ops, kv_stream
from kvtier.server.daemon.errors import InvalidArgument
from kvtier.server.daemon.kv_ops import KVSelection


@pytest.fixture
def d():
    dm = daemon(host_memory_bytes=8 << 20)
    yield dm
    dm.close()


def selection(slots, layers=range(4), live=(0, 1, 2)) -> KVSelection:
    return KVSelection(pool_id="p", slots=slots.tolist(), latent_layers=tuple(layers), index_layers=tuple(live))


def raw(p: kv_stream.Piece, data: list[memoryview]) -> bytes:
    """A test encoding: the piece's position, then its bytes."""
    return repr((p.layer_id, p.component, p.offset)).encode() + b"|" + b"".join(data)


def split(msg: bytes) -> tuple[tuple, bytes]:
    head, _, data = msg.partition(b"|")
    return eval(head), data  # noqa: S307 - our own repr of ints and a str


def whole_and_segments(d, slots):
    want = kv_ops.read_kv(d.pools, A, selection(slots))
    return b"".join(a.tobytes() for _, a in want), want


@pytest.mark.parametrize("order", ["pages", "reversed pages", "scattered"])
@pytest.mark.parametrize("packed", [True, False])
def test_messages_carry_read_kvs_bytes(d, order, packed):
    """Whole pages in order (views of the pool), pages out of order (runs of 64: still views) and
    scattered tokens (gathered) give the same bytes as read_kv, cut as the form says."""
    pool(d, A)
    base, rows = fill(d, A, "p", 320, seed=4)
    perm = torch.arange(320)
    if order == "reversed pages":
        perm = perm.view(-1, 64).flip(0).reshape(-1)
    elif order == "scattered":
        perm = torch.randperm(320, generator=torch.Generator().manual_seed(3))
    slots = base[perm]
    whole, segs = whole_and_segments(d, slots)
    chunk = 5000
    read = kv_stream.read_kv_messages(d.pools, A, selection(slots), chunk, packed=packed, encode=raw)
    got = [split(m) for m in read]
    assert read.nbytes == len(whole)
    if packed:
        assert [h for h, _ in got] == [(0, "", off) for off in range(0, len(whole), chunk)]
        assert all(len(data) == chunk for _, data in got[:-1])
        assert b"".join(data for _, data in got) == whole
    else:
        want = [((s.layer_id, s.component, off), a.tobytes()[off:off + chunk]) for s, a in segs for off in range(0, a.size, chunk)]
        assert got == want
    assert whole[:320 * 656] == rows[perm].numpy().tobytes()  # layer 0's latent: the rows written, in slot order


def test_plan_pieces_cover_each_segment_once():
    segs = [kv_ops.Segment(0, "latent", 10), kv_ops.Segment(1, "latent", 3), kv_ops.Segment(1, "index_k", 7)]
    packed = kv_stream.plan_pieces(segs, 4, packed=True)
    assert [(p.offset, p.data) for p in packed] == [
        (0, ((0, 0, 4),)), (4, ((0, 4, 8),)), (8, ((0, 8, 10), (1, 0, 2))), (12, ((1, 2, 3), (2, 0, 3))), (16, ((2, 3, 7),))]
    flat = kv_stream.plan_pieces(segs, 4, packed=False)
    assert [(p.layer_id, p.component, p.offset, p.data) for p in flat] == [
        (0, "latent", 0, ((0, 0, 4),)), (0, "latent", 4, ((0, 4, 8),)), (0, "latent", 8, ((0, 8, 10),)),
        (1, "latent", 0, ((1, 0, 3),)), (1, "index_k", 0, ((2, 0, 4),)), (1, "index_k", 4, ((2, 4, 7),))]


def test_bad_input_fails_before_the_read_returns(d):
    pool(d, A)
    slots, _ = fill(d, A, "p", 64, seed=1)
    with pytest.raises(InvalidArgument):
        kv_stream.read_kv_messages(d.pools, A, selection(slots + 10_000), 4096, packed=True, encode=raw)
    with pytest.raises(InvalidArgument):
        kv_stream.read_kv_messages(d.pools, A, selection(slots, layers=[0, 0]), 4096, packed=True, encode=raw)


def test_a_reader_that_stops_gives_the_lock_back_and_still_reads_the_snapshot(d):
    """The reader takes one message and pauses: a writer gets the exclusive lock (the rest was copied
    out, the indexer's keys and scales gathered then: the read had not reached them), changes every
    row, key and scale, and the reader then reads on the bytes of before the write."""
    pool(d, A)
    slots, _ = fill(d, A, "p", 256, seed=2)
    with d.pools.locked(A, "p", exclusive=True) as e:  # keys and scales that are not zeros
        g = torch.Generator().manual_seed(5)
        for layer in e.pool.live_layers:
            e.pool.set_index_k_scale_buffer(layer, slots, torch.randint(1, 256, (256, e.pool.index_head_dim), dtype=torch.uint8,
                                                                        generator=g), torch.rand(256, generator=g) + 1)
    whole, _ = whole_and_segments(d, slots)
    read = kv_stream.read_kv_messages(d.pools, A, selection(slots), 4096, packed=True, encode=raw)
    it = iter(read)
    first = split(next(it))[1]
    got = threading.Event()

    def writer():
        with d.pools.locked(A, "p", exclusive=True) as e:
            for layer in range(e.pool.layer_num):
                e.pool.set_kv_buffer(layer, slots, torch.zeros(256, e.pool.row_bytes, dtype=torch.uint8))
            for layer in e.pool.live_layers:
                e.pool.set_index_k_scale_buffer(layer, slots, torch.zeros(256, e.pool.index_head_dim, dtype=torch.uint8),
                                                torch.zeros(256, dtype=torch.float32))
            got.set()

    t = threading.Thread(target=writer)
    t.start()
    t.join(timeout=60)
    assert got.is_set()
    assert first + b"".join(split(m)[1] for m in it) == whole
    assert kv_ops.read_kv(d.pools, A, selection(slots))[-1][1].tobytes() == bytes(256 * 4)  # the write did land


def test_a_closed_reader_frees_the_lock_at_once(d):
    """A reader that takes one message and closes the stream gives the shared lock back in the close
    (a huge patience: the hold watch cannot be what released it)."""
    pool(d, A)
    slots, _ = fill(d, A, "p", 256, seed=2)
    read = kv_stream.read_kv_messages(d.pools, A, selection(slots), 4096, packed=True, encode=raw,
                                      patience_s=3600, max_hold_s=3600)
    it = iter(read)
    next(it)
    entry = d.pools.get(A, "p")
    assert entry.lock._readers == 1
    it.close()
    assert entry.lock._readers == 0
    with d.pools.locked(A, "p", exclusive=True):
        pass


def test_a_read_never_started_is_released_by_the_hold_watch(d):
    """A read that is returned but never iterated (its caller went away before the first message)
    does not keep writers out: the hold watch copies it out after patience_s and the writer gets
    the lock; the snapshot still reads the bytes of before the write."""
    pool(d, A)
    slots, _ = fill(d, A, "p", 128, seed=5)
    whole, _ = whole_and_segments(d, slots)
    read = kv_stream.read_kv_messages(d.pools, A, selection(slots), 4096, packed=True, encode=raw, patience_s=0.05)
    got = threading.Event()

    def writer():
        with d.pools.locked(A, "p", exclusive=True) as e:
            e.pool.set_kv_buffer(0, slots, torch.zeros(128, e.pool.row_bytes, dtype=torch.uint8))
            got.set()

    t = threading.Thread(target=writer)
    t.start()
    t.join(timeout=60)
    assert got.is_set()
    assert b"".join(split(m)[1] for m in read) == whole


def test_a_read_held_past_max_hold_releases_between_messages(d):
    """A reader that keeps up still gives the lock back once it has been held max_hold_s (0 here):
    after the first message the rest comes from a copy and the lock is free."""
    pool(d, A)
    slots, _ = fill(d, A, "p", 128, seed=6)
    whole, _ = whole_and_segments(d, slots)
    read = kv_stream.read_kv_messages(d.pools, A, selection(slots), 4096, packed=True, encode=raw,
                                      patience_s=3600, max_hold_s=0.0)
    it = iter(read)
    first = split(next(it))[1]
    entry = d.pools.get(A, "p")
    assert entry.lock._readers == 0
    with d.pools.locked(A, "p", exclusive=True) as e:
        e.pool.set_kv_buffer(0, slots, torch.zeros(128, e.pool.row_bytes, dtype=torch.uint8))
    assert first + b"".join(split(m)[1] for m in it) == whole


def test_a_copy_out_without_memory_ends_the_read_and_frees_the_lock(d, monkeypatch):
    """The hold watch's copy-out of a stalled reader's rest cannot get host memory: the pool's shared
    lock is released all the same (a writer gets in) and the reader's next message raises the
    MemoryError (RESOURCE_EXHAUSTED at a client), instead of the lock staying held."""
    pool(d, A)
    slots, _ = fill(d, A, "p", 256, seed=2)

    def no_memory(*_args, **_kw):
        raise MemoryError("cannot allocate the copy")

    monkeypatch.setattr(kv_stream._Sources, "copy_out", no_memory)
    read = kv_stream.read_kv_messages(d.pools, A, selection(slots), 4096, packed=True, encode=raw, patience_s=0.02)
    it = iter(read)
    next(it)
    got = threading.Event()

    def writer():
        with d.pools.locked(A, "p", exclusive=True):
            got.set()

    t = threading.Thread(target=writer)
    t.start()
    t.join(timeout=60)
    assert got.is_set()
    with pytest.raises(MemoryError, match="cannot allocate"):
        next(it)
    assert d.pools.get(A, "p").lock._readers == 0


def test_the_indexer_gather_waits_for_the_stream_and_its_memory_error_ends_the_read(d, monkeypatch):
    """The indexer's keys and scales are gathered when the stream reaches them, not before the first
    message; when that gather cannot get host memory, the latent messages already sent stand, the
    next message raises the MemoryError (RESOURCE_EXHAUSTED at a client) and the lock is released."""
    pool(d, A)
    slots, _ = fill(d, A, "p", 128, seed=2)
    entry = d.pools.get(A, "p")
    calls = []

    def no_memory(*_args, **_kw):
        calls.append(1)
        raise MemoryError("cannot allocate the indexer's block")

    monkeypatch.setattr(entry.pool, "get_index_k_scale_layers", no_memory)
    latent_bytes = 4 * 128 * entry.pool.row_bytes
    read = kv_stream.read_kv_messages(d.pools, A, selection(slots), 4096, packed=True, encode=raw,
                                      patience_s=3600, max_hold_s=3600)
    it = iter(read)
    got = b""
    while len(got) + 4096 <= latent_bytes:  # every message made of latent rows alone
        got += split(next(it))[1]
    assert not calls
    with pytest.raises(MemoryError, match="indexer"):
        next(it)
    assert calls and entry.lock._readers == 0
    assert got == b"".join(a.tobytes() for _, a in kv_ops.read_kv(d.pools, A, selection(slots, live=())))[:len(got)]


def _pool_gone(ref, timeout_s: float = 10.0) -> bool:
    """Whether the object behind weakref ``ref`` is freed within ``timeout_s`` (collecting garbage as it waits)."""
    end = time.monotonic() + timeout_s
    while ref() is not None and time.monotonic() < end:
        gc.collect()
        time.sleep(0.02)
    return ref() is None


def test_a_deleted_pool_is_freed_after_a_read_the_hold_watch_released(d):
    """A reader stalls after its first message; the hold watch copies the rest out and lets a writer
    in; the read is then finished and dropped, and the pool deleted. Nothing may keep the pool (its
    whole arena) or the read's host copy alive: the hold watch's loop variable kept the last read it
    looked at -- its snapshot, that snapshot's pool entry and the copy of the rest -- until another
    read came along, so a deleted pool's memory stayed mapped while the daemon was idle."""
    pool(d, A)
    slots, _ = fill(d, A, "p", 256, seed=7)
    whole, _ = whole_and_segments(d, slots)
    pool_ref = weakref.ref(d.pools.get(A, "p").pool)
    read = kv_stream.read_kv_messages(d.pools, A, selection(slots), 4096, packed=True, encode=raw, patience_s=0.02)
    it = iter(read)
    first = split(next(it))[1]
    with d.pools.locked(A, "p", exclusive=True):  # only once the hold watch copied the rest out
        pass
    assert first + b"".join(split(m)[1] for m in it) == whole
    del read, it
    d.pools.delete(A, "p", force=True)
    assert _pool_gone(pool_ref)


def test_a_deleted_pool_that_was_never_read_is_freed(d):
    """The control of the test above: a pool written and deleted without a read is freed."""
    pool(d, A)
    fill(d, A, "p", 256, seed=7)
    pool_ref = weakref.ref(d.pools.get(A, "p").pool)
    d.pools.delete(A, "p", force=True)
    assert _pool_gone(pool_ref)
