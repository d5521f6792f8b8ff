"""LMDB's map full inside kvtier's byte budget (attack pass 4, A4-9): churn of large records while a
read transaction pins old pages fills the map although the tier's charged bytes are under budget
(overflow runs need contiguous free pages). A map-full write is handled as a full tier (evict more in
the policy's order and retry), never as a storage fault; and a probe of an unhealthy tier whose map
is full applies its pending deletes first, so it can recover."""

from __future__ import annotations

import random

import lmdb
import pytest
import torch

from kvtier.server.pool import slots_of_pages
from kvtier.server.tiers import DiskTier, DiskTierConfig, TierFullError
from kvtier.server.tiers.errors import TierUnavailableError

MiB = 1 << 20


@pytest.fixture
def big_records(pool, codec):
    """Records of 1-4 pages (194-776 KB: up to ~9% of an 8 MiB map), each its own bytes."""
    from tierkit import fill_page

    out = []
    for i in range(16):
        n = 1 + i % 4
        for p in range(n):
            fill_page(pool, p, seed=1000 + 10 * i + p)
        out.append(codec.encode_from_pool(pool, slots_of_pages(torch.arange(n), 64)).clone())
    return out


def lmdb_reading(path) -> tuple[dict[bytes, bytes], int]:
    """Every record LMDB holds and its map's used bytes, read by a handle of the test's own (after close)."""
    env = lmdb.open(str(path), readonly=True, max_dbs=5, lock=False)
    try:
        db = env.open_db(b"records", create=False)
        with env.begin(db=db) as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}, (env.info()["last_pgno"] + 1) * 4096
    finally:
        env.close()


def read(disk: DiskTier, key: bytes, size: int) -> bytes | None:
    out = torch.empty(size, dtype=torch.uint8)
    n = disk.read_into([key], [out])[0]
    return bytes(out[:n].numpy()) if n else None


@pytest.mark.parametrize("write_behind", [False, True], ids=["sync", "write-behind"])
def test_map_full_under_churn_and_a_pinning_reader_evicts_instead_of_failing(tmp_path, big_records, write_behind):
    """An 8 MiB map, 40 keys of 1-4 page records rewritten and dropped at random, and a read
    transaction that stays open over stretches of 5 writes of every 10 (it pins every page freed meanwhile):
    LMDB's map fills although the tier's charged bytes stay under its budget. The tier stays healthy
    throughout (map-full is a full tier: more victims, counted evictions), every record whose write
    returned reads back byte for byte unless it was reported evicted (or, written behind, lost), and
    the index equals an independent reading of LMDB."""
    disk = DiskTier(DiskTierConfig(path=str(tmp_path), capacity_bytes=8 * MiB, write_behind=write_behind,
                                   probe_backoff_initial_s=60, probe_backoff_max_s=60))
    lost: list[int] = []
    disk.on_lost = lambda n, _b: lost.append(n)
    disk.open()
    env = disk._env_obj  # noqa: SLF001 - the environment the tier owns: the test's reader pins its pages
    rnd = random.Random(7)
    held: dict[bytes, bytes] = {}  # acknowledged and neither dropped nor reported evicted
    evicted: set[bytes] = set()
    refused = 0
    reader = None
    for i in range(300):
        if i % 10 == 0:
            reader = env.begin()  # a long read: every page freed from now on stays pinned
            reader.get(b"x")
        elif i % 10 == 5 and reader is not None:
            reader.abort()
            reader = None
        key = b"k%02d" % rnd.randrange(40)
        rec = big_records[rnd.randrange(len(big_records))]
        if rnd.random() < 0.2:
            disk.remove([key])
            disk.drain()  # committed while the reader pins pages (written behind, a remove is queued too)
            held.pop(key, None)
            continue
        disk.remove([key])
        disk.drain()
        held.pop(key, None)
        try:
            disk.write([(key, rec)], on_evict=lambda v, _n: evicted.add(v))
        except TierFullError:
            assert not write_behind
            refused += 1  # evicting all did not help while the reader pinned the freed pages: this write alone fails
            continue
        assert disk.health.healthy, disk.health.snapshot().reason
        for v in evicted:
            held.pop(v, None)
        evicted.clear()
        held[key] = bytes(rec.numpy())
        assert disk.index.used <= disk.index.capacity
    if reader is not None:
        reader.abort()
    disk.drain()
    assert disk.health.healthy, disk.health.snapshot().reason
    stats = disk.stats()
    assert stats.extra["map_full_evictions"] > 0  # the churn really did fill LMDB's map
    assert stats.io_errors == 0
    for v in evicted:
        held.pop(v, None)
    index_keys = set(disk.index.keys())
    # written behind, a record is lost only when even emptying the tier could not make room
    assert sum(lost) == 0 or write_behind
    for k, want in held.items():
        if k in index_keys:
            assert read(disk, k, len(want)) == want, k
        else:
            assert write_behind and sum(lost) > 0, f"acknowledged {k!r} vanished: neither evicted nor lost"
    # after the load the tier takes records again
    disk.write([(b"after", big_records[3])])
    disk.drain()
    assert read(disk, b"after", big_records[3].numel()) == bytes(big_records[3].numpy())
    index_keys = set(disk.index.keys())
    disk.close()
    contents, used = lmdb_reading(tmp_path)
    assert set(contents) == index_keys
    for k, v in contents.items():
        if k in held:
            assert v == held[k]
    assert used <= 8 * MiB


