"""The disk tier's write-behind (server/tiers/disk_writer.py) on a real LMDB environment: records read
byte-exact from memory while their transaction waits, LMDB left exactly as the index says once the
jobs commit (evictions of pending records included), the pending bound, a failed transaction (the
tier turns unhealthy, the records lost are counted, the probe brings it back in step), and close
committing what waits. The writer is held back by the test's own LMDB write transaction (LMDB has
one writer at a time), so "pending" is a state the test controls, not a race it hopes to win."""

from __future__ import annotations

import threading
import time

import lmdb
import pytest
import torch

from kvtier.server.tiers import DiskTier, DiskTierConfig, HostTierConfig, TierStack, disk_charge
from kvtier.server.tiers.errors import TierUnavailableError
from tierkit import record_of

MiB = 1 << 20


@pytest.fixture
def records(pool, codec):
    return {b"wb-%02d" % i: record_of(codec, pool, 1 + i % 8, seed=50 + i) for i in range(12)}


def tier_at(path, capacity=8 * MiB, **kw) -> DiskTier:
    return DiskTier(DiskTierConfig(path=str(path), capacity_bytes=capacity, write_behind=True, **kw))


def lmdb_contents(path) -> dict[bytes, bytes]:
    """Every record LMDB holds, read by a second process-free environment handle after close."""
    env = lmdb.open(str(path), readonly=True, max_dbs=4, lock=False)
    try:
        db = env.open_db(b"records", create=False)
        with env.begin(db=db) as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}
    finally:
        env.close()


class HeldWriter:
    """Holds LMDB's one write lock (a write transaction of the test's own) so the tier's writer
    thread waits in ``begin``; ``release`` lets it go."""

    def __init__(self, tier: DiskTier) -> None:
        tier.open()
        self.txn = tier._env_obj.begin(write=True)  # noqa: SLF001 - the environment the tier owns

    def release(self) -> None:
        self.txn.abort()


def read(tier: DiskTier, key: bytes, size: int) -> bytes | None:
    out = torch.empty(size, dtype=torch.uint8)
    n = tier.read_into([key], [out])[0]
    return bytes(out[:n].numpy()) if n else None


def test_pending_records_read_byte_exact_then_commit(tmp_path, records):
    """While the writer is held, written records are pending (nothing in LMDB yet) and every read
    path returns their exact bytes; once released and drained, LMDB holds the same bytes."""
    tier = tier_at(tmp_path)
    held = HeldWriter(tier)
    keys = list(records)[:4]
    assert tier.write([(k, records[k]) for k in keys]) == keys
    assert set(tier._pending) == set(keys)  # noqa: SLF001 - the state under test
    assert tier.contains(keys) == [True] * 4
    assert tier.nbytes(keys) == [records[k].numel() for k in keys]
    for k in keys:
        assert read(tier, k, records[k].numel()) == bytes(records[k].numpy())
    with tier.borrow(keys) as got:
        assert [bytes(g.numpy()) for g in got] == [bytes(records[k].numpy()) for k in keys]
    held.release()
    tier.drain()
    assert tier._pending == {}  # noqa: SLF001
    assert tier.lmdb_info()["entries"] == 4
    tier.close()
    assert lmdb_contents(tmp_path) == {k: bytes(records[k].numpy()) for k in keys}


def test_evictions_of_pending_records_leave_lmdb_as_the_index_says(tmp_path, records, codec):
    """A tier of 4 records takes 12 while its writer is held: 8 are evicted, most before their own
    put ever committed. After the queue drains, LMDB holds exactly the 4 newest, byte-exact, and
    the evictions were handed over in order as they were decided."""
    per = disk_charge(codec.page_nbytes())
    tier = tier_at(tmp_path, capacity=int(per * 4 / 0.5) + 4096, reserve_fraction=0.5)
    assert tier.index.capacity // per == 4
    held = HeldWriter(tier)
    keys = list(records)
    gone: list[bytes] = []
    for k in keys:
        tier.write([(k, records[k])], on_evict=lambda v, _n: gone.append(v))
    assert gone == keys[:8]
    assert set(tier._pending) == set(keys[8:])  # noqa: SLF001 - evicted ones are no longer served
    held.release()
    tier.close()
    assert lmdb_contents(tmp_path) == {k: bytes(records[k].numpy()) for k in keys[8:]}


