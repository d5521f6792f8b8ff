"""Registered host staging memory for tiers that move bytes with a transfer engine (the Mooncake tier).

A distributed store reads and writes only memory registered with its client, and registering costs
(with RDMA it pins pages), so a tier registers one host region once and stages every batch in it.
Where the region comes from is swappable: a :data:`HostBufferSource` hands out a 1-D uint8 host tensor
that lives as long as the tier (the default allocates a plain one; a shared host arena can hand out
a slice of itself, and records already inside the region need no staging copy, see
:meth:`StagingArea.offset_of`).

:class:`StagingArea` carves the region into extents for batches: ``allocate(nbytes)`` returns an
extent or waits until one is free; every extent is 64-byte aligned (records view their payload as
int64 words). An allocation is all-or-nothing, so two threads can never deadlock holding halves.

Lock order: the area's condition lock is a tier-level lock (after the pool, cache and store locks);
nothing else is taken, and no store call is made, while it is held.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

ALIGN = 64

#: ``source(nbytes) -> (nbytes,) uint8 host tensor`` kept alive by the caller for as long as it is used.
HostBufferSource = Callable[[int], torch.Tensor]


def plain_host_buffer(nbytes: int) -> torch.Tensor:
    """The default :data:`HostBufferSource`: a fresh host tensor, touched once so its pages exist before
    it is registered (registration of never-touched pages would fault them in on the data path)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.zero_()
    return buf


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


class StagingTimeout(Exception):
    """No extent of the size asked for became free in time."""


@dataclass(frozen=True)
class Extent:
    """``nbytes`` bytes of the area from ``offset``; ``view`` is that range of the region."""

    offset: int
    nbytes: int
    view: torch.Tensor
    ptr: int


class StagingArea:
    """A registered host region, handed out as extents for batches.

    Args:
        nbytes: size of the region (a multiple of 64, at least 64).
        source: where the region's memory comes from (default :func:`plain_host_buffer`).

    Raises:
        ValueError: a bad size, or a source that returned something else than a contiguous 1-D
            uint8 host tensor of at least ``nbytes``.
    """

    def __init__(self, nbytes: int, source: HostBufferSource | None = None) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < ALIGN or nbytes % ALIGN:
            raise ValueError(f"staging bytes must be a positive multiple of {ALIGN}, got {nbytes!r}")
        region = (source or plain_host_buffer)(nbytes)
        if not isinstance(region, torch.Tensor) or region.dtype != torch.uint8 or region.dim() != 1 \
                or region.device.type != "cpu" or not region.is_contiguous() or region.numel() < nbytes:
            raise ValueError("a staging source must return a contiguous 1-D uint8 host tensor of the size asked for")
        self.region = region[:nbytes]
        self.nbytes = nbytes
        self.ptr = int(self.region.data_ptr())
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, length), sorted, coalesced
        self._cond = threading.Condition(threading.Lock())

    @property
    def free_bytes(self) -> int:
        """Bytes not handed out (a plain read, for stats)."""
        return sum(n for _, n in self._free)

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Offset of ``t``'s bytes inside the region, or None if they lie (partly) outside it (then they
        must be staged before the store can move them)."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        start = int(t.data_ptr()) - self.ptr
        end = start + t.numel() * t.element_size()
        return start if 0 <= start and end <= self.nbytes else None

    def _take(self, n: int) -> int | None:
        for i, (off, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (off + n, length - n)
                return off
        return None

    def allocate(self, nbytes: int, timeout_s: float = 30.0) -> Extent:
        """An extent of at least ``nbytes`` (rounded up to 64), waiting up to ``timeout_s`` for room.

        Raises:
            ValueError: ``nbytes`` is not positive or exceeds the whole area.
            StagingTimeout: no room came free in time.
        """
        n = aligned(nbytes)
        if n <= 0 or n > self.nbytes:
            raise ValueError(f"a staging extent of {nbytes} bytes does not fit the {self.nbytes}-byte area")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (off := self._take(n)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingTimeout(f"no {n}-byte staging extent came free within {timeout_s:.1f} s")
                self._cond.wait(left)
        return Extent(off, n, self.region[off:off + n], self.ptr + off)

    def release(self, extent: Extent) -> None:
        """Give an extent back (coalescing with its free neighbours) and wake waiters."""
        with self._cond:
            free = self._free
            free.append((extent.offset, extent.nbytes))
            free.sort()
            merged: list[tuple[int, int]] = []
            for off, length in free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((off, length))
            self._free = merged
            self._cond.notify_all()

    @contextmanager
    def extent(self, nbytes: int, timeout_s: float = 30.0) -> Iterator[Extent]:
        """:meth:`allocate` for the ``with`` block; released on every exit path."""
        ext = self.allocate(nbytes, timeout_s)
        try:
            yield ext
        finally:
            self.release(ext)
