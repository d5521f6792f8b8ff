"""Host tier: budget and LRU eviction, write-back and write-through down to a real LMDB tier,
reads into the caller's buffer, damaged records, pins, and reads racing eviction."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.server.tiers import DiskTierConfig, HostTier, HostTierConfig, TierFullError, TierStack
from tierkit import record_of


@pytest.fixture
def records(pool, codec):
    return {bytes([i]) * 8: record_of(codec, pool, 1 + i % 8, seed=i) for i in range(8)}


def test_budget_evicts_lru_first(records, codec):
    size = codec.page_nbytes()
    host = HostTier(HostTierConfig(capacity_bytes=3 * size))
    keys = list(records)
    host.write([(k, records[k]) for k in keys[:3]])
    out = torch.empty(size, dtype=torch.uint8)
    assert host.read_into([keys[0]], [out]) == [size]          # touch key 0
    assert torch.equal(out, records[keys[0]])
    evicted = []
    host.write([(keys[3], records[keys[3]])], on_evict=lambda k, r: evicted.append(k))
    assert evicted == [keys[1]]
    assert host.contains(keys[:4]) == [True, False, True, True]
    assert host.index.keys() == [keys[2], keys[0], keys[3]]
    s = host.stats()
    assert (s.entries, s.used_bytes, s.evictions, s.pinned) == (3, 3 * size, 1, 0)


def test_lookup_is_the_longest_present_prefix(records, codec):
    host = HostTier(HostTierConfig(capacity_bytes=10 * codec.page_nbytes()))
    keys = list(records)
    host.write([(k, records[k]) for k in (keys[0], keys[1], keys[3])])
    assert host.lookup(keys[:5]) == 2
    assert host.lookup(keys[2:]) == 0


def test_write_back_moves_victims_to_disk_and_write_through_writes_at_once(tmp_path, records, codec):
    size = codec.page_nbytes()
    keys = list(records)
    for write_back in (True, False):
        stack = TierStack.from_configs([
            HostTierConfig(capacity_bytes=2 * size, write_back=write_back),
            DiskTierConfig(path=str(tmp_path / f"wb{write_back}"), capacity_bytes=8 << 20),
        ])
        host, disk = stack.tiers
        for k in keys[:3]:
            stack.put(k, records[k], source="device")
        if write_back:
            assert disk.contains(keys[:3]) == [True, False, False]  # only the victim went down
            assert stack.moves["host->disk"]["count"] == 1
        else:
            assert disk.contains(keys[:3]) == [True, True, True]    # everything went down on entry
            assert stack.moves["host->disk"]["count"] == 3
            assert stack.moves["host->gone"]["count"] == 1         # eviction just dropped it
        assert host.contains(keys[:3]) == [False, True, True]
        out = torch.empty(size, dtype=torch.uint8)
        assert disk.read_into([keys[0]], [out]) == [size] and torch.equal(out, records[keys[0]])
        stack.close()


def test_damaged_record_is_a_miss_counted_and_dropped(records, codec):
    host = HostTier(HostTierConfig(capacity_bytes=10 * codec.page_nbytes()))
    k = next(iter(records))
    rec = records[k].clone()
    host.write([(k, rec)])
    host.record(k)[codec.header_nbytes + 77] ^= 1  # memory corruption of the stored record after the write
    out = torch.empty(rec.numel(), dtype=torch.uint8)
    assert host.read_into([k], [out]) == [0]
    assert host.stats().damaged == 1 and host.contains([k]) == [False]


def test_too_small_buffer_is_rejected_before_copying(records, codec):
    host = HostTier(HostTierConfig(capacity_bytes=10 * codec.page_nbytes()))
    k = next(iter(records))
    host.write([(k, records[k])])
    out = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="too small"):
        host.read_into([k], [out])
    assert int(out.sum()) == 0 and host.stats().pinned == 0


def test_all_pinned_means_tier_full_and_nothing_changes(records, codec):
    size = codec.page_nbytes()
    host = HostTier(HostTierConfig(capacity_bytes=2 * size))
    keys = list(records)
    host.write([(k, records[k]) for k in keys[:2]])
    with host.borrow(keys[:2]):
        with pytest.raises(TierFullError):
            host.write([(keys[2], records[keys[2]])])
    assert host.contains(keys[:3]) == [True, True, False]
    assert host.stats().pinned == 0


def test_reads_racing_eviction_return_the_whole_record_or_a_miss(records, codec):
    size = codec.page_nbytes()
    host = HostTier(HostTierConfig(capacity_bytes=3 * size))
    keys = list(records)
    stop = threading.Event()
    bad: list[str] = []
    reads = [0, 0]  # per reader: reads done, hits among them

    def reader(i: int) -> None:
        out = torch.empty(size, dtype=torch.uint8)
        while not stop.is_set():
            for k in keys:
                n = host.read_into([k], [out])[0]
                reads[i] += 1
                if n and not torch.equal(out[:n], records[k]):
                    bad.append(k.hex())

    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    rounds = 0
    try:
        while rounds < 40 or min(reads) < 400:  # both readers really raced the writer
            for k in keys:
                host.write([(k, records[k])])
            rounds += 1
            assert rounds < 100_000
    finally:  # a failing writer must not leave the readers spinning (pytest would never exit)
        stop.set()
        for t in threads:
            t.join()
    assert bad == []
    s = host.stats()
    assert s.pinned == 0 and s.damaged == 0 and s.evictions > 0 and s.hits > 0


def test_records_live_in_the_tiers_arena_and_one_built_there_is_stored_without_a_copy(records, codec):
    host = HostTier(HostTierConfig(capacity_bytes=10 * codec.page_nbytes(), prefault=True))
    k1, k2 = list(records)[:2]
    host.write([(k1, records[k1])])  # built elsewhere: copied in
    stored = host.record(k1)
    assert host.arena.owns(stored) and stored.data_ptr() != records[k1].data_ptr()
    assert torch.equal(stored, records[k1])
    buf = host.record_buffer(records[k2].numel())
    buf.copy_(records[k2])
    host.write([(k2, buf)])
    assert host.record(k2) is buf  # built in the arena: kept as it is
    ptr, n = host.registration_range()
    assert ptr <= stored.data_ptr() < ptr + n and n >= 10 * codec.page_nbytes()
    assert host.stats().extra["arena_used_bytes"] >= 2 * codec.page_nbytes()


def test_a_full_tier_frees_its_victims_blocks_before_storing_the_new_record(records, codec):
    """At budget, the arena (budget + 1/16) has no room for a record built elsewhere until the victims
    are gone: eviction comes first, so the record still lands in the arena (no fallback)."""
    size = codec.page_nbytes()
    host = HostTier(HostTierConfig(capacity_bytes=8 * size, prefault=True))
    assert host.arena.capacity < 9 * -(-size // 4096) * 4096  # a 9th record cannot fit beside 8
    recs = list(records.values())
    for i in range(12):
        host.write([(b"key-%02d" % i, recs[i % len(recs)])])
    assert all(host.arena.owns(host.record(b"key-%02d" % i)) for i in range(4, 12))
    assert host.stats().extra["arena_fallbacks"] == 0
    assert host.arena.stats().live_blocks == 8  # the evicted records' blocks went back