def test_a_write_past_the_pending_bound_waits_for_the_writer(tmp_path, records):
    """With room for two pending records, a third write blocks while the writer is held and
    completes once it is released."""
    size = next(iter(records.values())).numel()
    tier = tier_at(tmp_path, write_behind_bytes=2 * size)
    held = HeldWriter(tier)
    keys = list(records)[:3]
    tier.write([(keys[0], records[keys[0]])])
    tier.write([(keys[1], records[keys[1]])])
    third = threading.Thread(target=tier.write, args=([(keys[2], records[keys[2]])],))
    third.start()
    third.join(timeout=0.5)
    assert third.is_alive()  # blocked on the bound: the writer cannot have made progress
    assert keys[2] not in tier._pending  # noqa: SLF001
    held.release()
    third.join(timeout=30)
    assert not third.is_alive()
    tier.close()
    assert set(lmdb_contents(tmp_path)) == set(keys)


def test_a_failed_transaction_marks_unhealthy_counts_the_lost_and_the_probe_resyncs(tmp_path, records):
    """An injected I/O fault hits the writer's transaction after the write returned: the tier turns
    unhealthy, the records that never reached LMDB are counted ``disk->gone`` in the stack's moves,
    the next write is refused (the stack passes it on), and the probe reloads the index from LMDB
    (which holds only what committed before the fault)."""
    fault = tmp_path / "fault"
    disk_cfg = DiskTierConfig(path=str(tmp_path / "lmdb"), capacity_bytes=16 * MiB, write_behind=True,
                              fault_file=str(fault))
    stack = TierStack.from_configs([HostTierConfig(capacity_bytes=0), disk_cfg])  # the disk tier alone
    disk = stack.tiers[0]
    assert isinstance(disk, DiskTier)
    keys = list(records)
    assert stack.put_many([(k, records[k]) for k in keys[:2]], source="host") == [["disk"], ["disk"]]
    disk.drain()
    held = HeldWriter(disk)
    assert stack.put_many([(k, records[k]) for k in keys[2:5]], source="host") == [["disk"]] * 3
    fault.touch()
    held.release()
    disk.drain()
    assert not disk.health.healthy and "injected" in disk.health.snapshot().reason
    lost = sum(records[k].numel() for k in keys[2:5])
    assert stack.moves["disk->gone"] == {"count": 3, "bytes": lost}
    with pytest.raises(TierUnavailableError):
        disk.write([(keys[5], records[keys[5]])])
    assert stack.put(keys[5], records[keys[5]], source="host") == []  # passed on: nothing below
    fault.unlink()
    disk.probe()
    disk.health.mark_healthy()
    assert sorted(disk.index.keys()) == sorted(keys[:2])
    assert read(disk, keys[0], records[keys[0]].numel()) == bytes(records[keys[0]].numpy())
    assert read(disk, keys[3], records[keys[3]].numel()) is None
    stack.close()


def test_close_commits_what_waits_and_a_reopened_tier_serves_it(tmp_path, records):
    """Records written just before close (their transactions still queued) are all in LMDB after
    it, and a new tier on the same directory serves them byte-exact."""
    keys = list(records)
    tier = tier_at(tmp_path)
    for k in keys:
        tier.write([(k, records[k])])
    tier.close()
    assert lmdb_contents(tmp_path) == {k: bytes(records[k].numpy()) for k in keys}
    again = tier_at(tmp_path)
    assert again.contains(keys) == [True] * len(keys)
    for k in keys:
        assert read(again, k, records[k].numel()) == bytes(records[k].numpy())
    again.close()


