"""Directories and files that only this user may read, whatever the umask.

Everything kvtier writes (the daemon's ready file and disk directory, ``kvtier bench --out``,
``kvtier replay --json`` and ``--plot-dir``) is its user's alone: under the usual umask 022 a plain
``mkdir`` makes 0755 and a plain ``open`` 0644, readable by every local user.

* :func:`private_dirs`: a directory and its missing parents, each made 0700; an existing one is left
  as it is (kvtier never changes the mode of something it did not just create).
* :func:`save_private_figure`: a matplotlib figure through :func:`write_private_file` (``savefig``
  to a path would create it with the umask's mode).
* :func:`write_private_file`: a file written atomically, mode 0600: the bytes go to a temporary file
  of a random name beside it (``mkstemp``: ``O_EXCL|O_NOFOLLOW``, 0600), which is then renamed over
  the path. The random name matters in a shared sticky directory (``/tmp``): a fixed ``FILE.tmp``
  another user created first could neither be written through nor removed (EPERM), so that user could
  stop the write. Only a regular file already at the path is replaced: anything else there (a device
  node such as ``/dev/null``, a FIFO, a socket, a symlink, a directory) is refused with
  :class:`OutputPathError` before anything is written (attack pass 7, A7-6: a ready file over the
  daemon's own socket, or over a device node, replaced it). :func:`check_output_path` makes the same
  check at a command's start, before its work.

Every path kvtier writes a file or makes a directory at passes the rule of its sockets and ready file
first (:func:`kvtier.addresses.check_path_owners`): no directory on the way and no symlink followed
may belong to another user (a sticky directory such as ``/tmp`` is fine; another user's symlink in it
is not), else :class:`OutputPathError` names the path and the owner (attack pass 8, A8-12: ``kvtier
replay --json`` and ``kvtier bench --out`` followed another user's symlink into a root-only directory).
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from kvtier.addresses import UnsafePathError, check_path_owners

DIR_MODE = 0o700
FILE_MODE = 0o600


def check_owners(path: str | Path, what: str = "output file") -> None:
    """Refuse ``path`` if another user controls its way: a directory on it, or a symlink followed,
    not owned by root or this uid (:func:`kvtier.addresses.check_path_owners`, the rule of the
    sockets and the ready file; the entry itself is :func:`check_output_path`'s).

    Raises:
        OutputPathError: ``refusing WHAT PATH: symlink X is owned by uid N, ...`` (one line).
    """
    try:
        check_path_owners(path, what, "file", UnsafePathError, entry_owner=False)
    except UnsafePathError as e:
        raise OutputPathError(str(e)) from None
    except OSError:
        return  # an unreadable path: the write itself says why


def private_dirs(path: str | Path, what: str = "output directory") -> Path:
    """Create ``path`` and its missing parents, each mode 0700 whatever the umask (an existing
    directory is left as it is), once :func:`check_owners` passed (named ``what``).

    Returns:
        The directory, absolute.

    Raises:
        OutputPathError: another user controls the way to ``path``; nothing is made.
        OSError: a directory cannot be created (a file in the way, read-only filesystem, no permission).
    """
    p = Path(os.path.abspath(os.path.expanduser(str(path))))
    check_owners(p, what)
    missing: list[Path] = []
    q = p
    while not os.path.lexists(q) and q != q.parent:
        missing.append(q)
        q = q.parent
    for d in reversed(missing):  # the parents first; each one ours alone from the start
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by someone else: not ours to chmod
        os.chmod(d, DIR_MODE)  # mkdir's mode passes through the umask; chmod does not
    return p


class OutputPathError(OSError):
    """Something other than a regular file is at an output path (one line naming the path and what
    is there)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _what_is(mode: int) -> str:
    for test, words in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "not a regular file"


def check_output_path(path: str | Path, what: str = "output file") -> None:
    """Refuse ``path`` unless nothing is there or a regular file is (the file kvtier would replace).
    A symlink is refused too, whatever it points at: replacing it would silently cut the link, and
    writing through it would write wherever it points; give the file's own path. The way to it must
    pass :func:`check_owners` first.

    Raises:
        OutputPathError: ``WHAT PATH is a character device (a FIFO, a socket, a symlink, a directory),
            not a regular file; ...``, or :func:`check_owners`' refusal.
    """
    check_owners(path, what)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError:
        return  # an unreadable path: the write itself says why
    if not stat.S_ISREG(st.st_mode):
        raise OutputPathError(f"{what} {path} is {_what_is(st.st_mode)}, not a regular file: kvtier writes a new file "
                              f"or replaces a regular one only; remove it or give another path")


def write_private_file(path: str | Path, data: str | bytes, what: str = "output file") -> None:
    """Write ``data`` to ``path`` atomically, mode 0600 whatever the umask: a temporary file of a random
    name in the same directory, then a rename over ``path`` (a regular file there is replaced).
    A failed write leaves no temporary file behind.

    Raises:
        OutputPathError: something other than a regular file is at ``path`` (:func:`check_output_path`,
            named ``what``); nothing is written.
        OSError: the file cannot be written (its directory is missing or not writable, the filesystem
            is full or read-only).
    """
    p = Path(path)
    check_output_path(p, what)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")  # O_EXCL|O_NOFOLLOW, 0600
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), FILE_MODE)
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save_private_figure(fig: Any, path: str | Path, **savefig_kwargs: Any) -> None:
    """Save a matplotlib figure to ``path`` (format from its suffix, default PNG) with
    :func:`write_private_file`: mode 0600, atomically."""
    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix.lstrip(".") or "png", **savefig_kwargs)
    write_private_file(path, buf.getvalue())
