"""Write-behind for the LMDB disk tier: a spill's decisions now, its LMDB transactions on a thread.

A disk write (:meth:`DiskTier.write`) decides everything at once, under the tier's index lock: which
records go in, which are evicted, the LRU positions, the counters and the ``on_evict`` hand-offs.
With write-behind the LMDB work of that write -- one transaction that deletes the victims, one that
puts the records and stamps positions -- becomes a :class:`DiskJob` that a writer thread applies,
jobs in the order they were made. py-lmdb lets go of the GIL inside ``mdb_put`` and the commit, so
the copy into LMDB's pages and the ``pwritev`` of a spill run on the other core while the caller
(a LoadPrefix making room) goes on: BENCHMARKS.md, fix 14.

Until its job commits a record is *pending*: :meth:`WriteBehind.pending` maps its key to the record
(the host tier's arena block, kept alive here), and reads serve it from there, so a read never misses
a record the index holds. A later decision about the same key is just a later job (a victim's delete
follows its put), so applying the jobs in order leaves LMDB exactly as the index says.

Bounds and barriers: at most ``max_pending_bytes`` of records wait (a write that would pass it waits
for the writer: memory stays bounded when the disk is slower than the spills); :meth:`drain` waits
until every job queued *before it was called* has committed (the tier drains before any transaction
of its own, a reload of its index from LMDB, a flush and close; a durable Offload waits for its own
commit). Jobs are numbered as they are queued and the writer counts those it finished (applied or
dropped by a failure), so a drain waits for a number, not for an empty queue: jobs queued after it
began never hold it up (attack pass 8, A8-5: another tenant writing faster than the disk commits
kept the queue from ever emptying, and every durable Offload, Drop and ClearUnits waited out its
deadline). A caller that holds the tier's index lock queues nothing new meanwhile, so for it the
two are the same.

Group commit: the writer applies the jobs waiting at its turn together, as one job (their deletes
in one transaction, then their puts and stamps in one), up to ``max_batch_bytes`` of records, so a
backlog costs one commit (one fsync with ``sync``), not one a job: a disk whose commits are slow
(fsync-bound) catches up with writers faster than it. A job joins only when its deletes touch no key
an earlier job of the batch puts or stamps (applied apart, that put would come first and the delete
after; together the deletes go first), so LMDB ends exactly as applying them one by one would leave it.

LMDB's map full (A4-9): large records need runs of contiguous pages, and churn with read transactions
pinning freed pages can fill the map while the tier's charged bytes are under budget. A job that meets
``MapFullError`` (after the tier's short retries) is not failed: the writer holds it back (:attr:`WriteBehind.full`)
and asks the tier to make room (``make_room``: evict more records in its policy's order, under its
index lock), then tries the job again; only when nothing is left to evict does the job fail as below.
``make_room`` runs with the tier's index lock held: the writer only *tries* that lock (a short timed
acquire, in a loop), and a caller that waits here (:meth:`~WriteBehind.submit`, :meth:`~WriteBehind.drain`)
while the writer holds a job back makes the room itself (it holds that lock, or takes it: it holds
nothing the writer needs), so neither waits for the other.

Failures: a job whose transaction fails (ENOSPC, EIO, LMDB's map full with nothing left to evict) is handed to
``on_failure`` on the writer thread together with every job still queued; those jobs are dropped
(nothing of a failed transaction is visible in LMDB) and their records are no longer pending; the
victims they were to delete are handed over too (the tier deletes them when it recovers, so a record
counted evicted never comes back). The
tier marks itself unhealthy, counts the records it lost and reloads its index from LMDB before it
serves again. From the failure until that resync (:meth:`WriteBehind.resume`) :meth:`~WriteBehind.submit`
refuses every job with :class:`WriteBehindFailed`: a write that passed the tier's health check before
the failure (or waited for room in ``submit`` while it happened) was planned on an index the failure
made stale, and its job could re-put a victim the failure handed over for deletion -- the resync
would then delete a record counted written, neither evicted nor lost. The tier turns the refusal into
``TierUnavailableError`` (the stack passes the record on), so every record is held, evicted or lost. A process killed with jobs queued loses those records the same way: LMDB holds only
committed transactions, and the index is rebuilt from it at the next start.

Lock order: the writer thread takes this module's own leaf lock (``_lock``) and, only while it holds
a job back for room, tries the tier's index lock (a timed acquire, never a blocking one, with nothing
else held); after a failure (``after_failure``) it may take the index lock with nothing else held and
nothing queued. A caller may wait here while it holds the index lock: while a job is held back the
caller makes the room itself instead of waiting for the writer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)


class WriteBehindFailed(RuntimeError):
    """A job was refused: an earlier job failed and the tier has not resynced with LMDB yet
    (:meth:`WriteBehind.resume`). Nothing of the refused job was queued."""


@dataclass
class DiskJob:
    """The LMDB work of one disk write, applied by :meth:`DiskTier._apply`.

    Attributes:
        deletes: ``(key, LRU sequence number or None)`` of each victim (its record, seq and order entries).
        puts: ``(key, record)`` to put, in order; records are contiguous 1-D uint8 host tensors.
        stamps: ``(key, old sequence number or None, new sequence number)`` LRU positions to persist.
    """

    deletes: list[tuple[bytes, int | None]] = field(default_factory=list)
    puts: list[tuple[bytes, torch.Tensor]] = field(default_factory=list)
    stamps: list[tuple[bytes, int | None, int]] = field(default_factory=list)
    #: Rounds of evictions made so far to find room in LMDB's map for this job (each evicts twice the last).
    room_rounds: int = 0

    @property
    def nbytes(self) -> int:
        """Record bytes this job puts."""
        return sum(int(r.numel()) for _, r in self.puts)

    def __bool__(self) -> bool:
        return bool(self.deletes or self.puts or self.stamps)


class WriteBehind:
    """The writer thread and the pending records of one disk tier.

    Args:
        apply: applies one job's transactions (raises on failure; nothing of a failed transaction is
            visible). Called on the writer thread, in job order.
        on_failure: ``(error, lost, deleted)``, called on the writer thread after a job failed; every
            queued job was dropped with it, ``lost`` are the ``(key, record)`` puts of those jobs that
            were still pending (records the index holds but LMDB never got) and ``deleted`` the keys
            those jobs were to delete (victims the index no longer holds but LMDB may still have).
        max_pending_bytes: record bytes that may wait before :meth:`submit` blocks.
        max_batch_bytes: record bytes the writer applies in one batch of jobs at most (a job larger
            than this alone is still applied, alone). The disk tier passes the smaller of its
            ``max_txn_bytes`` and a quarter of its map's reserve: pages a commit frees are reusable
            only two transactions later, so the reserve must hold a couple of batches.
        name: the thread's name.
        is_full: whether an error of ``apply`` is LMDB's map full (the job is held back for room).
        make_room: ``(job, busy) -> bool``, called with ``room_lock`` held while ``job`` is held
            back: evict records (none of the keys in ``busy``: referenced by queued jobs or by a job
            being submitted) so the job may fit; False when nothing is left to evict (the job fails).
        room_lock: the tier's index lock (an ``RLock``), held while ``make_room`` runs.
        after_failure: called on the writer thread after a failure was handed to ``on_failure``,
            with nothing queued and no lock held (the tier resyncs with LMDB there when it stays healthy).
    """

    def __init__(self, apply: Callable[[DiskJob], None], on_failure: Callable[[BaseException, list[tuple[bytes, torch.Tensor]], list[bytes]], None],
                 *, max_pending_bytes: int, max_batch_bytes: int = 64 << 20, name: str = "kvtier-disk-writer",
                 is_full: Callable[[BaseException], bool] = lambda e: False,
                 make_room: Callable[[DiskJob, set[bytes]], bool] | None = None,
                 room_lock: threading.RLock | None = None,  # type: ignore[valid-type]
                 after_failure: Callable[[BaseException], None] | None = None) -> None:
        if max_pending_bytes <= 0:
            raise ValueError(f"max_pending_bytes must be positive, got {max_pending_bytes}")
        self._apply = apply
        self._on_failure = on_failure
        self._is_full = is_full
        self._make_room = make_room
        self._room_lock = room_lock
        self._after_failure = after_failure
        #: The job the writer holds back because LMDB's map had no room for it (None: none), and
        #: the verdict of the last :meth:`make_room_now` for it (True: try again, False: fail it).
        self.full: DiskJob | None = None
        self._room: bool | None = None
        self.room_rounds = 0
        self.max_pending_bytes = max_pending_bytes
        self.max_batch_bytes = max_batch_bytes
        self.name = name
        self._lock = threading.Lock()  # leaf
        self._changed = threading.Condition(self._lock)
        self._queue: deque[DiskJob] = deque()
        self._busy = False  # a job is being applied
        self._queued = 0  # jobs queued since the start (a drain's ticket is this number)
        self._finished = 0  # of those, jobs applied or dropped by a failure (in queue order)
        self._bytes = 0  # record bytes of the queued and in-flight jobs
        self._closed = False
        self._thread: threading.Thread | None = None
        #: key -> (record tensor, its bytes as a ``B`` memoryview): records whose put has not committed.
        #: Read without the lock (one dict lookup); a reader keeps the tuple while it copies.
        self.pending: dict[bytes, tuple[torch.Tensor, memoryview]] = {}
        self.jobs_applied = 0
        #: Transactions (batches of jobs, each one commit) the writer applied.
        self.batches_applied = 0
        self.jobs_failed = 0
        self.jobs_refused = 0
        #: Why the last job failed, until :meth:`resume` (monitoring reads it without the lock).
        self.failure: str | None = None

    # ----- the caller's side ------------------------------------------------------------------------
    def submit(self, job: DiskJob, cancelled: list[bytes]) -> None:
        """Queue ``job``; ``cancelled`` are keys no longer held (victims of this write): a pending
        put of one stops being served (the job's deletes follow that put in LMDB). Blocks while the
        pending bytes are over the bound (until the writer catches up or fails).

        Raises:
            WriteBehindFailed: a job failed since the last :meth:`resume` (also one that failed
                while this call waited for room); nothing was queued.
        """
        n = job.nbytes
        while True:
            with self._changed:
                while True:
                    if self.failure is not None:
                        self.jobs_refused += 1
                        raise WriteBehindFailed(f"an earlier write-behind transaction failed ({self.failure}); "
                                                f"no write is queued until the tier has resynced with LMDB")
                    if not (self._bytes and self._bytes + n > self.max_pending_bytes):
                        self._queue_job(job, cancelled, n)
                        return
                    if self.full is not None:
                        break  # the writer holds a job back for room: make it here instead of waiting
                    self._changed.wait()
            self.make_room_now(job)  # (not this job's keys: it is not queued yet)

    def _queue_job(self, job: DiskJob, cancelled: list[bytes], n: int) -> None:
        """(``_lock`` held) Queue ``job``; start the writer if needed."""
        pend = self.pending
        for k in cancelled:
            pend.pop(k, None)
        for k, rec in job.puts:
            pend[k] = (rec, memoryview(rec.numpy()))
        self._queue.append(job)
        self._queued += 1
        self._bytes += n
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._changed.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every job queued before this call has been applied (or dropped by a failure):
        jobs queued meanwhile are not waited for (module docstring). While the writer holds a job
        back for room, make it here. A no-op on the writer thread itself. Returns False when
        ``timeout`` seconds (None: no bound) passed first."""
        if threading.current_thread() is self._thread:
            return True
        end = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            ticket = self._queued
        while True:
            with self._changed:
                while self._finished < ticket and self.full is None:
                    left = None if end is None else end - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._changed.wait(left)
                if self._finished >= ticket:
                    return True
            self.make_room_now(None)

    def make_room_now(self, submitting: DiskJob | None) -> None:
        """If the writer holds a job back for room, have the tier make room for it (under the room
        lock: re-entered if the caller holds it) and tell the writer the verdict. ``submitting``: a
        job being submitted (not queued yet), whose keys are left alone."""
        with self._room_lock:  # type: ignore[union-attr]
            with self._changed:
                job = self.full
                if job is None:
                    return
                busy = {k for j in (job, *self._queue, *([submitting] if submitting is not None else []))
                        for k in (*(k for k, _ in j.puts), *(k for k, _, _ in j.stamps))}
            ok = False
            try:
                ok = bool(self._make_room(job, busy))  # type: ignore[misc]
            except BaseException:  # noqa: BLE001 - the job fails; the tier already turned unhealthy if it must
                log.exception("disk tier: making room in LMDB's map failed")
            with self._changed:
                if self.full is job:
                    self.full = None
                    self._room = ok
                    self.room_rounds += 1
                    self._changed.notify_all()

    def resume(self) -> None:
        """Take jobs again after a failure: the tier calls it once its index is back in step with
        LMDB (the probe's resync, after :meth:`drain`)."""
        with self._changed:
            self.failure = None

    @property
    def closing(self) -> bool:
        """:meth:`close` has begun (the thread is to end once the queue is empty); a plain read."""
        return self._closed

    @property
    def queued_bytes(self) -> int:
        """Record bytes waiting for (or in) a transaction (monitoring: no lock)."""
        return self._bytes

    def close(self) -> None:
        """Apply what is queued, then stop the thread (idempotent; a later :meth:`submit` starts a
        new one)."""
        self.drain()
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)
        with self._changed:
            self._closed = False
            self._thread = None

    # ----- the writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._closed:
                    self._changed.wait()
                if not self._queue:
                    return
                batch = self._take_batch()
                self._busy = True
            job = batch[0] if len(batch) == 1 else DiskJob(
                deletes=[d for j in batch for d in j.deletes], puts=[p for j in batch for p in j.puts],
                stamps=[t for j in batch for t in j.stamps])
            try:
                self._apply_making_room(job)
            except BaseException as e:  # noqa: BLE001 - handed to the tier, which turns unhealthy
                self._fail(e, job, len(batch))
                if self._after_failure is not None:
                    try:
                        self._after_failure(e)
                    except BaseException:  # noqa: BLE001 - the thread must go on serving later jobs
                        log.exception("disk tier: resyncing after a failed write-behind job failed")
                continue
            with self._changed:
                pend = self.pending
                for k, rec in job.puts:
                    ent = pend.get(k)
                    if ent is not None and ent[0] is rec:  # not re-put or cancelled since
                        del pend[k]
                self._bytes -= job.nbytes
                self._busy = False
                self._finished += len(batch)
                self.jobs_applied += len(batch)
                self.batches_applied += 1
                self._changed.notify_all()

    def _take_batch(self) -> list[DiskJob]:
        """(``_lock`` held, queue not empty) Pop the next job and the queued jobs that may join it
        (module docstring: group commit)."""
        q = self._queue
        first = q.popleft()
        batch, nbytes = [first], first.nbytes
        written = {k for k, _ in first.puts} | {k for k, _, _ in first.stamps}
        while q and not first.room_rounds:
            nxt = q[0]
            n = nxt.nbytes
            if nbytes + n > self.max_batch_bytes or nxt.room_rounds or any(k in written for k, _ in nxt.deletes):
                break
            batch.append(q.popleft())
            nbytes += n
            written.update(k for k, _ in nxt.puts)
            written.update(k for k, _, _ in nxt.stamps)
        return batch

    def _apply_making_room(self, job: DiskJob) -> None:
        """Apply ``job``; while LMDB's map has no room for it, hold it back until room is made (by
        this thread, when it gets the room lock, or by a caller waiting here) and try again. Raises
        the map-full error when nothing was left to evict, or any other error at once."""
        while True:
            try:
                self._apply(job)
                return
            except BaseException as e:
                if self._make_room is None or self._room_lock is None or not self._is_full(e):
                    raise
                with self._changed:
                    self.full, self._room = job, None
                    self._changed.notify_all()  # a waiting caller makes the room itself
                while True:
                    with self._changed:
                        if self.full is None:
                            ok = self._room
                            break
                    if self._room_lock.acquire(timeout=0.05):
                        try:
                            self.make_room_now(None)
                        finally:
                            self._room_lock.release()
                if not ok:
                    raise

    def _fail(self, err: BaseException, job: DiskJob, n_jobs: int = 1) -> None:
        """``job`` (a batch of ``n_jobs`` queued jobs) failed: drop it and every queued job."""
        with self._changed:
            dropped = [job, *self._queue]
            n_dropped = n_jobs + len(self._queue)
            pend = self.pending
            lost = [(k, r) for j in dropped for k, r in j.puts if (ent := pend.get(k)) is not None and ent[0] is r]
            deleted = list(dict.fromkeys(k for j in dropped for k, _ in j.deletes))
            self._queue.clear()
            pend.clear()
            self._bytes = 0
            self.jobs_failed += n_dropped
            self.failure = " ".join(str(err).split()) or type(err).__name__  # submit refuses from now on
        try:
            self._on_failure(err, lost, deleted)
        except BaseException:  # noqa: BLE001 - the thread must go on serving later jobs
            log.exception("disk tier: handling a failed write-behind job failed")
        finally:
            with self._changed:  # finished once the tier has heard of the failure (a drain then sees it)
                self._busy = False
                self._finished += n_dropped
                self._changed.notify_all()