def test_victims_of_dropped_jobs_do_not_come_back_after_the_probe(tmp_path, records, codec):
    """A tier of 4 records holds 4 committed ones; with the writer held, 4 more are written, which
    evicts the first 4 (counted evicted, handed to ``disk->gone``). The first queued job then fails
    on an injected I/O fault, so every queued job -- the victims' deletes with them -- is dropped.
    After the probe the evicted records must stay gone (LMDB must not give them back to the index),
    and every record put in is held, evicted or lost: 8 in = 0 held + 4 evicted + 4 lost."""
    fault = tmp_path / "fault"
    per = disk_charge(codec.page_nbytes())
    disk_cfg = DiskTierConfig(path=str(tmp_path / "lmdb"), capacity_bytes=int(per * 4 / 0.5) + 4096,
                              reserve_fraction=0.5, write_behind=True, fault_file=str(fault))
    stack = TierStack.from_configs([HostTierConfig(capacity_bytes=0), disk_cfg])
    disk = stack.tiers[0]
    keys = list(records)[:8]
    for k in keys[:4]:
        stack.put(k, records[k], source="host")
    disk.drain()
    held = HeldWriter(disk)
    for k in keys[4:]:
        stack.put(k, records[k], source="host")
    fault.touch()
    held.release()
    disk.drain()
    assert not disk.health.healthy
    fault.unlink()
    disk.probe()
    disk.health.mark_healthy()
    s = disk.stats()
    assert sorted(disk.index.keys()) == []
    assert (s.writes, s.evictions, s.entries) == (8, 4, 0)
    assert stack.moves["disk->gone"]["count"] == 4 + 4  # evicted + lost
    stack.close()
    assert lmdb_contents(tmp_path / "lmdb") == {}


class _SnapshotThenCommit:
    """The tier's environment for its reads, whose read transaction begins while a job is held and
    which then lets that job commit (and the writer drop it from the pending records) before the
    read goes on: a read snapshot older than the commit."""

    def __init__(self, tier: DiskTier, held: HeldWriter) -> None:
        self.tier, self.held, self.env = tier, held, tier._env_obj  # noqa: SLF001

    def begin(self, **kw):
        txn = self.env.begin(**kw)
        self.held.release()
        self.tier.drain()
        return txn


@pytest.mark.parametrize("how", ["read_into", "borrow", "nbytes"])
def test_a_read_whose_snapshot_predates_the_commit_still_finds_the_record(tmp_path, records, how):
    """A read's LMDB transaction begins before a pending record's job commits; the commit then
    removes the record from the pending ones before the read looks there. The record the index holds
    must still be read byte-exact (from memory, looked up before the snapshot), never a miss."""
    tier = tier_at(tmp_path)
    held = HeldWriter(tier)
    key = next(iter(records))
    rec = records[key]
    tier.write([(key, rec)])
    env = _SnapshotThenCommit(tier, held)
    if how == "nbytes":
        tier._env = lambda: (env, *tier._dbs)  # noqa: SLF001 - nbytes opens its environment this way
        assert tier.nbytes([key]) == [rec.numel()]
        del tier._env
    else:
        tier._open_env = lambda: (env, tier._dbs[0])  # noqa: SLF001 - the read path's environment
        if how == "read_into":
            assert read(tier, key, rec.numel()) == bytes(rec.numpy())
        else:
            with tier.borrow([key]) as (got,):
                assert got is not None and bytes(got.numpy()) == bytes(rec.numpy())
        del tier._open_env
    assert tier._pending == {}  # noqa: SLF001 - the commit did happen inside the read
    tier.close()


