"""LMDB disk tier: records in one embedded LMDB environment, under kvtier's own byte budget.

The py-lmdb way (DESIGN.md, STYLE.md):

* the tier owns the only ``Environment`` of its file in this process (:func:`open_environment`
  refuses a second one), opened lazily on first use so it is created after any ``fork()``. An
  environment must not cross ``fork()``: a child that inherits an *opened* tier gets
  :class:`EnvironmentInUseError` and never touches the parent's handle (build tiers after forking);
* ``map_size`` is the ``--disk-size`` budget; kvtier evicts (LRU) to keep its charged bytes under
  ``map_size * (1 - reserve_fraction)``, so LMDB's own ``MapFullError`` should never happen; if it does,
  the transaction aborts, nothing of it is visible, and the caller gets :class:`TierFullError`;
* every transaction is a ``with env.begin(...)``; reads use ``buffers=True`` and copy out inside it;
* the LRU order persists in two sub-databases (``seq``: key -> access sequence number, ``order``:
  sequence number -> key), so it survives a restart; a read hit's new position is written with the
  next write transaction (or at flush/close), so reads never open a write transaction (with
  ``sync`` that would be an fsync per read); a startup scrub drops damaged records.

Thread safety: writes, touches and removals are serialised by the index lock (LMDB allows one writer
anyway); reads run in parallel read transactions and see a snapshot, so a read racing an eviction
returns the whole record or a miss.
"""

from __future__ import annotations

import logging
import os
import resource
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import lmdb
import numpy as np
import torch

from kvtier.server.hostmem import HostArena
from kvtier.server.tiers.base import EvictHook, RecordLike, Tier, TierConfig
from kvtier.server.tiers.errors import EnvironmentInUseError, RecordError, TierFullError
from kvtier.server.tiers.policy import TierIndex
from kvtier.server.tiers.record import verify_record

# Pauses between retries of a put transaction that hit MapFullError while read transactions still
# pinned the pages the eviction commit freed (about 0.35 s in all before TierFullError).
MAP_FULL_RETRY_PAUSES_S: tuple[float, ...] = (0.002, 0.01, 0.03, 0.1, 0.2)

log = logging.getLogger(__name__)

LMDB_PAGE_BYTES = resource.getpagesize()
_PAGE_HEADER = 16  # LMDB overflow-page header
_INDEX_OVERHEAD = 256  # leaf nodes of the record and its seq/order entries, charged generously
MAX_KEY_BYTES = 511

_SEQ = struct.Struct(">Q")  # big-endian: the order sub-database iterates oldest first

_envs: dict[str, tuple[int, lmdb.Environment]] = {}
_envs_lock = threading.Lock()


def open_environment(path: str | Path, **kwargs: object) -> lmdb.Environment:
    """Open the process's only LMDB environment for ``path`` (a directory, created if missing).

    Raises:
        EnvironmentInUseError: this process already has an environment open for ``path``.
    """
    real = os.path.realpath(path)
    with _envs_lock:
        held = _envs.get(real)
        if held is not None and held[0] == os.getpid():
            raise EnvironmentInUseError(f"an LMDB environment for {real} is already open in this process")
        if held is not None:
            raise EnvironmentInUseError(f"the LMDB environment for {real} was opened by process {held[0]} before "
                                        f"fork(); environments must not cross fork(): open tiers after forking")
        os.makedirs(real, exist_ok=True)
        env = lmdb.open(real, **kwargs)
        _envs[real] = (os.getpid(), env)
        return env


def close_environment(path: str | Path, env: lmdb.Environment) -> None:
    """Close ``env`` and forget it (only if this process opened it)."""
    real = os.path.realpath(path)
    with _envs_lock:
        held = _envs.get(real)
        if held is not None and held[1] is env and held[0] == os.getpid():
            del _envs[real]
            env.close()


