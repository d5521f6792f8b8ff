"""A real small filesystem for disk-full tests: a tmpfs of a few MiB (tests run as root).

``small_tmpfs(dir)`` mounts one and unmounts it in ``finally``; where mounting is not allowed it
yields False and the caller exercises the same path with the injected I/O fault instead
(``KVTIER_DISK_FAULT_FILE``), so the path is tested either way.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def small_tmpfs(path: Path, size: str = "4m", *, options: str = "") -> Iterator[bool]:
    """Mount a tmpfs of ``size`` at ``path`` (created); yields True if mounted, False if not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (f",{options}" if options else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def free_bytes(path: Path) -> int:
    """Bytes still free on ``path``'s filesystem."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def write_ballast(path: Path, leave_free: int) -> int:
    """Fill ``path``'s filesystem with one file until about ``leave_free`` bytes remain; returns its size."""
    n = max(free_bytes(path.parent) - leave_free, 0)
    with open(path, "wb") as f:
        f.write(b"\0" * n)
    return n