def test_a_write_planned_before_a_failure_is_refused_until_the_probe_resyncs(tmp_path, records, codec):
    """A tier of 4 records holds k0..k3 committed. With the writer held (and room for one pending
    record), k4 is written: its job deletes the victim k0 and puts k4. A second write, of k0 again,
    passes the health check, plans (evicting k1) and waits in ``submit`` for room. Then the first job
    fails on an injected I/O fault (k0 becomes a tombstone, k4 is lost) and, at that very moment,
    space comes back (the fault file goes in the tier's ``on_lost`` hand-off). Before the fix the
    waiting job was queued and committed, the probe then deleted the re-put k0 as a tombstone, and k0
    was counted neither held, evicted nor lost (6 in, 2 + 2 + 1 accounted). The writer must refuse
    every job after a failure until the probe's resync: the second write fails (the stack drops k0,
    counted ``host->gone``), k1 was never evicted, and in = held + evicted + lost: 5 = 3 + 1 + 1."""
    fault = tmp_path / "fault"
    per = disk_charge(codec.page_nbytes())
    size = codec.page_nbytes()
    disk_cfg = DiskTierConfig(path=str(tmp_path / "lmdb"), capacity_bytes=int(per * 4 / 0.5) + 4096,
                              reserve_fraction=0.5, write_behind=True, write_behind_bytes=size, fault_file=str(fault))
    stack = TierStack.from_configs([HostTierConfig(capacity_bytes=0), disk_cfg])
    disk = stack.tiers[0]
    keys = list(records)[:5]
    assert all(records[k].numel() == size for k in keys)
    for k in keys[:4]:
        stack.put(k, records[k], source="host")
    disk.drain()
    held = HeldWriter(disk)
    stack.put(keys[4], records[keys[4]], source="host")  # job A: delete k0, put k4 (pending)
    assert keys[0] not in disk.index
    fault.touch()
    second = threading.Thread(target=stack.put, args=(keys[0], records[keys[0]]), kwargs={"source": "host"})
    second.start()
    deadline = time.monotonic() + 30
    while keys[0] not in disk.index:  # planned: past the health check, waiting for room in submit
        assert time.monotonic() < deadline and second.is_alive()
        time.sleep(0.001)
    count_lost = disk.on_lost

    def space_comes_back(n: int, nbytes: int) -> None:
        fault.unlink()
        count_lost(n, nbytes)

    disk.on_lost = space_comes_back
    held.release()
    second.join(timeout=30)
    assert not second.is_alive()
    disk.drain()
    assert not disk.health.healthy and not fault.exists()
    assert not disk.held_while_unhealthy(keys[0])  # tombstoned: not back from LMDB, even before the probe
    assert all(disk.held_while_unhealthy(k) for k in keys[1:4])  # k1's eviction was refused with its job
    disk.probe()
    disk.health.mark_healthy()
    s = disk.stats()
    lost = stack.moves["disk->gone"]["count"] - s.evictions
    assert sorted(disk.index.keys()) == sorted(keys[1:4])
    assert (s.writes, s.evictions, s.entries, lost) == (5, 1, 3, 1)
    assert s.writes == s.entries + s.evictions + lost
    assert stack.moves["host->gone"]["count"] == 1  # the refused k0
    for k in keys[1:4]:
        assert read(disk, k, size) == bytes(records[k].numpy())
    assert read(disk, keys[0], size) is None
    stack.close()
    assert set(lmdb_contents(tmp_path / "lmdb")) == set(keys[1:4])


