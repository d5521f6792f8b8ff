"""A disk record is bound to the key it was written under (``disk_keysums.py``).

Regression (attack pass 4, A4-1): a one-word change of ``data.mdb`` -- key A's leaf node pointing at
key B's overflow pages -- made the restarted daemon's ``Restore("A")`` return B's intact record
(checksum good, model good) as A's hit, with the scrub counting ``damaged 0``. Here the same state is
made with LMDB's own API behind kvtier's back: the records database maps A to B's exact bytes, which
is what the damaged pointer yields. Before the fix A read back B's bytes in every test below.
"""

from __future__ import annotations

import lmdb
import pytest
import torch

from kvtier.server.tiers import DiskTier, DiskTierConfig
from tierkit import record_of

MiB = 1 << 20
A, B, C = b"t\x07defaulto:A", b"t\x07defaulto:B", b"t\x07defaulto:C"


@pytest.fixture
def recs(pool, codec):
    return {A: record_of(codec, pool, 1, seed=11), B: record_of(codec, pool, 1, seed=22), C: record_of(codec, pool, 1, seed=33)}


def disk_at(path, **kw) -> DiskTier:
    return DiskTier(DiskTierConfig(path=str(path), capacity_bytes=8 * MiB, **kw))


def read(disk: DiskTier, key: bytes, size: int) -> torch.Tensor | None:
    out = torch.zeros(size, dtype=torch.uint8)
    n = disk.read_into([key], [out])[0]
    return out[:n] if n else None


def _point(env: lmdb.Environment, key: bytes, at: bytes) -> None:
    """Make the records database yield ``at``'s record for ``key`` (a damaged page pointer's effect)."""
    db = env.open_db(b"records")
    with env.begin(write=True, db=db) as txn:
        txn.put(key, bytes(txn.get(at)))


@pytest.mark.parametrize("write_behind", [False, True])
def test_a_key_that_yields_another_records_bytes_is_dropped_by_the_scrub(tmp_path, recs, codec, write_behind):
    disk = disk_at(tmp_path, write_behind=write_behind)
    disk.write(list(recs.items()))
    disk.close()
    env = lmdb.open(str(tmp_path), max_dbs=5)
    _point(env, A, B)
    env.close()

    again = disk_at(tmp_path)
    assert again.contains([A, B, C]) == [False, True, True]
    assert again.stats().damaged == 1
    size = codec.page_nbytes()
    assert read(again, A, size) is None
    assert torch.equal(read(again, B, size), recs[B]) and torch.equal(read(again, C, size), recs[C])
    again.close()


def test_a_read_of_a_key_that_yields_another_record_is_a_miss_and_copies_nothing(tmp_path, recs, codec, caplog):
    """Without a restart (no scrub): the read compares the record with the key's sum before copying."""
    disk = disk_at(tmp_path, write_behind=False)
    disk.write(list(recs.items()))
    _point(disk._env()[0], A, C)
    size = codec.page_nbytes()
    out = torch.zeros(size, dtype=torch.uint8)
    with caplog.at_level("WARNING"):
        assert disk.read_into([A, B], [out, torch.zeros(size, dtype=torch.uint8)]) == [0, size]
    assert "not the one written under it" in caplog.text
    assert not out.any()  # C's bytes never reached A's buffer
    assert disk.stats().damaged == 1 and disk.contains([A, B, C]) == [False, True, True]
    with disk.borrow([C]) as got:
        assert torch.equal(got[0][:size], recs[C])
    disk.close()


def test_a_record_without_a_sum_is_damaged(tmp_path, recs, codec):
    """A record with no entry in ``sums`` (put behind kvtier's back, or by a kvtier before the
    binding) is never served: the scrub drops it."""
    disk = disk_at(tmp_path)
    disk.write([(A, recs[A])])
    disk.close()
    env = lmdb.open(str(tmp_path), max_dbs=5)
    db = env.open_db(b"records")
    with env.begin(write=True, db=db) as txn:
        txn.put(B, bytes(txn.get(A)))  # a whole, checksummed record, but never written under B
    env.close()
    again = disk_at(tmp_path)
    assert again.contains([A, B]) == [True, False] and again.stats().damaged == 1
    assert torch.equal(read(again, A, codec.page_nbytes()), recs[A])
    again.close()
