"""One daemon a disk directory: an exclusive ``flock`` on ``DIR/kvtier.lock`` while the tier's LMDB
environment is open.

LMDB lets many processes share one environment (its ``lock.mdb`` orders their transactions), but a
kvtier disk tier keeps its index, eviction order and byte budget in memory and records do not carry
their key: two daemons on one ``--disk-path`` both started, and each served records the other had
written under the same key as its own copy (attack pass F3). So the tier takes an exclusive,
non-blocking ``flock`` on a lock file in the directory before LMDB opens it, and holds it until the
environment is closed:

* :func:`lock_directory` takes it (the file is created 0600, like the daemon's other private files,
  and must be a regular file of the daemon's uid without group/other bits); another process that holds
  it makes :class:`~kvtier.server.tiers.errors.DiskPathInUseError`, one line naming the directory and
  the holder's pid (the file's text, written by the holder; only a name for the message).
* :func:`check_directory_free`: the same test without keeping the lock, so ``kvtier serve`` refuses a
  directory in use before it allocates anything (the lock itself still decides, should another daemon
  start in between).

The kernel releases a ``flock`` when the process exits, ``kill -9`` included, so a crash never leaves a
stale lock; the lock file stays and is reused. The descriptor is close-on-exec, so a process the daemon
starts does not keep the lock after the daemon ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path

from kvtier.server.tiers.errors import DiskPathError, DiskPathInUseError

LOCK_NAME = "kvtier.lock"
LOCK_FILE_MODE = 0o600


def lock_directory(directory: str | Path) -> int:
    """Take the exclusive lock of the disk directory ``directory`` (which exists and is the daemon's).

    Returns:
        The lock file's descriptor; the lock lasts until :func:`unlock_directory` closes it (or the
        process exits).

    Raises:
        DiskPathInUseError: another process holds the lock (the message names its pid).
        DiskPathError: the lock file cannot be opened, or it is not a regular file of the daemon's uid
            with no group/other permission.
    """
    path = Path(directory) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, LOCK_FILE_MODE)
    except OSError as e:
        raise DiskPathError(f"--disk-path lock file {path} cannot be opened ({e.strerror or e}); remove it or "
                            f"pass another --disk-path") from None
    try:
        _check_lock_file(fd, path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DiskPathInUseError(in_use_message(directory, _holder(fd))) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def unlock_directory(fd: int) -> None:
    """Release the lock :func:`lock_directory` took (closing its descriptor releases it)."""
    with contextlib.suppress(OSError):
        os.close(fd)


def check_directory_free(directory: str | Path) -> None:
    """Raise :class:`DiskPathInUseError` if another process holds ``directory``'s lock now; a missing
    directory or lock file, or one that cannot be opened, is left to :func:`lock_directory` (it reports it)."""
    try:
        fd = os.open(Path(directory) / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DiskPathInUseError(in_use_message(directory, _holder(fd))) from None
    finally:
        os.close(fd)  # releases the test lock


def in_use_message(directory: str | Path, pid: int | None) -> str:
    who = f"pid {pid}" if pid else "pid unknown"
    return (f"disk path {directory} is in use by another kvtier daemon ({who}); stop it or give another "
            f"--disk-path")


def _holder(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _check_lock_file(fd: int, path: Path) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise DiskPathError(f"--disk-path lock file {path} is not a regular file; remove it")
    if st.st_uid != os.geteuid():
        raise DiskPathError(f"--disk-path lock file {path} is owned by uid {st.st_uid}, not by this daemon's uid "
                            f"{os.geteuid()}; remove it")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise DiskPathError(f"--disk-path lock file {path} is mode {mode:04o}; run chmod 600 {path}")
