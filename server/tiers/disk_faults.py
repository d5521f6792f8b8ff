"""What can go wrong under the disk tier, told apart from the caller's mistakes.

* An unusable ``--disk-path`` (a file, a pseudo filesystem such as ``/proc``, a read-only filesystem, a
  directory this user cannot write) is refused when the daemon starts, with one line that says what to
  do (:func:`check_disk_path` raises :class:`~kvtier.server.tiers.errors.DiskPathError`).
* An I/O fault while serving (ENOSPC, EIO: LMDB reports a full filesystem as ``mdb_txn_commit:
  Input/output error``; a reader table that is full; an environment that panicked) is not the caller's
  fault: :func:`is_io_fault` says so, and the disk tier turns unhealthy instead of failing the call.
  ``MapFullError`` is not a fault: it means kvtier's own budget is full (``TierFullError``).
* Tests inject an I/O fault where no small filesystem can be mounted: while the file named by
  ``KVTIER_DISK_FAULT_FILE`` exists, every write transaction of the disk tier fails as LMDB fails on
  a full disk (:func:`check_injected_fault`); removing the file is "space came back".
* Tests make the disk slow to hold a long write-behind queue (a kill -9 then finds many records
  queued): while the file named by ``KVTIER_TEST_DISK_SLOW_FILE`` exists, every put transaction of
  the disk tier waits before it commits (:func:`hold_before_commit`): the seconds the file holds, or,
  if it holds no positive number, until the file is removed or holds one.

Both variables are for tests only: nothing in kvtier sets them, ``kvtier serve`` logs a WARNING at
start when either is set, and with neither set the data path pays one empty-string test.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import lmdb

from kvtier.addresses import UnsafePathError, check_path_owners
from kvtier.server.tiers.disk_private import check_private, private_dir
from kvtier.server.tiers.errors import DiskPathError

FAULT_FILE_ENV = "KVTIER_DISK_FAULT_FILE"
SLOW_FILE_ENV = "KVTIER_TEST_DISK_SLOW_FILE"
_HOLD_POLL_S = 0.01
_WHAT_TO_DO = "pass --disk-path DIR on a local, writable filesystem (or leave it out for a host tier only)"


class InjectedDiskFault(lmdb.Error):
    """The fault a test injects through :data:`FAULT_FILE_ENV` (an ``lmdb.Error``, like the real one)."""


def fault_file_from_env() -> str:
    """The path in ``KVTIER_DISK_FAULT_FILE`` ("" when unset)."""
    return os.environ.get(FAULT_FILE_ENV, "").strip()


def check_injected_fault(fault_file: str) -> None:
    """Raise :class:`InjectedDiskFault` while ``fault_file`` (non-empty) exists."""
    if fault_file and os.path.exists(fault_file):
        raise InjectedDiskFault(f"mdb_txn_commit: Input/output error (injected: {fault_file} exists)")


def slow_file_from_env() -> str:
    """The path in ``KVTIER_TEST_DISK_SLOW_FILE`` ("" when unset)."""
    return os.environ.get(SLOW_FILE_ENV, "").strip()


def fault_hooks_in_env() -> list[str]:
    """The test-only fault variables set in this process's environment (the daemon warns of each)."""
    return [name for name in (FAULT_FILE_ENV, SLOW_FILE_ENV) if os.environ.get(name, "").strip()]


def hold_before_commit(slow_file: str) -> float:
    """Tests only: while ``slow_file`` (non-empty) exists, wait before a put transaction commits -- for
    the seconds it holds (a float), or, when it holds none, until it is removed or holds one.

    Returns:
        Seconds waited (0.0 when the file is absent or ``slow_file`` is empty).
    """
    if not slow_file:
        return 0.0
    began = time.monotonic()
    while True:
        try:
            text = Path(slow_file).read_text().strip()
        except OSError:  # absent (removed): commit now
            return time.monotonic() - began
        try:
            delay = float(text)
        except ValueError:
            delay = 0.0
        if delay > 0:
            time.sleep(delay)
            return time.monotonic() - began
        time.sleep(_HOLD_POLL_S)


def is_io_fault(exc: BaseException) -> bool:
    """True for a failure of the storage under the tier (not of the caller, not of kvtier's budget):
    any ``lmdb.Error`` but ``MapFullError``, and ``OSError``."""
    if isinstance(exc, lmdb.MapFullError):
        return False
    return isinstance(exc, (lmdb.Error, OSError))


def describe_fault(exc: BaseException) -> str:
    """A one-line reason for health and logs, e.g. ``mdb_txn_commit: Input/output error``."""
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem (``statvfs``)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_disk_path(path: str | Path) -> Path:
    """Make sure the disk tier can keep an LMDB environment in ``path`` (created if missing).

    Returns:
        The directory as an absolute :class:`~pathlib.Path`.

    The directory (and any parent it creates) is made mode 0700; an existing one, or an LMDB file in
    it, that another user could read is refused (:mod:`~kvtier.server.tiers.disk_private`), and so is
    a path another user could redirect: a directory on the way owned by another uid (not root) or
    writable by group/others without the sticky bit, or a symlink on the way owned by another uid
    (:func:`kvtier.addresses.check_path_owners`, the check the socket paths get).

    Raises:
        DiskPathError: ``path`` is a file, cannot be created, has a group/other mode bit or another
            owner (or its LMDB files do), can be redirected by another user (above), lies on a pseudo filesystem (no storage,
            e.g. ``/proc``) or a read-only one, or this user cannot write it. The message names the
            path and what to do.
    """
    p = Path(os.path.abspath(os.path.expanduser(str(path))))
    try:  # another user who controls a directory on the way could point the tier elsewhere (A4-3)
        check_path_owners(p, "--disk-path", "directory", UnsafePathError, entry_owner=False)  # check_private: its own
    except UnsafePathError as e:
        raise DiskPathError(str(e)) from None
    if p.exists() and not p.is_dir():
        raise DiskPathError(f"--disk-path {p} is not a directory; {_WHAT_TO_DO}")
    try:
        private_dir(p)  # missing directories are made 0700 (the daemon's alone)
    except OSError as e:
        raise DiskPathError(f"--disk-path {p} cannot be created ({e.strerror or e}); {_WHAT_TO_DO}") from None
    st = os.statvfs(p)
    if st.f_flag & os.ST_RDONLY:
        raise DiskPathError(f"--disk-path {p} is on a read-only filesystem; {_WHAT_TO_DO}")
    if st.f_blocks == 0:
        raise DiskPathError(f"--disk-path {p} is on a pseudo filesystem without storage (such as /proc or /sys); "
                            f"{_WHAT_TO_DO}")
    if not os.access(p, os.W_OK | os.X_OK):
        raise DiskPathError(f"--disk-path {p} is not writable by this user; {_WHAT_TO_DO}")
    check_private(p)  # after the filesystem checks: /proc is "pseudo", not "mode 0555"
    return p


def open_failure(path: str | Path, exc: BaseException) -> DiskPathError:
    """The startup error for an environment LMDB could not open in ``path``."""
    reason = describe_fault(exc)
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        reason = "no space left on the filesystem"
    if isinstance(exc, (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError)):
        # the filesystem is fine, the file is not (attack pass 4, A4-7: the advice named the filesystem)
        return DiskPathError(f"--disk-path {path}: its LMDB file is damaged or not LMDB ({reason}); move the "
                             f"directory away (its records are lost) to start with an empty disk tier, or give "
                             f"another --disk-path")
    return DiskPathError(f"--disk-path {path}: LMDB cannot open its environment there ({reason}); {_WHAT_TO_DO}")