def test_probe_with_a_full_map_applies_the_pending_deletes_first_and_recovers(tmp_path, big_records, monkeypatch):
    """The map is filled to its end (kvtier's budget made wrong on purpose, as a fragmented map
    would), the tier is unhealthy and copies are dropped meanwhile (tombstones): the probe deletes
    them before it writes its probe record, so it fits, the tier serves again and the index equals
    LMDB."""
    disk = DiskTier(DiskTierConfig(path=str(tmp_path), capacity_bytes=8 * MiB))
    disk.open()
    disk.index.capacity = 100 * MiB  # LMDB's map, not the budget, is what stops the writes
    monkeypatch.setattr(disk, "_make_room_for", lambda *a, **k: False, raising=False)  # and no eviction makes room
    rec = big_records[3]  # 4 pages: 776 KB
    keys = []
    for i in range(40):
        try:
            disk.write([(b"f%02d" % i, rec)])
        except TierFullError:
            break
        keys.append(b"f%02d" % i)
    assert len(keys) >= 5
    small = []
    for i in range(40):  # the rest of the map with one-page records
        try:
            disk.write([(b"s%02d" % i, big_records[0])])
        except TierFullError:
            break
        small.append(b"s%02d" % i)
    with pytest.raises(TierFullError):  # the map is full: not even a one-page record fits
        disk.write([(b"small", big_records[0])])
    monkeypatch.undo()
    disk.index.capacity = disk.config.record_budget
    disk.health.mark_unhealthy("test: the disk failed")
    assert disk.remove(keys[:3]) == 3 and disk.stats().extra["tombstones"] == 3
    with pytest.raises(TierUnavailableError):
        disk.write([(b"small", big_records[0])])
    disk.probe()  # before the fix: the probe's own put met MDB_MAP_FULL and the deletes never ran
    disk.health.mark_healthy()
    assert disk.stats().extra["tombstones"] == 0
    left = set(disk.index.keys())
    assert left == set(keys[3:]) | set(small)  # the deletes made the room: nothing else was evicted
    for k in left:
        want = rec if k in keys else big_records[0]
        assert read(disk, k, want.numel()) == bytes(want.numpy())
    disk.write([(b"small", big_records[0])])
    left = set(disk.index.keys())
    disk.close()
    contents, _ = lmdb_reading(tmp_path)
    assert set(contents) == left
