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
  stop the write.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path
from typing import Any

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dirs(path: str | Path) -> Path:
    """Create ``path`` and its missing parents, each mode 0700 whatever the umask (an existing
    directory is left as it is).

    Returns:
        The directory, absolute.

    Raises:
        OSError: a directory cannot be created (a file in the way, read-only filesystem, no permission).
    """
    p = Path(os.path.abspath(os.path.expanduser(str(path))))
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


def write_private_file(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` atomically, mode 0600 whatever the umask: a temporary file of a random
    name in the same directory, then a rename over ``path`` (an existing file or symlink there is
    replaced, never written through). A failed write leaves no temporary file behind.

    Raises:
        OSError: the file cannot be written (its directory is missing or not writable, ``path`` is a
            directory, the filesystem is full or read-only).
    """
    p = Path(path)
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
