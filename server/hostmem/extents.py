"""Page-granular allocator of runs of pages (extents) inside one arena: pure bookkeeping, no memory.

Best fit (the smallest free run that holds the request, the lowest address among equals), so
same-sized requests reuse the same places and a request that is freed and asked for again gets its
old pages back (already faulted in). Free runs that touch are merged at once, so a full arena that
is emptied is one run again.

Thread safety: one lock, a *leaf* lock in the daemon's order (BRIEF.md, level 6): it is held only for
this bookkeeping; nothing is called, taken or logged while it is held. Frees may come from any
thread at any moment (a finalizer runs wherever the last reference to a block dies, even while that
thread is inside :meth:`ExtentAllocator.alloc`), so :meth:`ExtentAllocator.free_later` only appends to
a deque (atomic, no lock); the pending frees are applied at the start of the next call.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class ExtentStats:
    """Pages of an allocator: total, in use, free, the largest free run, runs handed out so far."""

    pages: int
    used_pages: int
    free_pages: int
    largest_free_run: int
    free_runs: int
    live_extents: int
    allocs: int
    failed_allocs: int


class ExtentAllocator:
    """Hands out runs of ``1 .. pages`` consecutive pages of ``[0, pages)``.

    Args:
        pages: pages it manages.

    Raises:
        ValueError: ``pages`` < 1.
    """

    def __init__(self, pages: int) -> None:
        if isinstance(pages, bool) or not isinstance(pages, int) or pages < 1:
            raise ValueError(f"an extent allocator needs at least one page, got {pages!r}")
        self.pages = pages
        self._lock = threading.Lock()
        self._free_at: dict[int, int] = {0: pages}  # start -> length of each free run
        self._free_end: dict[int, int] = {pages: 0}  # end -> start
        self._by_size: list[tuple[int, int]] = [(pages, 0)]  # (length, start), sorted
        self._live: dict[int, int] = {}  # start -> length of each run handed out
        self._pending: deque[tuple[int, int]] = deque()
        self._allocs = 0
        self._failed = 0

    # ----- internal (lock held) ---------------------------------------------------------------
    def _take_free(self, start: int, length: int) -> None:
        del self._free_at[start]
        del self._free_end[start + length]
        i = bisect.bisect_left(self._by_size, (length, start))
        del self._by_size[i]

    def _put_free(self, start: int, length: int) -> None:
        self._free_at[start] = length
        self._free_end[start + length] = start
        bisect.insort(self._by_size, (length, start))

    def _release(self, start: int, length: int) -> None:
        if self._live.get(start) != length:
            raise ValueError(f"extent ({start}, {length}) was not handed out (double free?)")
        del self._live[start]
        before = self._free_end.get(start)
        if before is not None:  # merge with the free run ending here
            blen = start - before
            self._take_free(before, blen)
            start, length = before, length + blen
        after = self._free_at.get(start + length)
        if after is not None:  # and with the one starting right after
            self._take_free(start + length, after)
            length += after
        self._put_free(start, length)

    def _drain(self) -> None:
        while self._pending:
            self._release(*self._pending.popleft())

    # ----- public -----------------------------------------------------------------------------
    def alloc(self, length: int) -> int | None:
        """The first page of a free run of ``length`` pages, now in use; None when no run is that long.

        Raises:
            ValueError: ``length`` < 1.
        """
        if length < 1:
            raise ValueError(f"an extent holds at least one page, got {length}")
        with self._lock:
            self._drain()
            i = bisect.bisect_left(self._by_size, (length, -1))
            if i == len(self._by_size):
                self._failed += 1
                return None
            size, start = self._by_size[i]
            self._take_free(start, size)
            if size > length:
                self._put_free(start + length, size - length)
            self._live[start] = length
            self._allocs += 1
            return start

    def free(self, start: int, length: int) -> None:
        """Give a run back now (the caller is not inside :meth:`alloc`: e.g. a failed copy).

        Raises:
            ValueError: the run was not handed out by :meth:`alloc` (or was freed already).
        """
        with self._lock:
            self._drain()
            self._release(start, length)

    def free_later(self, start: int, length: int) -> None:
        """Give a run back from anywhere (a finalizer): applied at the start of the next call."""
        self._pending.append((start, length))

    def stats(self) -> ExtentStats:
        """A snapshot (pending frees applied first)."""
        with self._lock:
            self._drain()
            used = sum(self._live.values())
            largest = self._by_size[-1][0] if self._by_size else 0
            return ExtentStats(self.pages, used, self.pages - used, largest, len(self._by_size), len(self._live),
                               self._allocs, self._failed)
