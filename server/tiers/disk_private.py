"""The disk tier's directory and files belong to the daemon's user alone, whatever the umask.

LMDB's ``data.mdb`` holds every tenant's offloaded and spilled KV bytes in the clear, so a process of
another uid must not be able to read it (the gRPC socket is 0600 for the same reason). With the
default umask 022, ``mkdir`` made the directory 0755 and py-lmdb's default ``mode`` made the files
0644 (issue 23, defect 2). Here:

* :func:`private_dir` (:func:`kvtier.private_writes.private_dirs`): every directory the daemon creates for ``--disk-path`` (the path and any
  missing parents) is made 0700; LMDB creates ``data.mdb``/``lock.mdb`` with :data:`LMDB_FILE_MODE`
  (0600 minus the umask: never looser).
* :func:`check_private`: an existing directory or LMDB file with any group or other bit, owned by
  another uid, or not a plain directory/file, is *refused* with one line that says what to run
  (``chmod 700 DIR``). The daemon never changes the mode of something it did not just create: a
  ``--disk-path`` of ``/tmp``, ``/var`` or a tmpfs mount point would otherwise be chmod'ed under
  every other user of it (a daemon run as root owns them all). This is the ``--auth-tokens`` file's
  rule too (refused unless 0600).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvtier.private_writes import DIR_MODE
from kvtier.private_writes import private_dirs as private_dir  # noqa: F401 - the disk path's 0700 directories
from kvtier.server.tiers.errors import DiskPathError

#: The mode LMDB is asked to create ``data.mdb`` and ``lock.mdb`` with (py-lmdb's ``mode``; its default 0755
#: left them 0644 under umask 022).
LMDB_FILE_MODE = 0o600
LMDB_FILES = ("data.mdb", "lock.mdb")
_WHAT_TO_DO = "pass a --disk-path this user owns (kvtier creates a missing one mode 0700)"


def check_private(directory: str | Path) -> None:
    """Refuse a disk directory (or an LMDB file in it) that another user could read or swap.

    Raises:
        DiskPathError: ``directory`` (the one a symlink names) or its ``data.mdb``/``lock.mdb`` has a
            group or other mode bit, is owned by another uid, or is not a plain directory/file (an
            LMDB file that is a symlink: its bytes could live anywhere); the message names the path,
            its mode and the ``chmod`` to run.
    """
    d = Path(os.path.realpath(directory))  # a symlinked --disk-path is judged by the directory it names
    _check(d, "directory", DIR_MODE)
    for name in LMDB_FILES:
        f = d / name
        if os.path.lexists(f):
            _check(f, "file", LMDB_FILE_MODE)


def _check(p: Path, what: str, mode: int) -> None:
    st = os.lstat(p)
    kind_ok = stat.S_ISDIR(st.st_mode) if what == "directory" else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        raise DiskPathError(f"--disk-path {what} {p} is not a plain {what} (a symlink?); {_WHAT_TO_DO}")
    if st.st_uid != os.geteuid():
        raise DiskPathError(f"--disk-path {what} {p} is owned by uid {st.st_uid}, not by this daemon's uid "
                            f"{os.geteuid()}; {_WHAT_TO_DO}")
    old = stat.S_IMODE(st.st_mode)
    if old & 0o077:
        raise DiskPathError(f"--disk-path {what} {p} is mode {old:04o}: other users could read the KV bytes in it; "
                            f"run chmod {mode:o} {p} (kvtier makes a new --disk-path {DIR_MODE:04o}, its files "
                            f"{LMDB_FILE_MODE:04o})")