def test_a_drain_returns_while_other_writers_keep_the_queue_from_emptying():
    """Attack pass 8, A8-5: a durable Offload's drain waited until the write-behind queue was empty,
    so another tenant queueing writes faster than the disk committed kept it waiting past its
    deadline. Here a producer queues a job every millisecond for 2 s while each commit takes 20 ms
    (the queue is never empty); a drain begun meanwhile returns after the batches holding the jobs
    queued before it, long before the producer stops."""
    from kvtier.server.tiers.disk_writer import DiskJob, WriteBehind

    def apply(job: DiskJob) -> None:
        time.sleep(0.02)

    wb = WriteBehind(apply, lambda e, lost, deleted: None, max_pending_bytes=1 << 20, name="t-writer")
    stop = threading.Event()

    def produce() -> None:
        i = 0
        while not stop.is_set():
            wb.submit(DiskJob(stamps=[(b"k%d" % i, None, i)]), [])
            i += 1
            time.sleep(0.001)

    producer = threading.Thread(target=produce)
    producer.start()
    drained = threading.Event()
    try:
        time.sleep(0.2)
        before = wb.batches_applied
        drainer = threading.Thread(target=lambda: (wb.drain(), drained.set()))
        drainer.start()
        returned = drained.wait(10)  # the queue is still being fed all this while
        batches = wb.batches_applied - before
    finally:
        stop.set()
        producer.join()
        drainer.join()
        wb.close()
    assert returned, "the drain waited for jobs queued after it began"
    assert batches <= 3  # the batch in flight when it began and the one holding its jobs (+1: the count is read after)


def test_queued_jobs_commit_as_a_few_batches_and_leave_lmdb_as_one_by_one_would(tmp_path, codec, pool):
    """Group commit: 20 writes of one record each into a disk tier of 6 records, queued while the
    writer is held (each write from the 7th on evicts the oldest, a delete of a record whose own put
    is still queued). Released, the writer commits them in a few batches, not 20 transactions, and
    LMDB holds exactly the 6 newest records, byte-exact, as applying the jobs one by one would."""
    per = disk_charge(codec.page_nbytes())
    tier = tier_at(tmp_path, capacity=int(per * 6 / 0.2) + 4096, reserve_fraction=0.8)
    assert tier.index.capacity // per == 6
    recs = {b"gc-%02d" % i: record_of(codec, pool, 1, seed=90 + i) for i in range(20)}
    held = HeldWriter(tier)
    for k, r in recs.items():
        tier.write([(k, r)])
    held.release()
    tier.drain()
    writer = tier._writer  # noqa: SLF001 - its counters
    assert writer.jobs_applied == 20
    assert writer.batches_applied <= 6  # the held first job, then batches ended by each conflicting delete
    tier.close()
    keys = list(recs)
    assert lmdb_contents(tmp_path) == {k: bytes(recs[k].numpy()) for k in keys[14:]}


def test_a_drain_after_a_failed_job_returns_only_once_the_tier_heard_of_the_failure():
    """The jobs a failure drops count as finished only after ``on_failure`` ran: a durable Offload's
    drain must not return while the tier still says it holds a record that was lost."""
    from kvtier.server.tiers.disk_writer import DiskJob, WriteBehind

    heard = threading.Event()
    told_at_drain: list[bool] = []

    def apply(job: DiskJob) -> None:
        raise OSError(28, "No space left on device")

    def on_failure(err, lost, deleted) -> None:
        time.sleep(0.2)  # the tier takes a while to mark itself unhealthy
        heard.set()

    wb = WriteBehind(apply, on_failure, max_pending_bytes=1 << 20, name="t-writer")
    wb.submit(DiskJob(stamps=[(b"k", None, 1)]), [])
    wb.drain()
    told_at_drain.append(heard.is_set())
    wb.close()
    assert told_at_drain == [True]


def test_a_removed_record_is_a_miss_while_its_delete_waits_in_the_queue(tmp_path, records):
    """A write-behind disk queues a removal's delete (attack pass 9, A9-4), so LMDB holds the record
    until the writer gets to it; reads go by the index, so it is a miss from the removal on (a
    Restore(drop) took a copy its failed Offload had just taken back). Once the delete commits, LMDB
    no longer holds it either."""
    tier = tier_at(tmp_path)
    k = next(iter(records))
    tier.write([(k, records[k])])
    tier.drain()
    held = HeldWriter(tier)
    assert tier.remove([k]) == 1
    assert read(tier, k, records[k].numel()) is None
    with tier.borrow([k]) as (rec,):
        assert rec is None
    held.release()
    tier.close()
    assert k not in lmdb_contents(tmp_path)
