"""TierStack.put_many (one write per tier for a batch, the victims going down together) against
putting the same records one at a time: the same placement, the same moves, the same LMDB contents;
a record a tier cannot take in the middle of a batch is passed down alone, the rest stay. Real host
arena and a real LMDB environment."""

from __future__ import annotations

import pytest
import torch

from kvtier.server.tiers import DiskTierConfig, HostTierConfig, TierStack, disk_charge
from tierkit import record_of

MiB = 1 << 20


@pytest.fixture
def records(pool, codec):
    return [(b"sb-%02d" % i, record_of(codec, pool, 1 + i % 8, seed=300 + i)) for i in range(16)]


def stack_at(path, size: int, host_records: int = 3, disk_records: int = 5) -> TierStack:
    per = disk_charge(size)
    disk_bytes = int(per * disk_records / 0.2) + 4096  # a roomy map: LMDB reuses freed pages two commits later
    s = TierStack.from_configs([HostTierConfig(capacity_bytes=host_records * size),
                                DiskTierConfig(path=str(path), capacity_bytes=disk_bytes, reserve_fraction=0.8)])
    assert s.tiers[1].index.capacity // per == disk_records
    return s


def snapshot(stack: TierStack, keys: list[bytes]) -> tuple:
    return stack.where(keys), stack.moves_snapshot(), [t.index.keys() for t in stack.tiers]


def test_a_batch_lands_and_counts_as_one_record_at_a_time(tmp_path, records, codec):
    """16 records into host (3) -> disk (5) -> gone, as one batch and one by one: identical where(),
    move counters and LRU orders; bytes read back from each tier are the records' own. The batch's
    disk write evicts records it wrote itself (the first ones) and counts them as written, then gone."""
    size = codec.page_nbytes()
    keys = [k for k, _ in records]
    one = stack_at(tmp_path / "one", size)
    for k, r in records:
        one.put(k, r, source="device")
    batch = stack_at(tmp_path / "batch", size)
    placed = batch.put_many(records, source="device")
    assert placed == [[]] * 8 + [["disk"]] * 5 + [["host"]] * 3
    assert snapshot(batch, keys) == snapshot(one, keys)
    m = batch.moves_snapshot()
    assert m["device->host"]["count"] == 16 and m["host->disk"]["count"] == 13 and m["disk->gone"]["count"] == 8
    for tier in batch.tiers:
        got = tier.nbytes(keys)
        for (k, r), n in zip(records, got):
            if n:
                out = torch.empty(n, dtype=torch.uint8)
                assert tier.read_into([k], [out]) == [n] and torch.equal(out, r)
    one.close()
    batch.close()


def test_a_record_evicted_and_written_again_in_one_disk_batch_counts_both(tmp_path, records, codec):
    """A key the disk tier holds, evicted by an earlier record of the same batch and then written
    again by it: counted disk->gone and host->disk, as two single writes count it, and held at the end."""
    size = codec.page_nbytes()
    one = stack_at(tmp_path / "one", size, disk_records=2)
    batch = stack_at(tmp_path / "batch", size, disk_records=2)
    (a, ra), (b, rb), (c, rc) = records[:3]
    for s in (one, batch):
        s.put_many([(a, ra), (b, rb)], source="host", level=1)  # disk: a, b (a oldest)
    for k, r in [(c, rc), (a, ra)]:  # c evicts a, then a comes back and evicts b
        one.put(k, r, source="host", level=1)
    batch.put_many([(c, rc), (a, ra)], source="host", level=1)
    assert snapshot(batch, [a, b, c]) == snapshot(one, [a, b, c])
    assert batch.where([a, b, c]) == [["disk"], [], ["disk"]]
    assert batch.moves_snapshot()["disk->gone"]["count"] == 2 and batch.moves_snapshot()["host->disk"]["count"] == 4
    one.close()
    batch.close()


def test_a_record_too_large_for_the_host_in_mid_batch_goes_down_alone(tmp_path, records, codec, pool):
    """The third of five records is larger than the whole host tier: it goes to disk; the others stay
    in the host tier, in order, and nothing else is passed down."""
    size = codec.page_nbytes()
    stack = stack_at(tmp_path, size, host_records=4, disk_records=5)
    big = torch.cat([records[5][1], records[6][1], records[7][1], records[8][1], records[9][1]])
    assert big.numel() > stack.tiers[0].index.capacity
    items = [records[0], records[1], (b"big", big), records[2], records[3]]
    placed = stack.put_many(items, source="client")
    assert placed == [["host"], ["host"], ["disk"], ["host"], ["host"]]
    assert stack.tiers[0].index.keys() == [records[i][0] for i in range(4)]
    m = stack.moves_snapshot()
    assert m["client->host"]["count"] == 4 and m["client->disk"] == {"count": 1, "bytes": big.numel()}
    assert "host->disk" not in m
    stack.close()
