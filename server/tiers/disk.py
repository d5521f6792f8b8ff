"""LMDB disk tier: records in one embedded LMDB environment, under kvtier's own byte budget.

The py-lmdb way (DESIGN.md, STYLE.md):

* the tier owns the only ``Environment`` of its file in this process (:func:`open_environment`
  refuses a second one), opened lazily on first use so it is created after any ``fork()``. An
  environment must not cross ``fork()``: a child that inherits an *opened* tier gets
  :class:`EnvironmentInUseError` and never touches the parent's handle (build tiers after forking);
* ``map_size`` is the ``--disk-size`` budget; kvtier evicts (LRU) to keep its charged bytes under
  ``map_size * (1 - reserve_fraction)``. LMDB's own ``MapFullError`` can still happen inside that
  budget (large records need runs of contiguous pages; churn with readers pinning freed pages leaves
  short runs: attack pass 4, A4-9). It is a full tier, not a storage fault: the aborted transaction
  left nothing visible, the tier evicts more in the policy's order (counted, handed to ``on_evict``,
  or ``on_lost`` for a write-behind job) and retries; only with nothing left to evict does the write
  fail (:class:`TierFullError`; a write-behind job's records are lost) and the tier stays healthy;
* every transaction is a ``with env.begin(...)``; reads use ``buffers=True`` and copy out inside it;
* the LRU order persists in two sub-databases (``seq``: key -> access sequence number, ``order``:
  sequence number -> key), so it survives a restart; new positions (a written record's, a read
  hit's) are kept in memory and written :data:`STAMP_BATCH` at a time with a write transaction (and
  at flush/close), so reads never open a write transaction (with ``sync`` that would be an fsync per
  read) and a spill's commit touches only the records' B-tree. After a crash the records whose
  positions were pending load as the newest (they were the latest used); a startup scrub drops
  damaged records.

Thread safety: writes, touches and removals are serialised by the index lock (LMDB allows one writer
anyway); reads run in parallel read transactions and see a snapshot, so a read racing an eviction
returns the whole record or a miss.

Faults (:mod:`kvtier.server.tiers.disk_faults`). A storage failure (ENOSPC, EIO, a full reader table,
a panicked environment) marks the tier unhealthy instead of failing the caller:

* a write whose transaction fails leaves nothing of it visible (LMDB aborts the transaction); the
  in-memory index is reloaded from what LMDB really holds (a read transaction, which works on a full
  filesystem), so evictions that did commit before the failure are counted and the rest stay; if even
  that read fails the index is emptied and rebuilt when the tier recovers. The write raises
  :class:`~kvtier.server.tiers.errors.TierUnavailableError`; the stack passes the record on (for the
  last tier: dropped and counted ``<source>->gone``);
* while unhealthy the tier is bypassed: presence answers "absent", reads miss, writes raise
  ``TierUnavailableError`` without touching LMDB. Records already on disk stay there, untouched and
  unread (:meth:`~kvtier.server.tiers.base.Tier.held_while_unhealthy` still knows them); a removal
  is remembered (a tombstone) and applied when the tier recovers, so a dropped copy never comes back;
* :meth:`DiskTier.probe` (the daemon's monitor calls it with backoff) checks that the filesystem has
  room for a record like the largest written so far, applies the tombstones, reloads the index from
  LMDB, and writes and deletes such a record in a probe sub-database (evicting in the policy's order
  while LMDB's map has no room for it); then the tier serves again
  and every record it held is back. Reads verify every record's checksum, so a record an I/O error
  damaged is a miss (counted ``damaged``), never data.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import lmdb
import torch

from kvtier.server.hostmem import HostArena
from kvtier.server.hostmem.malloc import keep_freed_memory
from kvtier.server.tiers.base import EvictHook, RecordLike, Tier, prefix_present, record_nbytes
from kvtier.server.tiers.disk_faults import (
    check_disk_path, check_injected_fault, describe_fault, free_bytes, hold_before_commit, is_io_fault, open_failure,
)
from kvtier.server.tiers.disk_env import (  # noqa: F401 - DiskTierConfig, disk_charge, open_environment: re-exported
    LMDB_PAGE_BYTES, MAX_KEY_BYTES, DiskTierConfig, close_environment, disk_charge, open_environment,
)
from kvtier.server.tiers.disk_keysums import MISMATCH as KEY_MISMATCH, REASON as KEY_REASON, bound, record_sum, unbound
from kvtier.server.tiers.disk_reads import ABSENT, SHORT, ReadChunks, copy_records, damage_reason, writable_bytes
from kvtier.server.tiers.disk_writer import DiskJob, WriteBehind, WriteBehindFailed
from kvtier.server.tiers.errors import (
    DiskPathError, EnvironmentInUseError, RecordError, TierFullError, TierUnavailableError,
)
from kvtier.server.tiers.health import TierHealth
from kvtier.server.tiers.record import verify_record

# Pauses between retries of a put transaction that hit MapFullError while read transactions still
# pinned the pages the eviction commit freed (about 0.35 s in all before TierFullError).
MAP_FULL_RETRY_PAUSES_S: tuple[float, ...] = (0.002, 0.01, 0.03, 0.1, 0.2)

log = logging.getLogger(__name__)

#: Keys one :meth:`DiskTier.borrow` of a prefix load reads (one read transaction; the prefix cache
#: borrows runs of ``borrow_batch`` pages a call). Small on purpose: a run's records are copied into
#: one place the next run reuses, and 4 page records (776 KB) stay in a core's cache (2 MiB here)
#: until they are loaded into the pool; runs of 16 ran 0.70x a plain read, of 4 0.79-0.81x
#: (BENCHMARKS.md, fix 6).
BORROW_BATCH = 4

#: LRU positions not yet on disk (new records and read hits) are written together, with the write
#: transaction that brings them to this many (and at flush/close): stamping each record's position
#: in its own put transaction dirtied two more B-trees a commit and cost ~15 us of a ~95 us spill
#: (BENCHMARKS.md, fix 7). A crash loses at most this many positions; those records load as newest.
STAMP_BATCH = 64

MIN_FREE_PAGES = 64
"""Free LMDB pages a disk tier needs at start beside the pages in use (256 KiB): a delete copies
every page on its way down each B-tree it changes (records, seq, order, sums: four trees of a few
levels) and writes the freelist."""

_SEQ = struct.Struct(">Q")  # big-endian: the order sub-database iterates oldest first
_PROBE_KEY = b"probe"  # in its own sub-database, so a probe left behind is never taken for a record
_TICK_KEY = b"tick"  # (probe sub-database) rewritten to make the pages of a delete reusable at once
_MIN_PROBE_BYTES = 4096


_BYTE_ARRAYS: dict[int, type] = {}

#: This process's id, renewed in the child after every ``os.fork`` (the data path's fork check).
_PROCESS = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PROCESS.__setitem__(0, os.getpid()))


def _bytes_view(rec: torch.Tensor) -> ctypes.Array:
    """A contiguous uint8 host tensor's bytes as a ctypes array over its memory (no copy; valid while
    ``rec`` lives), for ``txn.put``; the array type of each size is made once."""
    n = rec.numel()
    cls = _BYTE_ARRAYS.get(n)
    if cls is None:
        if len(_BYTE_ARRAYS) > 4096:
            _BYTE_ARRAYS.clear()
        cls = _BYTE_ARRAYS[n] = ctypes.c_char * n
    return cls.from_address(rec.data_ptr())


class _Replan(Exception):
    """A write-behind job was refused because an earlier one failed for want of room in LMDB's map
    (the tier still serves): the index was resynced with LMDB; the batch is planned once more."""


class _Borrowed:
    """The records of one :meth:`DiskTier.borrow` call; entering yields them, leaving does nothing
    (they are copies: dropping them frees their buffers)."""

    __slots__ = ("records",)

    def __init__(self, records: list[torch.Tensor | None]) -> None:
        self.records = records

    def __enter__(self) -> list[torch.Tensor | None]:
        return self.records

    def __exit__(self, *exc: object) -> None:
        self.records = []


class DiskTier(Tier):
    """Records in an LMDB environment, LRU order persisted, damaged records dropped on sight.

    Args:
        config: :class:`DiskTierConfig`.

    Raises:
        ValueError: a bad config field.
    """

    name = "disk"
    persistent = True
    borrow_batch = BORROW_BATCH

    def __init__(self, config: DiskTierConfig) -> None:
        config.validate()
        super().__init__(config.make_index(config.record_budget))
        self.health = TierHealth(self.name, backoff_initial_s=config.probe_backoff_initial_s,
                                 backoff_max_s=config.probe_backoff_max_s)
        self.config = config
        self.verifies_reads = config.verify_reads
        self._tombstones: set[bytes] = set()  # removed while unhealthy: deleted from LMDB on recovery
        self._largest = 0  # bytes of the largest record written (the probe writes one that size)
        self._env_obj: lmdb.Environment | None = None
        self._pid = -1
        self._seq: dict[bytes, int] = {}
        self._sizes: dict[bytes, int] = {}
        self._touched: dict[bytes, None] = {}  # writes and read hits whose LRU position is not on disk yet
        self._next_seq = 0
        self._scrubbed = 0
        self._read_arena: HostArena | None = None
        self._chunks = ReadChunks(None)  # borrowed records' buffers; the read arena's once it exists
        self.index.on_touch = self._note_touched
        self._map_full_evictions = 0
        self._resyncing = False  # records evicted because LMDB's map, not the budget, was full
        self._loaded_pid: int | None = None  # the process whose open environment's index is loaded
        self._reloads = 0  # index reloads begun plus ended: odd while one runs (contains)
        self._writer = WriteBehind(self._apply, self._writer_failed, max_pending_bytes=config.write_behind_bytes,
                                   max_batch_bytes=min(config.max_txn_bytes,
                                                       int(config.capacity_bytes * config.reserve_fraction) // 4),
                                   is_full=lambda e: isinstance(e, lmdb.MapFullError), make_room=self._make_room_for,
                                   room_lock=self.index.lock, after_failure=self._after_writer_failure) \
            if config.write_behind else None
        self._pending: dict[bytes, tuple[torch.Tensor, memoryview]] = self._writer.pending if self._writer else {}
        #: ``(records, bytes)`` that left the tier outside a write call: lost when a write-behind
        #: transaction failed, or evicted to make room in LMDB's map for a queued one; the stack counts
        #: them ``disk->gone``.
        self.on_lost: Callable[[int, int], None] | None = None

    # ----- environment ------------------------------------------------------------------------
    def _env(self) -> tuple[lmdb.Environment, lmdb._Database, lmdb._Database, lmdb._Database]:
        with self.index.lock:
            if self._env_obj is not None and self._pid != os.getpid():
                raise EnvironmentInUseError(f"this disk tier's LMDB environment was opened by process {self._pid} "
                                            f"before fork(); environments must not cross fork(): build tiers after forking")
            if self._env_obj is None:
                keep_freed_memory()  # LMDB's transaction buffers are reused, not faulted in per spill
                self._env_obj = open_environment(
                    self.config.path, map_size=self.config.capacity_bytes, max_readers=self.config.max_readers,
                    max_dbs=5, subdir=True, sync=self.config.sync, metasync=False, readahead=False,
                    meminit=False,
                )
                self._pid = os.getpid()
                env = self._env_obj
                self._dbs = (env.open_db(b"records"), env.open_db(b"seq"), env.open_db(b"order"))
                self._probe_db = env.open_db(b"probe")
                self._sums = env.open_db(b"sums")  # key -> its record's checksum field (disk_keysums.py)
                self._check_map_fits(env)
                if self.config.read_buffer_bytes > 0 and self._read_arena is None:
                    self._read_arena = HostArena(self.config.read_buffer_bytes, pin=False, name="kvtier-disk-reads")
                    self._chunks = ReadChunks(self._read_arena)
                self._load_index(scrub=self.config.scrub_on_open)
                self._loaded_pid = self._pid
            return (self._env_obj, *self._dbs)

    def _pages_in_use(self, env: lmdb.Environment) -> int:
        """LMDB pages that hold data now: the two meta pages and every database's branch, leaf and
        overflow pages (not the pages freed and kept for reuse, which ``last_pgno`` counts)."""
        pages = 2
        with env.begin() as txn:
            for s in (env.stat(), *(txn.stat(db) for db in (*self._dbs, self._probe_db, self._sums))):
                pages += s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]
        return pages

    def _check_map_fits(self, env: lmdb.Environment) -> None:
        """(opening) Refuse a ``--disk-size`` the directory's data does not fit with room to change
        it: LMDB raises a map smaller than its file to the file's size, and with no free page no
        transaction, not even a delete, can commit, so the tier stayed unhealthy (attack pass 4,
        A4-2; at the size that refusal recommended, pass 5, A5-1). The map must reach the file's last
        page and leave :data:`MIN_FREE_PAGES` free beside the pages in use. A daemon restarted with
        its own size always passes: its records keep to the budget, under the map's reserve (a
        refusal based on the file's last page, which counts freed pages too, refused that)."""
        last = env.info()["last_pgno"] + 1
        in_use = self._pages_in_use(env)
        needed = max(last, in_use + MIN_FREE_PAGES) * LMDB_PAGE_BYTES
        if self.config.capacity_bytes >= needed:
            return
        self._env_obj = None
        self._loaded_pid = None
        close_environment(self.config.path, env)
        raise DiskPathError(
            f"--disk-size {self.config.capacity_bytes:,} bytes is too small for the {in_use * LMDB_PAGE_BYTES:,} bytes "
            f"the disk tier already holds in {self.config.path} (its file reaches {last * LMDB_PAGE_BYTES:,} bytes, and "
            f"LMDB needs free pages to change anything): give --disk-size of at least {needed:,} bytes, or move that "
            f"directory away to start with an empty disk tier")

    def open(self) -> None:
        """Open the environment now (and run the startup scrub); otherwise the first use opens it.

        Raises:
            DiskPathError: the path cannot hold an environment (a file, ``/proc``, a read-only or
                unwritable filesystem) or LMDB cannot open one there; the message says what to do.
        """
        check_disk_path(self.config.path)
        try:
            self._env()
        except (lmdb.Error, OSError) as e:
            raise open_failure(self.config.path, e) from None

    def _write_txn(self, env: lmdb.Environment) -> lmdb.Transaction:
        """A write transaction for a ``with`` block (committed at its end, aborted on any exception:
        py-lmdb's own context manager, no generator around it), failing while an injected fault is on."""
        txn = env.begin(write=True)
        try:
            check_injected_fault(self.config.fault_file)
        except BaseException:
            txn.abort()
            raise
        return txn

    def _fault(self, exc: BaseException, what: str) -> TierUnavailableError:
        """Mark the tier unhealthy for a storage failure and return the error to raise."""
        reason = f"{what}: {describe_fault(exc)}"
        self._count(io_errors=1)
        self.health.mark_unhealthy(reason)
        return TierUnavailableError(self.name, reason)

    def _unavailable(self) -> TierUnavailableError:
        return TierUnavailableError(self.name, self.health.snapshot().reason)

    def _reload_or_forget(self) -> bool:
        """After a failed write: the index from what LMDB holds; if LMDB cannot even be read, an empty
        index (rebuilt by the next successful probe). Returns True if the reload worked."""
        try:
            self._load_index(scrub=False)
            return True
        except Exception as e:  # noqa: BLE001 - the tier turns unhealthy; the probe reloads
            log.warning("disk tier: could not reload the index from LMDB (%s); it is rebuilt on recovery", e)
            self.index.clear()
            self._seq, self._sizes, self._touched = {}, {}, {}
            return False

    def _load_index(self, *, scrub: bool) -> None:
        """Rebuild the in-memory index (and LRU order) from what LMDB holds (after the write-behind
        transactions queued so far); drop damaged records and stray order entries when ``scrub``.
        :attr:`_reloads` is odd while it runs (lock-free readers then ask under the lock)."""
        self._reloads += 1
        try:
            self._load_index_now(scrub=scrub)
        finally:
            self._reloads += 1

    def _load_index_now(self, *, scrub: bool) -> None:
        self.drain()
        env, records, seqdb, orderdb = self._env_obj, *self._dbs
        sizes: dict[bytes, int] = {}
        bad: list[bytes] = []
        gone = self._tombstones  # removed (or evicted by a dropped job): deleted by the probe, never back
        with env.begin(db=records, buffers=True) as txn:
            for k, v in txn.cursor():
                key = bytes(k)
                if key in gone:
                    continue
                if scrub:
                    try:
                        verify_record(v)
                        if not bound(txn, self._sums, key, v):
                            raise RecordError(KEY_REASON)
                    except RecordError as e:
                        log.warning("disk tier scrub: record %s is damaged (%s); dropped", key.hex(), e)
                        bad.append(key)
                        continue
                sizes[key] = len(v)
            ordered: list[tuple[int, bytes]] = [(_SEQ.unpack(bytes(s))[0], bytes(k)) for s, k in txn.cursor(db=orderdb)]
            stray_sums = [bytes(k) for k in txn.cursor(db=self._sums).iternext(values=False)
                          if bytes(k) not in sizes and bytes(k) not in gone] if scrub else []
        stray = [(s, k) for s, k in ordered if k not in sizes and k not in gone]  # (a tombstone's: the probe's)
        ordered = [(s, k) for s, k in ordered if k in sizes]
        known = {k for _, k in ordered}
        unordered = [k for k in sizes if k not in known]
        self.index.clear()
        self._seq = {}
        self._sizes = dict(sizes)
        self._touched = {}
        for s, k in ordered:
            self._seq[k] = s
            self.index.commit_insert(k, disk_charge(sizes[k]))
        self._next_seq = max((s for s, _ in ordered), default=-1) + 1
        for k in unordered:  # written after the last stamp batch (a crash lost its position): newest
            self.index.commit_insert(k, disk_charge(sizes[k]))
            self._touched[k] = None  # stamped with a later batch (no write here: a full disk can reload)
        if bad or stray or stray_sums:
            with self._write_txn(env) as txn:
                for k in stray_sums:  # a key whose record is gone (or was never written): its sum goes too
                    txn.delete(k, db=self._sums)
                for k in bad:
                    txn.delete(k, db=records)
                    txn.delete(k, db=self._sums)
                    txn.delete(k, db=seqdb)
                for s, k in stray:
                    txn.delete(_SEQ.pack(s), db=orderdb)
        self._scrubbed += len(bad)
        if bad:
            self._count(damaged=len(bad))

    # ----- presence ---------------------------------------------------------------------------
    # While unhealthy nothing below touches the environment: after a panic it is closed until a probe
    # reopens it, and opening it again must not be tried (and fail) on the data path.
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether the tier holds its record. Once the environment is open, plain
        membership reads without the index lock, so an Offload's "key taken?" check does not wait
        for a synchronous commit of another copy (attack pass 8, A8-7); an index reload (which
        clears and refills the index) is detected by its counter (odd while it runs, bumped at its
        end) and the answer then comes from under the lock."""
        if not self.health.healthy:
            return [False] * len(keys)
        return self._read_index(lambda index: [k in index for k in keys], [False] * len(keys))

    def _read_index(self, read: Callable[[Any], Any], unhealthy: Any) -> Any:
        """``read(index)`` without the index lock once the environment is open and no reload runs
        (:attr:`_reloads` the same before and after), else under the lock (``unhealthy`` if the tier
        turned unhealthy meanwhile)."""
        if self._loaded_pid == os.getpid() and self._env_obj is not None:
            g = self._reloads
            if not g & 1:
                out = read(self.index)
                if self._reloads == g:
                    return out
        self._env()
        with self.index.lock:
            return read(self.index) if self.health.healthy else unhealthy

    def lookup(self, keys: Sequence[bytes]) -> int:
        """As :meth:`contains`: lock-free once open, under the lock while the index reloads."""
        if not self.health.healthy:
            return 0
        return self._read_index(lambda index: prefix_present(index, keys), 0)

    def admits(self, items: Sequence[tuple[bytes, RecordLike]]) -> list[bool]:
        """For each ``(key, record)``, whether the policy admits it (:meth:`TierIndex.admit`: always
        while it fits; the stack passes on what is turned away, counted ``(not admitted)``)."""
        with self.index.lock:
            return [self.index.admit(k, disk_charge(record_nbytes(r))) for k, r in items]

    def nbytes(self, keys: Sequence[bytes]) -> list[int | None]:
        if not self.health.healthy:
            return [None] * len(keys)
        env, records, _, _ = self._env()
        pend = self._pending
        held = [pend.get(k) for k in keys]  # before the snapshot (see _read)
        try:
            with env.begin(db=records, buffers=True) as txn:
                out = []
                for k, ent in zip(keys, held):
                    v = ent[1] if ent is not None else txn.get(k)
                    out.append(None if v is None else len(v))
                return out
        except Exception as e:
            if not is_io_fault(e):
                raise
            self._fault(e, "read")
            return [None] * len(keys)

    # ----- writes -----------------------------------------------------------------------------
    def _note_touched(self, keys: list[bytes]) -> None:
        """Read hits the index has just applied (its lock held): their positions are to be stamped."""
        touched = self._touched
        for k in keys:
            touched.pop(k, None)
            touched[k] = None

    def _delete(self, txn: lmdb.Transaction, key: bytes) -> None:
        records, seqdb, orderdb = self._dbs
        txn.delete(key, db=records)
        txn.delete(key, db=self._sums)
        txn.delete(key, db=seqdb)
        s = self._seq.pop(key, None)
        if s is not None:
            txn.delete(_SEQ.pack(s), db=orderdb)

    def _job(self, victims: list[bytes], puts: list[tuple[bytes, torch.Tensor]], order: list[bytes]) -> DiskJob:
        """The LMDB work of a planned write (index lock held): the victims' deletes, the puts, and
        the LRU positions due (:data:`STAMP_BATCH` at a time); the in-memory sequence numbers move now."""
        seq = self._seq
        job = DiskJob(deletes=[(v, seq.pop(v, None)) for v in victims], puts=puts)
        touched, index = self._touched, self.index
        for key in order:
            if key in index:
                touched.pop(key, None)  # its new LRU position: stamped with a batch
                touched[key] = None
        if len(touched) >= STAMP_BATCH:
            job.stamps = self._take_stamps()
        return job

    def _take_stamps(self) -> list[tuple[bytes, int | None, int]]:
        """New LRU positions for the touched keys still held, in touch order (index lock held)."""
        out = []
        for key in self._touched:
            if key in self.index:
                s = self._next_seq
                self._next_seq += 1
                out.append((key, self._seq.get(key), s))
                self._seq[key] = s
        self._touched.clear()
        return out

    def _apply(self, job: DiskJob, pauses: tuple[float, ...] | None = None) -> None:
        """Run a job's transactions: delete the victims (their pages become reusable), then put the
        records and stamps in one transaction, retrying it briefly when LMDB's map is full while
        readers still hold the pages the delete freed. Raises what LMDB raises; nothing of a failed
        transaction is visible."""
        env = self._env_obj
        records, seqdb, orderdb = self._dbs
        sums = self._sums
        slow_file = self.config.slow_file
        if job.deletes:
            with self._write_txn(env) as txn:
                delete = txn.delete
                for key, s in job.deletes:
                    delete(key, db=records)
                    delete(key, db=sums)
                    delete(key, db=seqdb)
                    if s is not None:
                        delete(_SEQ.pack(s), db=orderdb)
            job.deletes = []  # committed: a retry of the put transaction (map full) does not repeat them
        if not (job.puts or job.stamps):
            return
        if pauses is None:  # after a round of evictions for room, one short retry: no reader to wait for
            pauses = MAP_FULL_RETRY_PAUSES_S if not job.room_rounds else MAP_FULL_RETRY_PAUSES_S[:1]
        for attempt, pause in enumerate(pauses + (None,)):
            try:
                with self._write_txn(env) as txn:
                    put = txn.put
                    for key, rec in job.puts:  # its bytes, viewed without numpy (contiguous: checked)
                        view = _bytes_view(rec)
                        put(key, view, db=records)
                        put(key, record_sum(view), db=sums)  # the record bound to its key
                    for key, old, s in job.stamps:
                        if old is not None:
                            txn.delete(_SEQ.pack(old), db=orderdb)
                        put(_SEQ.pack(s), key, db=orderdb)
                        put(key, _SEQ.pack(s), db=seqdb)
                    if slow_file:
                        hold_before_commit(slow_file)  # tests only: a slow disk (a long write-behind queue)
                return
            except lmdb.MapFullError:
                # Pages freed by the eviction commit above are reusable only once every read
                # transaction older than it has ended; concurrent readers can hold them a moment.
                # The aborted transaction left nothing behind, so wait briefly and try again.
                if pause is None:
                    raise
                log.debug("LMDB map full while readers hold freed pages; retrying in %.3f s (attempt %d)", pause, attempt + 1)
                time.sleep(pause)

    def _writer_failed(self, err: BaseException, lost: list[tuple[bytes, torch.Tensor]], deleted: list[bytes]) -> None:
        """A write-behind job failed (writer thread; no index lock): the tier turns unhealthy (its
        index holds records LMDB never got; the probe reloads it from LMDB), and the records lost are
        counted (``on_lost``: ``disk->gone`` in the stack's moves) and logged. The victims whose
        deletes were dropped with the jobs (already evicted and handed on) become tombstones, which
        the probe deletes before it reloads the index: otherwise they would come back from LMDB.
        (Index-lock users of ``_tombstones`` drain first, so none iterates it while this runs.)"""
        self._tombstones.update(deleted)
        if isinstance(err, lmdb.MapFullError):
            # a full tier, not a storage fault: the tier stays healthy and resyncs with LMDB at once
            # (_after_writer_failure); only these records are lost (nothing was left to evict for them)
            self._count(full_errors=1)
        elif is_io_fault(err):
            self._fault(err, "write")
        else:
            log.error("disk tier: a write-behind transaction failed: %r", err)
            self.health.mark_unhealthy(f"write: {err!r}")
        nbytes = sum(int(r.numel()) for _, r in lost)
        why = self.health.snapshot().reason or f"LMDB map full ({self.config.capacity_bytes} bytes) with nothing left to evict"
        log.warning("disk tier: %d records (%d bytes) waiting for their LMDB transaction were lost (%s)",
                    len(lost), nbytes, why)
        if lost and self.on_lost is not None:
            self.on_lost(len(lost), nbytes)

    def _after_writer_failure(self, err: BaseException) -> None:
        """Writer thread, nothing queued, no lock held: after a map-full failure the tier is still
        healthy, so it resyncs with LMDB now, unless a write (which resyncs first) did it already (a
        storage fault waits for the probe)."""
        if not isinstance(err, lmdb.MapFullError):
            return
        lock, w = self.index.lock, self._writer
        # not while the tier closes: close holds the index lock until this thread ends (a daemon
        # stopped after a map-full failure waited 30 s for it, then was killed)
        while w is not None and w.failure is not None and self.health.healthy and not w.closing:
            # timed, never blocking: a write holding the lock resyncs by itself and queues jobs
            # this thread must then be free to apply
            if lock.acquire(timeout=0.05):
                try:
                    self._resync_if_due()
                finally:
                    lock.release()

    def _resync_if_due(self) -> None:
        """(index lock held) After a write-behind failure on a healthy tier (LMDB's map full with
        nothing left to evict): delete the tombstones, reload the index from LMDB and take writes
        again -- what the probe does for an unhealthy tier."""
        w = self._writer
        if w is None or w.failure is None or not self.health.healthy or self._resyncing:
            return
        self._resyncing = True
        try:
            self._resync(w)
        finally:
            self._resyncing = False

    def _resync(self, w: WriteBehind) -> None:
        w.drain()
        try:
            self._apply_tombstones(self._env_obj)
        except Exception as e:  # noqa: BLE001 - they stay tombstones (never loaded back); deleted later
            if not (is_io_fault(e) or isinstance(e, lmdb.MapFullError)):
                raise
            log.warning("disk tier: %d pending deletes could not be written yet (%s)", len(self._tombstones),
                        describe_fault(e))
        self._load_index(scrub=False)
        w.resume()

    def _apply_tombstones(self, env: lmdb.Environment) -> None:
        """(index lock held, drained) Delete the records removed or evicted while they could not be
        deleted; on a failure they stay tombstones (never loaded back) and the error is raised."""
        if self._tombstones:
            with self._write_txn(env) as txn:
                for k in self._tombstones:
                    self._delete_stored(txn, k)
            self._tombstones.clear()
            self._advance(env)

    def _advance(self, env: lmdb.Environment) -> None:
        """Commit one small write transaction, so that the pages the last commit freed can be reused
        by the next one (LMDB reuses pages freed by transaction N from transaction N+2 on). A map with
        no page left even for this is left as it is."""
        try:
            with self._write_txn(env) as txn:
                txn.put(_TICK_KEY, b"\0", db=self._probe_db)
        except lmdb.MapFullError:
            pass

    def _delete_stored(self, txn: lmdb.Transaction, key: bytes) -> None:
        """Delete ``key``'s record, sum and LRU entries, the order entry found under its stored
        sequence number too (the in-memory one may be a stamp not committed yet)."""
        old = txn.get(key, db=self._dbs[1])
        self._delete(txn, key)
        if old is not None:
            txn.delete(bytes(old), db=self._dbs[2])

    def _make_room_for(self, job: DiskJob, busy: set[bytes], on_evict: EvictHook | None = None, *,
                       healthy: bool = True) -> bool:
        """(index lock held; no write transaction of the tier open) LMDB's map had no room for
        ``job`` although the budget had: large records need runs of contiguous pages, and churn with
        read transactions pinning freed pages leaves the free pages in short runs. Evict records in
        the policy's order -- twice as many bytes as the job puts, doubling each round -- and commit
        their deletes, so that the job may fit. Victims are committed records only (not pending, not
        pinned, not in ``busy``); they are counted evictions and handed to ``on_evict`` (or, outside
        a write call, to :attr:`on_lost`: ``disk->gone``). Returns False when nothing is left to
        evict (or the deletes themselves found no room): the job fails."""
        if (healthy and not self.health.healthy) or self._env_obj is None:
            return False
        need = max(sum(disk_charge(int(r.numel())) for _, r in job.puts), 16 * LMDB_PAGE_BYTES) << min(job.room_rounds + 1, 20)
        job.room_rounds += 1
        pend, index, sizes = self._pending, self.index, self._sizes

        def can_evict(k: bytes) -> bool:
            return k in sizes and k not in pend and k not in busy and index.pin_count(k) == 0

        index.apply_touches()
        victims = index.policy.victims(need, can_evict)
        if victims is None:  # less than that is left: all of it
            victims = [k for k in index.policy.order() if can_evict(k)]
        if not victims:
            log.warning("disk tier: LMDB's map (%d bytes) is full and nothing is left to evict (%d records, "
                        "%d of %d charged bytes held)", self.config.capacity_bytes, len(index), index.used, index.capacity)
            return False
        try:
            with self._write_txn(self._env_obj) as txn:
                for v in victims:
                    self._delete_stored(txn, v)
        except lmdb.MapFullError:
            log.warning("disk tier: LMDB's map (%d bytes) has no page left even to delete %d records",
                        self.config.capacity_bytes, len(victims))
            return False
        except Exception as e:
            if not is_io_fault(e) or not healthy:
                raise
            self._fault(e, "write")
            return False
        self._advance(self._env_obj)  # their pages reusable by the retry
        stored_before = {v: sizes[v] for v in victims}
        for v in victims:
            index.evict(v)
            self._touched.pop(v, None)
        self._map_full_evictions += len(victims)
        log.info("disk tier: LMDB's map (%d bytes) was full with %d of %d charged bytes held; evicted %d records "
                 "(%d bytes) to make room (round %d)", self.config.capacity_bytes, index.used + sum(disk_charge(n) for n in stored_before.values()),
                 index.capacity, len(victims), sum(stored_before.values()), job.room_rounds)
        if on_evict is not None:
            self._settle_evictions(victims, stored_before, on_evict)
        else:
            self._settle_evictions(victims, stored_before, None)
            if self.on_lost is not None:
                self.on_lost(len(victims), sum(stored_before.values()))
        return True

    def _apply_making_room(self, job: DiskJob, on_evict: EvictHook | None) -> None:
        """(index lock held; no write-behind) :meth:`_apply`, evicting for room while LMDB's map is
        full (:meth:`_make_room_for`); raises ``MapFullError`` when nothing is left to evict."""
        busy = {k for k, _ in job.puts} | {k for k, _, _ in job.stamps}
        while True:
            try:
                self._apply(job)
                return
            except lmdb.MapFullError:
                if not self._make_room_for(job, busy, on_evict):
                    raise

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every write-behind transaction queued so far has committed (or failed); False
        when ``timeout`` seconds passed first. A no-op without write-behind; the tier drains by
        itself before it flushes, closes or reloads."""
        if self._writer is not None:
            if not self._writer.drain(timeout):
                return False
            if self._writer.failure is not None and self.health.healthy and not self._resyncing:
                with self.index.lock:  # a map-full failure: the index back in step, so presence is true
                    self._resync_if_due()
        return True

    def write(self, items: Sequence[tuple[bytes, RecordLike]], *, on_evict: EvictHook | None = None,
              replace: bool = False) -> list[bytes]:
        for key, rec in items:
            if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
                raise ValueError(f"disk tier keys must be 1..{MAX_KEY_BYTES} bytes")
            if not isinstance(rec, torch.Tensor) or rec.dtype != torch.uint8 or rec.dim() != 1 or not rec.is_cpu \
                    or not rec.is_contiguous():
                raise ValueError("disk tier records must be contiguous 1-D uint8 host tensors")
            if rec.numel() == 0:
                raise ValueError(f"disk tier records must not be empty (key {key.hex()})")
        if not self.health.healthy:
            raise self._unavailable()
        env, records = self._open_env()
        written: list[bytes] = []
        batches: list[list[tuple[bytes, torch.Tensor]]] = [[]]
        size = 0
        for item in items:
            n = int(item[1].numel())
            if batches[-1] and size + n > self.config.max_txn_bytes:
                batches.append([])
                size = 0
            batches[-1].append(item)  # type: ignore[arg-type]
            size += n
        done = 0
        with self.index.lock:
            for batch in batches:
                try:
                    try:
                        self._resync_if_due()  # a map-full failure of the writer: back in step first
                        written.extend(self._write_batch(env, records, batch, on_evict, replace))
                    except _Replan:  # the writer failed (map full) while this batch was planned: once more
                        written.extend(self._write_batch(env, records, batch, on_evict, replace, replanned=True))
                except (TierFullError, TierUnavailableError) as e:  # earlier transactions committed: they stay
                    e.done, e.written = done, tuple(written)
                    raise
                done += len(batch)
        return written

    def _write_batch(self, env: lmdb.Environment, records: lmdb._Database, batch: list[tuple[bytes, torch.Tensor]],
                     on_evict: EvictHook | None, replace: bool, replanned: bool = False) -> list[bytes]:
        """Plan the batch on the index, commit the evictions (their pages become reusable), then put
        the records in one transaction. On any failure the index is reloaded from LMDB, so memory
        and disk agree and nothing of the failed records is visible; a storage failure also marks
        the tier unhealthy and raises TierUnavailableError (evictions that committed before it are
        counted and handed to ``on_evict``)."""
        victims: list[bytes] = []
        puts: list[tuple[bytes, torch.Tensor]] = []
        order: list[bytes] = []  # keys in the order memory saw them (touched or inserted)
        replaced: set[bytes] = set()  # removed to be written again (``replace``): not evictions
        stored_before: dict[bytes, int] = {}
        try:
            for key, rec in batch:
                if key in self.index:
                    if not replace:
                        self.index.touch(key)
                        order.append(key)
                        continue
                    self.index.remove(key)
                    victims.append(key)
                    replaced.add(key)
                charge = disk_charge(int(rec.numel()))
                chosen = self.index.plan_insert(key, charge)
                self._tombstones.discard(key)  # written again: its put replaces what a pending delete was for
                self.index.commit_insert(key, charge, chosen)
                victims.extend(chosen)
                puts.append((key, rec))
                order.append(key)
            stored_before = {k: self._sizes[k] for k in victims if k in self._sizes} if victims else {}
            passing: list[tuple[bytes, torch.Tensor]] = []  # evicted again within the batch: written and
            if victims:                                       # evicted at once, no bytes reach LMDB
                passing = [(k, r) for k, r in puts if k not in self.index]
                puts = [(k, r) for k, r in puts if k in self.index]
            job = self._job(victims, puts, order)
            if self._writer is None:
                self._apply_making_room(job, on_evict)
            else:
                self._writer.submit(job, victims)  # applied on the writer thread, in order
        except BaseException as e:
            if isinstance(e, WriteBehindFailed):  # nothing queued; planned on an index an earlier job's
                if self.health.healthy:              # failure made stale: back to what LMDB holds
                    self._resync_if_due()            # (a map-full failure: the tier still serves)
                    if self._writer is not None and self._writer.failure is None and not replanned:
                        raise _Replan() from None
                self._reload_or_forget()
                raise TierUnavailableError(self.name, f"write: {e}") from None
            if not is_io_fault(e):
                self._load_index(scrub=False)  # the put transaction aborted: back to exactly what LMDB holds
                gone = [v for v in dict.fromkeys(victims) if v in stored_before and v not in self.index
                        and v not in replaced]
                self._settle_evictions(gone, stored_before, on_evict)  # their delete committed before the put failed
            elif self._reload_or_forget():
                gone = [v for v in dict.fromkeys(victims) if v in stored_before and v not in self.index]
                self._settle_evictions(gone, stored_before, on_evict)  # their delete committed
            if isinstance(e, (lmdb.MapFullError, TierFullError)):
                self._count(full_errors=1)
            if isinstance(e, lmdb.MapFullError):
                raise TierFullError(f"LMDB map full ({self.config.capacity_bytes} bytes): the write was "
                                    f"rolled back") from e
            if is_io_fault(e):
                raise self._fault(e, "write") from e
            raise
        if victims:  # first: a record evicted and then written again within the batch is both
            evicted = [v for v in dict.fromkeys(victims) if v in stored_before and v not in replaced]
            self._settle_evictions(evicted, stored_before, on_evict)
        nbytes = 0
        for k, r in puts:
            self._sizes[k] = n = r.numel()
            nbytes += n
            if n > self._largest:
                self._largest = n
        passed = {k: int(r.numel()) for k, r in passing}
        with self._stats_lock:
            self._stats.writes += len(puts) + len(passed)
            self._stats.bytes_written += nbytes + sum(passed.values())
        if passed:  # counted as written, then evicted (as one record at a time would have been)
            self._settle_evictions(list(passed), passed, on_evict)
        return [k for k, _ in puts] + list(passed)

    def _settle_evictions(self, evicted: list[bytes], stored_before: dict[bytes, int], on_evict: EvictHook | None) -> None:
        """Count victims whose delete committed and hand them to ``on_evict``."""
        for v in evicted:
            self._sizes.pop(v, None)
        self._count(evictions=len(evicted), bytes_evicted=sum(stored_before[v] for v in evicted))
        if on_evict is not None:
            for v in evicted:
                on_evict(v, stored_before[v])  # the last tier: its victims' sizes, not their bytes

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop records; while unhealthy (or when the delete fails on a storage fault) they leave the
        index at once and are deleted from LMDB when the tier recovers (tombstones).

        With write-behind the delete is a job queued after the puts already queued (the order LMDB
        must see), not a transaction waited for here: a removal holds the index lock (and whatever
        its caller holds: a ClearUnits the unit store's clear guard) for no disk commit (attack pass
        9, A9-4: every tenant's PutUnits waited for a commit behind one tenant's clear). The records
        leave the index and stop being served at once; a caller that must know them gone from LMDB
        (Drop, ClearUnits) then waits for the queue, holding nothing (:meth:`drain`)."""
        if self.health.healthy:
            self._env()  # opened (and the index loaded) before the index is asked
        with self.index.lock:
            present = [k for k in dict.fromkeys(keys) if k in self.index]
            if not present:
                return 0
            writer = self._writer
            if self.health.healthy and writer is not None and writer.failure is None:
                job = DiskJob(deletes=[(k, self._seq.get(k)) for k in present])
                try:
                    writer.submit(job, present)  # their pending puts stop being served
                except WriteBehindFailed:
                    pass  # a failure since the health check: the tombstones below, deleted on recovery
                else:
                    for k in present:
                        self._seq.pop(k, None)
                        self._touched.pop(k, None)
                        self.index.remove(k)
                        self._sizes.pop(k, None)
                    return len(present)
            self.drain()  # its delete must follow the queued puts
            present = [k for k in present if k in self.index]
            if self.health.healthy:
                try:
                    env, _, _, _ = self._env()
                    with self._write_txn(env) as txn:
                        for k in present:
                            self._touched.pop(k, None)
                            self._delete(txn, k)
                except Exception as e:
                    if not (is_io_fault(e) or isinstance(e, lmdb.MapFullError)):
                        raise
                    self._reload_or_forget()  # the delete aborted: _seq as LMDB has it
                    self._fault(e, "remove")  # (a map with no page left for a delete: a probe retries it)
                    present = [k for k in present if k in self.index]
                else:
                    for k in present:
                        self.index.remove(k)
                        self._sizes.pop(k, None)
                    return len(present)
            for k in present:
                self.index.remove(k)
                self._sizes.pop(k, None)
                self._tombstones.add(k)
            return len(present)

    # ----- reads ------------------------------------------------------------------------------
    # A read is one read transaction for the whole batch, one counter update, deferred touches and
    # one native call that copies and checks every record of it (server/tiers/disk_reads.py); per
    # record Python does a value look-up and a buffer (BENCHMARKS.md, fixes 6, 9 and 11).
    def _open_env(self) -> tuple[lmdb.Environment, lmdb._Database]:
        """The environment and records database, without the index lock once open (the data path);
        :meth:`_env` opens it (and fails across fork) the first time. The process id is the one
        :data:`_PROCESS` keeps (``os.getpid()`` is a system call: ~0.7 us a read here)."""
        env = self._env_obj
        if env is None or self._pid != _PROCESS[0]:
            env = self._env()[0]
        return env, self._dbs[0]

    def _read(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor] | None) -> tuple[list[int], list[torch.Tensor | None]]:
        """Copy each key's record out in one read transaction (into ``outs``, or buffers of the read
        chunks), then check, count and touch them all at once. Returns the sizes (0: miss) and
        buffers. While unhealthy, or when the read fails with a storage fault (the tier turns
        unhealthy), every key is a miss.

        Each record is copied once out of LMDB's map (the ``buffers=True`` view, inside the read
        transaction, which keeps its pages from being reused) and checked block by block as it is
        copied, while its bytes are in the CPU's cache, the whole window in one native call
        (:func:`~kvtier.server.tiers.disk_reads.copy_records`). (Copying with ``preadv`` from the
        data file instead -- the first round of this work -- left the hash to read every record back
        from memory: 0.67-0.72x.)

        Raises:
            ValueError: a buffer of ``outs`` too small (checked before any copy).
        """
        n_keys = len(keys)
        if not self.health.healthy:
            self._count(misses=n_keys)
            return [0] * n_keys, [None] * n_keys
        env, records = self._open_env()
        # Records whose write-behind put has not committed are served from memory. Looked up before
        # the read transaction begins: a record not pending then had committed, so the snapshot has
        # it (looked up after, a commit between the two would leave it in neither: a false miss).
        pend = self._pending
        held = [pend.get(k) for k in keys] if pend else None  # (keeps them alive while they are copied)
        try:
            with env.begin(db=records, buffers=True) as txn:
                if held is not None:
                    views = [txn.get(k) if ent is None else ent[1] for k, ent in zip(keys, held)]
                else:
                    views = list(map(txn.get, keys))
                # a record the index no longer holds (removed or evicted, its delete queued behind the
                # write-behind) is a miss: the index decides, LMDB catches up (attack pass 9)
                index = self.index
                for i, k in enumerate(keys):
                    if views[i] is not None and k not in index and (held is None or held[i] is None):
                        views[i] = None
                # a record LMDB gives for a key it was not written under is never copied out (disk_keysums.py)
                strays = unbound(txn, self._sums, keys, views, None if held is None else [e is not None for e in held])
                for i in strays:
                    views[i] = None
                sizes = [0 if v is None else len(v) for v in views]
                if outs is None:
                    bufs, dsts = self._chunks.take_many(sizes)
                else:
                    for k, n, o in zip(keys, sizes, outs):
                        if n > o.numel():
                            raise ValueError(f"buffer of {o.numel()} bytes is too small for the {n}-byte record of key {k.hex()}")
                    bufs = [o if n else None for n, o in zip(sizes, outs)]
                    dsts = [writable_bytes(o, o.numel()) if n else None for n, o in zip(sizes, outs)]
                if 0 in sizes:  # a zero-length value (damaged, or planted): nowhere to copy it, a damaged record
                    empty = [i for i, n in enumerate(sizes) if not n and views[i] is not None]
                    views = [None if i in empty else v for i, v in enumerate(views)]
                    codes = copy_records(views, dsts, self.config.verify_reads)
                    for i in empty:
                        codes[i] = SHORT
                else:
                    codes = copy_records(views, dsts, self.config.verify_reads)  # one native call a window
                for i in strays:
                    codes[i] = KEY_MISMATCH
        except lmdb.ReadersFullError:
            # every reader slot taken: contention, not a failing disk (attack pass 4, A4-15): this read
            # misses, the tier stays healthy
            log.warning("disk tier: every LMDB reader slot is taken (--disk-max-readers %d); %d records read as "
                        "misses", self.config.max_readers, n_keys)
            self._count(misses=n_keys)
            return [0] * n_keys, [None] * n_keys
        except Exception as e:
            if not is_io_fault(e):
                raise
            self._fault(e, "read")
            self._count(misses=n_keys)
            return [0] * n_keys, [None] * n_keys
        if min(codes, default=0) >= 0:  # every key a good record: the common case, no per-key Python
            self._count_reads(n_keys, 0, 0, sum(sizes))
            self.index.touch_later(keys)  # no lock here: applied before the LRU order is next used
            return sizes, bufs
        damaged = [i for i, c in enumerate(codes) if c < 0 and c != ABSENT]
        for i in damaged:
            why = KEY_REASON if codes[i] == KEY_MISMATCH else damage_reason(codes[i])
            log.warning("disk tier: record %s is damaged (%s); dropped, read as a miss", keys[i].hex(), why)
            sizes[i], bufs[i] = 0, None
        hits = [k for k, n in zip(keys, sizes) if n]
        self._count_reads(len(hits), n_keys - len(hits), len(damaged), sum(sizes))
        if hits:
            self.index.touch_later(hits)
        if damaged:
            self.remove([keys[i] for i in damaged])
        return sizes, bufs

    def read_into(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> list[int]:
        self._check_outs(keys, outs)
        return self._read(keys, outs)[0]

    def borrow(self, keys: Sequence[bytes]) -> _Borrowed:  # type: ignore[override]
        """Each key's record (None where absent or damaged), verified, in one read transaction, for a
        ``with`` block. The buffers are views of chunks of the tier's read arena (fresh memory when it
        is full); a chunk goes back to the arena when every record in it has been dropped, so a
        record may be kept past the ``with`` block (an offloaded copy viewed by ``to_cpu_copy``).
        The records are read when ``borrow`` is called (a plain context object, not a generator:
        one record a call is the prefix cache's common case, and a generator cost ~2 us of it)."""
        return _Borrowed(self._read(keys, None)[1])

    # ----- housekeeping -------------------------------------------------------------------------
    def lmdb_info(self) -> dict[str, int]:
        """LMDB's own view: ``map_size``, pages in use (``last_pgno + 1``) times page size, entries."""
        env, records, _, _ = self._env()
        self.drain()
        info = env.info()
        with env.begin(db=records) as txn:
            entries = txn.stat(records)["entries"]
        return {"map_size": info["map_size"], "file_bytes_used": (info["last_pgno"] + 1) * LMDB_PAGE_BYTES,
                "entries": entries}

    def stats(self):  # type: ignore[override]
        if self._env_obj is None and self.health.healthy:
            self._env()  # first use only (opens and scrubs); once open, stats take no index lock
        s = super().stats()
        s.extra = {"scrubbed": self._scrubbed, "map_size": self.config.capacity_bytes,
                   "map_full_evictions": self._map_full_evictions,
                   "tombstones": len(self._tombstones),
                   "write_behind_bytes": self._writer.queued_bytes if self._writer is not None else 0}
        return s

    # ----- health -------------------------------------------------------------------------------
    def probe(self) -> None:
        """Check that the tier can serve again and bring it back in step with LMDB.

        Checks that the filesystem has room for a record as large as the largest written so far
        (at least 4 KiB), deletes the records removed while unhealthy (tombstones: first, since with
        LMDB's map full they make the room), reloads the index from LMDB, and writes and deletes such
        a record in the ``probe`` sub-database, evicting in the policy's order while the map has no
        room for it (reopening an environment that panicked). Holds the index lock only while it runs, never while waiting.

        Raises:
            OSError: too little free space (ENOSPC).
            lmdb.Error: a probe transaction failed (the tier stays unhealthy).
        """
        need = max(self._largest, _MIN_PROBE_BYTES)
        free = free_bytes(self.config.path)
        if free < need:
            raise OSError(errno.ENOSPC, f"No space left on device: {free} bytes free on the filesystem of "
                                        f"{self.config.path}, a record needs {need}")
        with self.index.lock:
            self.drain()
            try:
                env, _, _, _ = self._env()
                # the pending deletes first: with LMDB's map full they are what makes room for the
                # probe record (the other way round a full map never recovered: attack pass 4, A4-9)
                self._apply_tombstones(env)
                self._load_index(scrub=False)
                probe = DiskJob(puts=[(_PROBE_KEY, torch.empty(0, dtype=torch.uint8))])
                while True:
                    try:
                        with self._write_txn(env) as txn:
                            txn.put(_PROBE_KEY, bytes(need), db=self._probe_db)
                        break
                    except lmdb.MapFullError:
                        # room as for a write: evict in the policy's order until the probe fits
                        probe.puts = [(_PROBE_KEY, torch.empty(need, dtype=torch.uint8))]
                        if not self._make_room_for(probe, set(), None, healthy=False):
                            raise
                with self._write_txn(env) as txn:
                    txn.delete(_PROBE_KEY, db=self._probe_db)
            except lmdb.PanicError:
                self._reopen()
                raise
            if self._writer is not None:
                self._writer.resume()  # in step with LMDB again: write-behind jobs are taken again

    def _reopen(self) -> None:
        """Close a panicked environment; the next use opens it again (with the startup scrub)."""
        env, self._env_obj = self._env_obj, None
        if env is not None:
            try:
                close_environment(self.config.path, env)
            except lmdb.Error:
                log.warning("disk tier: closing the panicked LMDB environment failed", exc_info=True)

    def flush(self) -> None:
        """Persist deferred LRU positions and tombstones and force LMDB's buffers to disk
        (``env.sync(True)``). A storage failure is logged, not raised (this runs at shutdown)."""
        with self.index.lock:
            if self._env_obj is not None and self._pid == os.getpid():
                self.drain()
                try:
                    self.index.apply_touches()
                    if self._touched or self._tombstones:
                        self._apply(DiskJob(deletes=[(k, self._seq.pop(k, None)) for k in self._tombstones],
                                            stamps=self._take_stamps()))
                        self._tombstones.clear()
                    self._env_obj.sync(True)
                except Exception as e:
                    if not (is_io_fault(e) or isinstance(e, lmdb.MapFullError)):
                        raise
                    log.warning("disk tier: flush failed (%s); %d removals were not written and those records "
                                "may be back after a restart", describe_fault(e), len(self._tombstones))

    def close(self) -> None:
        with self.index.lock:
            if self._writer is not None:
                self._writer.close()  # what is queued commits first
            if self._env_obj is not None and self._pid == os.getpid():
                self.flush()
                close_environment(self.config.path, self._env_obj)
            self._loaded_pid = None
            self._env_obj = None
