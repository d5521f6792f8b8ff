"""The LMDB environment the disk tier owns, its settings and what a record is charged.

* :func:`open_environment` / :func:`close_environment`: one ``Environment`` per file and process; a
  second one, or one that crossed ``fork()``, is refused (LMDB forbids both); and one process per
  directory: the environment is opened only under the directory's exclusive lock, held until it is
  closed (:mod:`~kvtier.server.tiers.disk_lock`), so a second daemon on the same ``--disk-path`` is refused.
* :class:`DiskTierConfig`: the disk tier's typed settings (``map_size`` is ``capacity_bytes``).
* :func:`disk_charge`: bytes of the map a record takes (whole overflow pages plus index entries); the
  simulator charges the same, so a simulation evicts exactly what a real run evicts.
"""

from __future__ import annotations

import os
import resource
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import lmdb

from kvtier.server.tiers.base import TierConfig
from kvtier.server.tiers.disk_lock import lock_directory, unlock_directory
from kvtier.server.tiers.disk_private import LMDB_FILE_MODE, check_private, private_dir
from kvtier.server.tiers.errors import EnvironmentInUseError

LMDB_PAGE_BYTES = resource.getpagesize()
_PAGE_HEADER = 16  # LMDB overflow-page header
_INDEX_OVERHEAD = 256  # leaf nodes of the record and its seq/order entries, charged generously
MAX_KEY_BYTES = 511


_envs: dict[str, tuple[int, lmdb.Environment, int]] = {}  # real path -> (pid, environment, lock descriptor)
_envs_lock = threading.Lock()


def open_environment(path: str | Path, **kwargs: object) -> lmdb.Environment:
    """Open the process's only LMDB environment for ``path`` (a directory, created 0700 if missing; its
    files are created 0600; one another user could read is refused: :mod:`~kvtier.server.tiers.disk_private`).

    The directory's exclusive lock is taken first and held until :func:`close_environment`: another
    process (a second daemon) holding it is refused before LMDB opens anything.

    Raises:
        DiskPathError: ``path`` or an LMDB file in it has a group/other mode bit or another owner, or
            is not a plain directory/file.
        DiskPathInUseError: another process holds the directory's lock (names its pid).
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
        private_dir(real)
        check_private(real)
        lock = lock_directory(real)  # one daemon a directory: a second one is refused here
        try:
            env = lmdb.open(real, mode=LMDB_FILE_MODE, **kwargs)  # 0600 minus the umask, never looser
        except BaseException:
            unlock_directory(lock)
            raise
        _envs[real] = (os.getpid(), env, lock)
        return env


def close_environment(path: str | Path, env: lmdb.Environment) -> None:
    """Close ``env``, forget it and release the directory's lock (only if this process opened it)."""
    real = os.path.realpath(path)
    with _envs_lock:
        held = _envs.get(real)
        if held is not None and held[1] is env and held[0] == os.getpid():
            del _envs[real]
            try:
                env.close()
            finally:
                unlock_directory(held[2])  # after LMDB let go of its files: the next daemon may open them


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
        probe_backoff_initial_s: seconds from a storage failure to the first probe.
        probe_backoff_max_s: the longest wait between probes (the wait doubles from the initial one).
        fault_file: tests only: while this file exists every write transaction fails as on a full disk
            (``KVTIER_DISK_FAULT_FILE``, see :mod:`~kvtier.server.tiers.disk_faults`).
        slow_file: tests only: while this file exists every put transaction waits before it commits
            (``KVTIER_TEST_DISK_SLOW_FILE``: a slow disk, see
            :func:`~kvtier.server.tiers.disk_faults.hold_before_commit`).
        write_behind: apply each write's LMDB transactions on a writer thread
            (:mod:`~kvtier.server.tiers.disk_writer`): the write returns once its decisions are made;
            records wait in memory (and are read from there) until their transaction commits. A
            storage failure then shows at the next call, and a crash loses the records still
            waiting (the index is rebuilt from LMDB at the next start). False: every write commits
            before it returns.
        write_behind_bytes: record bytes that may wait for the writer before a write blocks.
        read_buffer_bytes: a host arena (made when the environment opens) that
            :meth:`~kvtier.server.tiers.disk.DiskTier.borrow` copies records into, faulted in once; a
            record that does not fit gets fresh memory.
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
    probe_backoff_initial_s: float = 1.0
    probe_backoff_max_s: float = 30.0
    fault_file: str = ""
    slow_file: str = ""
    read_buffer_bytes: int = 64 << 20
    write_behind: bool = False
    write_behind_bytes: int = 64 << 20

    def validate(self) -> None:
        super().validate()
        if not self.path:
            raise ValueError("disk tier path must be set")
        if not 0.0 < self.reserve_fraction < 1.0:
            raise ValueError(f"disk reserve_fraction must lie in (0, 1), got {self.reserve_fraction!r}")
        if self.max_txn_bytes <= 0 or self.max_readers <= 0 or self.write_behind_bytes <= 0:
            raise ValueError("disk max_txn_bytes, max_readers and write_behind_bytes must be positive")
        if not 0 < self.probe_backoff_initial_s <= self.probe_backoff_max_s:
            raise ValueError("disk probe backoff must satisfy 0 < initial <= max")
        if self.capacity_bytes and self.capacity_bytes < 64 * LMDB_PAGE_BYTES:
            raise ValueError(f"disk capacity_bytes must be at least {64 * LMDB_PAGE_BYTES} bytes, got {self.capacity_bytes}")

    @property
    def record_budget(self) -> int:
        """Charged bytes records may use (see :func:`disk_charge`)."""
        return int(self.capacity_bytes * (1.0 - self.reserve_fraction))