def _mapping_address(path: str) -> int:
    """Start address of this process's mapping of ``path`` (LMDB's map of its data file), 0 if none
    is found (``env.info()`` reports 0 unless the map is fixed, so /proc/self/maps tells)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() == path and parts[2] == "00000000":
                    return int(parts[0].split("-")[0], 16)
    except OSError:
        pass
    return 0


def disk_charge(record_nbytes: int) -> int:
    """Bytes of the map a record of ``record_nbytes`` takes, as kvtier charges it: whole LMDB overflow
    pages plus index entries (the simulator charges the same)."""
    pages = -(-(record_nbytes + _PAGE_HEADER) // LMDB_PAGE_BYTES)
    return pages * LMDB_PAGE_BYTES + _INDEX_OVERHEAD


@dataclass
class DiskTierConfig(TierConfig):
    """Disk tier settings.

    Attributes:
        path: directory of the LMDB environment (created if missing).
        capacity_bytes: the ``--disk-size`` budget: LMDB's ``map_size`` (default 4 GiB).
        reserve_fraction: part of the map kept free of records for LMDB's B-tree pages, copy-on-write
            pages and free-list slack; records may use ``capacity_bytes * (1 - reserve_fraction)``.
            LMDB reuses pages freed by a transaction only two transactions later, so the reserve must
            hold about two write batches (``max_txn_bytes``) on top of the B-tree.
        max_txn_bytes: a write batch commits in transactions of at most this many record bytes.
        max_readers: LMDB reader slots (concurrent read transactions).
        sync: fsync every commit's data (durable across power loss; slower). The meta page is
            synced with the next commit (LMDB's ``metasync=False``: one fsync a commit instead of
            two), so a power loss can undo the last commit -- a cache loses a record it can
            recompute -- but never corrupts the environment.
        scrub_on_open: verify every record's checksum at startup and drop damaged ones.
        verify_reads: verify each record's checksum when it is read.
        read_buffer_bytes: a host arena (made on first read) that :meth:`DiskTier.borrow` copies
            records into, faulted in once; a record that does not fit gets fresh memory.
    """

    kind: ClassVar[str] = "disk"
    path: str = ""
    capacity_bytes: int = 4 << 30
    reserve_fraction: float = 0.25
    max_txn_bytes: int = 64 << 20
    max_readers: int = 126
    sync: bool = False
    scrub_on_open: bool = True
    verify_reads: bool = True
    read_buffer_bytes: int = 64 << 20

    def validate(self) -> None:
        super().validate()
        if not self.path:
            raise ValueError("disk tier path must be set")
        if not 0.0 < self.reserve_fraction < 1.0:
            raise ValueError(f"disk reserve_fraction must lie in (0, 1), got {self.reserve_fraction!r}")
        if self.max_txn_bytes <= 0 or self.max_readers <= 0:
            raise ValueError("disk max_txn_bytes and max_readers must be positive")
        if self.capacity_bytes and self.capacity_bytes < 64 * LMDB_PAGE_BYTES:
            raise ValueError(f"disk capacity_bytes must be at least {64 * LMDB_PAGE_BYTES} bytes, got {self.capacity_bytes}")

    @property
    def record_budget(self) -> int:
        """Charged bytes records may use (see :func:`disk_charge`)."""
        return int(self.capacity_bytes * (1.0 - self.reserve_fraction))


class DiskTier(Tier):
    """Records in an LMDB environment, LRU order persisted, damaged records dropped on sight.

    Args:
        config: :class:`DiskTierConfig`.

    Raises:
        ValueError: a bad config field.
    """

    name = "disk"

    def __init__(self, config: DiskTierConfig) -> None:
        config.validate()
        super().__init__(TierIndex(config.record_budget))
        self.config = config
        self._env_obj: lmdb.Environment | None = None
        self._pid = -1
        self._seq: dict[bytes, int] = {}
        self._sizes: dict[bytes, int] = {}
        self._touched: dict[bytes, None] = {}  # read hits whose new LRU position is not on disk yet
        self._next_seq = 0
        self._scrubbed = 0
        self._map_addr = 0
        self._data_fd = -1
        self._read_arena: HostArena | None = None

    # ----- environment ------------------------------------------------------------------------
    def _env(self) -> tuple[lmdb.Environment, lmdb._Database, lmdb._Database, lmdb._Database]:
        with self.index.lock:
            if self._env_obj is not None and self._pid != os.getpid():
                raise EnvironmentInUseError(f"this disk tier's LMDB environment was opened by process {self._pid} "
                                            f"before fork(); environments must not cross fork(): build tiers after forking")
            if self._env_obj is None:
                self._env_obj = open_environment(
                    self.config.path, map_size=self.config.capacity_bytes, max_readers=self.config.max_readers,
                    max_dbs=3, subdir=True, sync=self.config.sync, metasync=False, readahead=False,
                    meminit=False,
                )
                self._pid = os.getpid()
                env = self._env_obj
                self._dbs = (env.open_db(b"records"), env.open_db(b"seq"), env.open_db(b"order"))
                data = os.path.realpath(os.path.join(self.config.path, "data.mdb"))
                self._map_addr = _mapping_address(data)
                self._data_fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC) if self._map_addr else -1
                if self.config.read_buffer_bytes > 0:
                    self._read_arena = HostArena(self.config.read_buffer_bytes, pin=False, name="kvtier-disk-reads")
                self._load_index(scrub=self.config.scrub_on_open)
            return (self._env_obj, *self._dbs)

    def open(self) -> None:
        """Open the environment now (and run the startup scrub); otherwise the first use opens it."""
        self._env()

    def _load_index(self, *, scrub: bool) -> None:
        """Rebuild the in-memory index (and LRU order) from what LMDB holds; drop damaged records
        and stray order entries when ``scrub``."""
        env, records, seqdb, orderdb = self._env_obj, *self._dbs
        sizes: dict[bytes, int] = {}
        bad: list[bytes] = []
        with env.begin(db=records, buffers=True) as txn:
            for k, v in txn.cursor():
                key = bytes(k)
                if scrub:
                    try:
                        verify_record(v)
                    except RecordError as e:
                        log.warning("disk tier scrub: record %s is damaged (%s); dropped", key.hex(), e)
                        bad.append(key)
                        continue
                sizes[key] = len(v)
            ordered: list[tuple[int, bytes]] = [(_SEQ.unpack(bytes(s))[0], bytes(k)) for s, k in txn.cursor(db=orderdb)]
        stray = [(s, k) for s, k in ordered if k not in sizes]
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
        if bad or stray or unordered:
            with env.begin(write=True) as txn:
                for k in bad:
                    txn.delete(k, db=records)
                    txn.delete(k, db=seqdb)
                for s, k in stray:
                    txn.delete(_SEQ.pack(s), db=orderdb)
                for k in unordered:  # cannot come from kvtier (one txn writes both); keep it, newest
                    self._stamp(txn, k)
                    self.index.commit_insert(k, disk_charge(sizes[k]))
        self._scrubbed += len(bad)
        if bad:
            self._count(damaged=len(bad))

    # ----- presence ---------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._env()
        return super().contains(keys)

    def lookup(self, keys: Sequence[bytes]) -> int:
        self._env()
        return super().lookup(keys)

    def nbytes(self, keys: Sequence[bytes]) -> list[int | None]:
        env, records, _, _ = self._env()
        with env.begin(db=records, buffers=True) as txn:
            out = []
            for k in keys:
                v = txn.get(k)
                out.append(None if v is None else len(v))
            return out

    # ----- writes -----------------------------------------------------------------------------
    def _stamp(self, txn: lmdb.Transaction, key: bytes) -> None:
        _, seqdb, orderdb = self._dbs  # a transaction is open: so is the environment
        old = self._seq.get(key)
        if old is not None:
            txn.delete(_SEQ.pack(old), db=orderdb)
        s = self._next_seq
        self._next_seq += 1
        txn.put(_SEQ.pack(s), key, db=orderdb)
        txn.put(key, _SEQ.pack(s), db=seqdb)
        self._seq[key] = s

    def _stamp_touched(self, txn: lmdb.Transaction) -> None:
        """Persist the LRU positions of read hits (deferred so a read never needs a write txn)."""
        for key in self._touched:
            if key in self.index:
                self._stamp(txn, key)
        self._touched.clear()

    def _delete(self, txn: lmdb.Transaction, key: bytes) -> None:
        records, seqdb, orderdb = self._dbs
        txn.delete(key, db=records)
        txn.delete(key, db=seqdb)
        s = self._seq.pop(key, None)
        if s is not None:
            txn.delete(_SEQ.pack(s), db=orderdb)

    def write(self, items: Sequence[tuple[bytes, RecordLike]], *, on_evict: EvictHook | None = None,
              replace: bool = False) -> list[bytes]:
        for key, rec in items:
            if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
                raise ValueError(f"disk tier keys must be 1..{MAX_KEY_BYTES} bytes")
            if not isinstance(rec, torch.Tensor) or rec.dtype != torch.uint8 or rec.dim() != 1 or rec.device.type != "cpu":
                raise ValueError("disk tier records must be 1-D uint8 host tensors")
        env, records, _, _ = self._env()
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
        with self.index.lock:
            for batch in batches:
                written.extend(self._write_batch(env, records, batch, on_evict, replace))
        return written

    def _write_batch(self, env: lmdb.Environment, records: lmdb._Database, batch: list[tuple[bytes, torch.Tensor]],
                     on_evict: EvictHook | None, replace: bool) -> list[bytes]:
        """Plan the batch on the index, commit the evictions (their pages become reusable), then put
        the records in one transaction. On any failure the index is reloaded from LMDB, so memory
        and disk agree and nothing of the failed records is visible."""
        victims: list[bytes] = []
        puts: list[tuple[bytes, torch.Tensor]] = []
        order: list[bytes] = []  # keys in the order memory saw them (touched or inserted)
        try:
            for key, rec in batch:
                if key in self.index:
                    if not replace:
                        self.index.touch(key)
                        order.append(key)
                        continue
                    self.index.remove(key)
                    victims.append(key)
                charge = disk_charge(int(rec.numel()))
                chosen = self.index.plan_insert(key, charge)
                self.index.commit_insert(key, charge, chosen)
                victims.extend(chosen)
                puts.append((key, rec))
                order.append(key)
            stored_before = {k: self._sizes[k] for k in victims if k in self._sizes}
            puts = [(k, r) for k, r in puts if k in self.index]  # not evicted again within the batch
            if victims:
                with env.begin(write=True) as txn:
                    for v in victims:
                        self._delete(txn, v)
            recs = dict(puts)
            for attempt, pause in enumerate(MAP_FULL_RETRY_PAUSES_S + (None,)):
                try:
                    with env.begin(write=True) as txn:
                        self._stamp_touched(txn)
                        for key in order:
                            if key not in self.index:
                                continue  # evicted again within the batch
                            if key in recs:
                                txn.put(key, memoryview(recs[key].numpy()), db=records)
                            self._stamp(txn, key)
                    break
                except lmdb.MapFullError:
                    # Pages freed by the eviction commit above are reusable only once every read
                    # transaction older than it has ended; concurrent readers can hold them a moment.
                    # The aborted transaction left nothing behind, so wait briefly and try again.
                    if pause is None:
                        raise
                    log.debug("LMDB map full while readers hold freed pages; retrying in %.3f s (attempt %d)", pause, attempt + 1)
                    time.sleep(pause)
        except BaseException as e:
            self._load_index(scrub=False)  # the put transaction aborted: back to exactly what LMDB holds
            if isinstance(e, (lmdb.MapFullError, TierFullError)):
                self._count(full_errors=1)
            if isinstance(e, lmdb.MapFullError):
                raise TierFullError(f"LMDB map full ({self.config.capacity_bytes} bytes): the write was "
                                    f"rolled back") from e
            raise
        put_keys = {k for k, _ in puts}
        evicted = [v for v in dict.fromkeys(victims) if v in stored_before and v not in put_keys]
        for v in evicted:
            self._sizes.pop(v, None)
        written = 0
        for k, r in puts:
            n = int(r.numel())
            self._sizes[k] = n
            written += n
        self._count(writes=len(puts), bytes_written=written, evictions=len(evicted),
                    bytes_evicted=sum(stored_before[v] for v in evicted))
        if on_evict is not None:
            for v in evicted:
                on_evict(v, stored_before[v])  # the last tier: its victims' sizes, not their bytes
        return [k for k, _ in puts]

    def remove(self, keys: Sequence[bytes]) -> int:
        env, _, _, _ = self._env()
        n = 0
        with self.index.lock, env.begin(write=True) as txn:
            self._stamp_touched(txn)
            for k in keys:
                if k in self.index:
                    self._delete(txn, k)
                    self.index.remove(k)
                    self._sizes.pop(k, None)
                    n += 1
        return n

    # ----- reads ------------------------------------------------------------------------------
    def _copy_out(self, view: memoryview, out: torch.Tensor) -> None:
        """Copy a value (a ``buffers=True`` view; the read transaction is open) into ``out``.

        The value's bytes are read from the data file at their offset in LMDB's map with one
        ``preadv`` (a copy from the page cache, like a plain file read) instead of from the map:
        the map is a read-only file mapping, so touching a record there page-faults every 4 KiB page
        the process has not touched yet (every record just spilled), which made restores ~2x slower
        than a plain file read (BENCHMARKS.md). The bytes are the same: LMDB (no ``writemap``) writes
        with ``pwrite``, so map and file are one page cache, and the open read transaction keeps
        those pages from being reused. Falls back to copying from the map.
        """
        n = len(view)
        dst = out.numpy()[:n]
        off = int(np.frombuffer(view, dtype=np.uint8).ctypes.data) - self._map_addr
        if self._data_fd >= 0 and 0 <= off and off + n <= self.config.capacity_bytes:
            if os.preadv(self._data_fd, [memoryview(dst)], off) == n:
                return
        dst[:] = np.frombuffer(view, dtype=np.uint8)

    def _read_buffer(self, n: int) -> torch.Tensor:
        """A host buffer of ``n`` bytes for :meth:`borrow`: a block of the tier's read arena (made
        when the environment opens; freed when the caller drops it), else fresh memory."""
        arena = self._read_arena
        block = arena.alloc_tensor(n) if arena is not None else None
        return block if block is not None else torch.empty(n, dtype=torch.uint8)

    def _read(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor] | None) -> tuple[list[int], list[torch.Tensor | None]]:
        """Copy each key's record out in one read transaction (into ``outs``, or buffers of
        :meth:`_read_buffer`), then verify, count and touch. Returns the sizes (0: miss) and buffers.

        Raises:
            ValueError: a buffer of ``outs`` too small (checked before any copy).
        """
        env, records, _, _ = self._env()
        sizes: list[int] = []
        bufs: list[torch.Tensor | None] = []
        with env.begin(db=records, buffers=True) as txn:
            views = [txn.get(k) for k in keys]
            if outs is not None:
                for k, v, o in zip(keys, views, outs):
                    if v is not None and len(v) > o.numel():
                        raise ValueError(f"buffer of {o.numel()} bytes is too small for the {len(v)}-byte record of key {k.hex()}")
            for i, v in enumerate(views):
                if v is None:
                    sizes.append(0)
                    bufs.append(None)
                    continue
                o = outs[i] if outs is not None else self._read_buffer(len(v))
                self._copy_out(v, o)  # inside the transaction
                sizes.append(len(v))
                bufs.append(o)
        damaged: list[bytes] = []
        if self.config.verify_reads:
            for i, (k, o, n) in enumerate(zip(keys, bufs, sizes)):
                if n:
                    try:
                        verify_record(o[:n])  # type: ignore[index]
                    except RecordError as e:
                        log.warning("disk tier: record %s is damaged (%s); dropped, read as a miss", k.hex(), e)
                        damaged.append(k)
                        sizes[i], bufs[i] = 0, None
        hits = [k for k, n in zip(keys, sizes) if n]
        self._count(hits=len(hits), misses=len(keys) - len(hits), damaged=len(damaged), bytes_read=sum(sizes))
        with self.index.lock:
            for k in hits:
                if k in self.index:
                    self.index.touch(k)
                    self._touched.pop(k, None)
                    self._touched[k] = None
            if damaged:
                with env.begin(write=True) as txn:
                    self._stamp_touched(txn)
                    for k in damaged:
                        if k in self.index:
                            self._delete(txn, k)
                            self.index.remove(k)
                            self._sizes.pop(k, None)
        return sizes, bufs

    def read_into(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> list[int]:
        self._check_outs(keys, outs)
        return self._read(keys, outs)[0]

    @contextmanager
    def borrow(self, keys: Sequence[bytes]) -> Iterator[list[RecordLike | None]]:
        """Each key's record (None where absent or damaged), verified, in one read transaction; the
        buffers come from the tier's read arena and are freed when the caller drops them."""
        sizes, bufs = self._read(keys, None)
        yield [b[:n] if b is not None and n else None for b, n in zip(bufs, sizes)]

    # ----- housekeeping -------------------------------------------------------------------------
    def lmdb_info(self) -> dict[str, int]:
        """LMDB's own view: ``map_size``, pages in use (``last_pgno + 1``) times page size, entries."""
        env, records, _, _ = self._env()
        info = env.info()
        with env.begin(db=records) as txn:
            entries = txn.stat(records)["entries"]
        return {"map_size": info["map_size"], "file_bytes_used": (info["last_pgno"] + 1) * LMDB_PAGE_BYTES,
                "entries": entries}

    def stats(self):  # type: ignore[override]
        if self._env_obj is None:
            self._env()  # first use only (opens and scrubs); once open, stats take no index lock
        s = super().stats()
        s.extra = {"scrubbed": self._scrubbed, "map_size": self.config.capacity_bytes}
        return s

    def flush(self) -> None:
        """Persist deferred LRU positions and force LMDB's buffers to disk (``env.sync(True)``)."""
        with self.index.lock:
            if self._env_obj is not None and self._pid == os.getpid():
                if self._touched:
                    with self._env_obj.begin(write=True) as txn:
                        self._stamp_touched(txn)
                self._env_obj.sync(True)

    def close(self) -> None:
        with self.index.lock:
            if self._env_obj is not None and self._pid == os.getpid():
                self.flush()
                close_environment(self.config.path, self._env_obj)
                if self._data_fd >= 0:
                    os.close(self._data_fd)
            self._env_obj = None
            self._data_fd = -1
