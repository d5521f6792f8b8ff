"""Pure-Python stand-in for ``kvtier._streamcopy`` (:mod:`kvtier.native`): the same two calls with
the same checks and errors, through numpy (which releases the GIL for the copy), without streaming
stores. Used where the extension was not built."""

from __future__ import annotations

import numpy as np

STREAMING = 0
"""Streaming stores are never used here."""

STREAM_MIN_BYTES = 64 * 1024
"""As the native module's (copies under it are plain there too)."""


def _bytes(buf: object, writable: bool, what: str) -> np.ndarray:
    """A flat uint8 array over ``buf``'s memory (no copy). TypeError when it is not a
    contiguous buffer (or not writable when ``writable``)."""
    view = memoryview(buf)  # type: ignore[arg-type]
    if not view.c_contiguous:
        raise TypeError(f"{what}: a C-contiguous buffer is needed")
    if writable and view.readonly:
        raise TypeError(f"{what}: a writable buffer is needed")
    return np.frombuffer(view.cast("B") if view.ndim != 1 or view.format != "B" else view, dtype=np.uint8)


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    if a.size == 0 or b.size == 0:
        return False
    pa, pb = a.ctypes.data, b.ctypes.data
    return pa < pb + b.size and pb < pa + a.size


def copy_into(dst: object, offset: int, src: object) -> None:
    """Copy ``src``'s bytes to ``dst[offset:offset + len(src)]``.

    Raises:
        ValueError: they do not fit, or overlap (nothing written).
        TypeError: ``dst`` not a writable contiguous buffer, ``src`` not a contiguous one.
    """
    d = _bytes(dst, True, "copy_into dst")
    s = _bytes(src, False, "copy_into src")
    if offset < 0 or offset > d.size or s.size > d.size - offset:
        raise ValueError(f"copy_into: {s.size} bytes at offset {offset} do not fit a {d.size}-byte buffer")
    target = d[offset:offset + s.size]
    if _overlap(target, s):
        raise ValueError("copy_into needs a source that does not overlap the destination")
    target[...] = s


def replace(dst: object, undo: object, src: object) -> None:
    """Copy ``dst``'s bytes into ``undo`` and ``src``'s into ``dst``.

    Raises:
        ValueError: lengths differ or the buffers overlap (nothing written).
        TypeError: not contiguous buffers, or ``dst``/``undo`` not writable.
    """
    d, u, s = _bytes(dst, True, "replace dst"), _bytes(undo, True, "replace undo"), _bytes(src, False, "replace src")
    if d.size != u.size or d.size != s.size:
        raise ValueError(f"replace needs buffers of one length, got dst {d.size}, undo {u.size}, src {s.size} bytes")
    if _overlap(d, u) or _overlap(d, s) or _overlap(u, s):
        raise ValueError("replace needs three buffers that do not overlap")
    u[...] = d
    d[...] = s
