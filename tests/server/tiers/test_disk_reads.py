"""The disk tier's read path pieces: caller buffers viewed without numpy, read chunks (borrowed
records share an arena chunk that comes back when they are gone), and batched reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.server.hostmem import HostArena
from kvtier.server.tiers import DiskTier, DiskTierConfig
from kvtier.server.tiers.disk_reads import RECORD_ALIGN, ReadChunks, writable_bytes
from tierkit import record_of

MiB = 1 << 20


def test_writable_bytes_views_a_tensor_without_copying():
    t = torch.zeros(1000, dtype=torch.uint8)
    buf = writable_bytes(t, 600)
    assert len(buf) == 600 and buf.format == "B" and not buf.readonly
    assert int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) == t.data_ptr()
    buf[10:13] = b"abc"
    assert t[10:13].tolist() == [97, 98, 99] and t[600:].sum() == 0
    assert writable_bytes(t, 600) is buf  # a reused buffer's view is made once
    other = torch.zeros(1000, dtype=torch.uint8)  # a buffer at another address gets its own view
    writable_bytes(other, 600)[0:2] = b"xy"
    assert other[:2].tolist() == [120, 121] and t[:2].tolist() == [0, 0]


def test_read_chunks_share_a_chunk_and_give_it_back_when_its_records_are_gone():
    arena = HostArena(2 * MiB, pin=False)
    chunks = ReadChunks(arena, chunk_bytes=MiB)
    n = 200_000  # 49 aligned pages: 5 a chunk
    got = [chunks.take(n) for _ in range(5)]
    assert all(arena.owns(t) and t.numel() == n and len(mv) == n for t, mv in got)
    starts = [arena.offset_of(t) for t, _ in got]
    assert starts == [starts[0] + i * (-(-n // RECORD_ALIGN) * RECORD_ALIGN) for i in range(5)]  # one chunk, bumped
    assert arena.stats().live_blocks == 1
    got[0][1][:3] = b"xyz"
    assert bytes(got[0][0][:3].numpy()) == b"xyz"  # the memoryview fills the tensor's bytes
    first = starts[0]
    del got
    t, mv = chunks.take(n)  # the chunk is full: the next one is the freed one again (best fit, same place)
    assert arena.offset_of(t) == first and arena.stats().fallbacks == 0
    del t, mv
    chunks.release()
    assert arena.stats().used_bytes == 0


def test_read_chunks_hand_out_the_place_of_the_records_dropped_last():
    """A stack: one record a call reuses one place; a window dropped whole is reused whole; a record
    dropped below a live one is reused once the one above it is dropped too."""
    arena = HostArena(8 * MiB, pin=False)
    chunks = ReadChunks(arena, chunk_bytes=4 * MiB)
    step = -(-100_000 // RECORD_ALIGN) * RECORD_ALIGN
    places = []
    for _ in range(4):
        t, mv = chunks.take(100_000)
        places.append(arena.offset_of(t))
        del t, mv
    assert len(set(places)) == 1
    window = [chunks.take(100_000)[0] for _ in range(3)]
    first = [arena.offset_of(t) for t in window]
    assert first == [first[0] + i * step for i in range(3)]
    del window
    again = [chunks.take(100_000)[0] for _ in range(3)]
    assert [arena.offset_of(t) for t in again] == first
    del again[1]  # the middle one: the top cannot fall back yet
    t, mv = chunks.take(100_000)
    assert arena.offset_of(t) == first[0] + 3 * step
    del t, mv, again[1]  # the top two are gone now: the next one goes where the middle one was
    t, mv = chunks.take(100_000)
    assert arena.offset_of(t) == first[1]
    del t, mv, again
    assert arena.stats().fallbacks == 0


def test_read_chunks_fall_back_to_fresh_memory_and_count_it():
    arena = HostArena(MiB, pin=False)
    chunks = ReadChunks(arena, chunk_bytes=MiB)
    big, _ = chunks.take(3 * MiB)  # larger than the arena: fresh memory
    assert not arena.owns(big) and big.numel() == 3 * MiB
    held = [chunks.take(200_000) for _ in range(5)]  # fills the only chunk
    extra, _ = chunks.take(200_000)  # no room anywhere: fresh memory
    assert not arena.owns(extra) and all(arena.owns(t) for t, _ in held)
    assert arena.stats().fallbacks == 2
    assert ReadChunks(None).take(10)[0].numel() == 10  # no arena at all


def test_a_batch_read_verifies_each_record_and_misses_only_the_damaged_one(tmp_path, pool, codec):
    """Eight records read in one call: a damaged one in the middle is a miss (counted, removed), the
    others come back byte for byte, in the caller's buffers and in borrowed ones."""
    disk = DiskTier(DiskTierConfig(path=str(tmp_path / "d"), capacity_bytes=16 * MiB))
    recs = {b"k%d" % i: record_of(codec, pool, 1 + i, seed=i) for i in range(8)}
    bad = recs[b"k3"].clone()
    bad[codec.header_nbytes + 11] ^= 4
    disk.write([(k, bad if k == b"k3" else r) for k, r in recs.items()])
    keys = list(recs) + [b"absent"]
    outs = [torch.zeros(r.numel() + 64, dtype=torch.uint8) for r in recs.values()] + [torch.zeros(8, dtype=torch.uint8)]
    sizes = disk.read_into(keys, outs)
    assert sizes == [r.numel() if k != b"k3" else 0 for k, r in recs.items()] + [0]
    for (k, r), o, n in zip(recs.items(), outs, sizes):
        if n:
            assert torch.equal(o[:n], r)
    s = disk.stats()
    assert (s.hits, s.misses, s.damaged) == (7, 2, 1) and not disk.contains([b"k3"])[0]
    with disk.borrow(keys) as got:
        assert [g is None for g in got] == [k in (b"k3", b"absent") for k in keys]
        for k, g in zip(keys, got):
            if g is not None:
                assert torch.equal(g, recs[k])
    disk.close()


def test_read_into_checks_every_buffer_before_copying_any(tmp_path, pool, codec):
    disk = DiskTier(DiskTierConfig(path=str(tmp_path / "d"), capacity_bytes=16 * MiB))
    recs = [record_of(codec, pool, 1 + i, seed=i) for i in range(2)]
    disk.write([(b"a", recs[0]), (b"b", recs[1])])
    first = torch.zeros(recs[0].numel(), dtype=torch.uint8)
    with pytest.raises(ValueError, match="too small"):
        disk.read_into([b"a", b"b"], [first, torch.zeros(100, dtype=torch.uint8)])
    assert int(first.sum()) == 0 and disk.stats().hits == 0
    disk.close()
