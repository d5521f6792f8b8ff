"""Page-granular token slot allocator.

Hands out whole pages (``page_size`` slots each); page 0 is padding and is never handed out.
Slots of page ``p`` are ``p * page_size .. p * page_size + page_size - 1``; with ``size`` tokens the
pages are ``1 .. size // page_size``, matching a pool of ``size + page_size`` rows.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

from kvtier.server.pool.validation import as_slots


class AllocatorError(ValueError):
    """A free of slots this allocator did not hand out (double free, foreign or padding slots)."""


class PagedTokenAllocator:
    """Allocates token slots in whole pages, lowest page first.

    Args:
        size: token capacity; must be a positive multiple of ``page_size``.
        page_size: tokens per page.

    Raises:
        ValueError: bad sizes.
    """

    def __init__(self, size: int, page_size: int) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or size % page_size:
            raise ValueError(f"size must be a positive multiple of page_size={page_size}, got {size!r}")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self._free: list[int] = list(range(1, self.num_pages + 1))
        self._used: set[int] = set()

    @property
    def free_pages(self) -> int:
        """Pages available to :meth:`alloc`."""
        return len(self._free)

    @property
    def free_tokens(self) -> int:
        """Tokens available (``free_pages * page_size``)."""
        return len(self._free) * self.page_size

    @property
    def used_pages(self) -> int:
        """Pages handed out and not yet freed."""
        return len(self._used)

    def pages_for(self, n_tokens: int) -> int:
        """Pages needed for ``n_tokens`` tokens."""
        return -(-n_tokens // self.page_size)

    def alloc_pages(self, n_pages: int) -> torch.Tensor | None:
        """Allocate ``n_pages`` pages; returns their ids ``(n_pages,)`` int64, or None if too few are free."""
        if isinstance(n_pages, bool) or not isinstance(n_pages, int) or n_pages < 0:
            raise ValueError(f"n_pages must be a non-negative integer, got {n_pages!r}")
        if n_pages > len(self._free):
            return None
        pages = [heapq.heappop(self._free) for _ in range(n_pages)]
        self._used.update(pages)
        return torch.tensor(pages, dtype=torch.int64)

    def alloc(self, n_tokens: int) -> torch.Tensor | None:
        """Allocate whole pages for ``n_tokens`` tokens.

        Returns:
            ``(n_tokens,)`` int64 slots, page-aligned (token ``i`` at offset ``i % page_size`` of
            the ``i // page_size``-th page), or None when too few pages are free. The tail of the last
            page stays reserved for this allocation until it is freed.

        Raises:
            ValueError: ``n_tokens`` not a non-negative integer.
        """
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
            raise ValueError(f"n_tokens must be a non-negative integer, got {n_tokens!r}")
        pages = self.alloc_pages(self.pages_for(n_tokens))
        if pages is None:
            return None
        return slots_of_pages(pages, self.page_size)[:n_tokens]

    def free(self, slots: Any) -> int:
        """Free the pages the given slots touch; returns how many pages were freed.

        Raises:
            AllocatorError: a slot on page 0 (padding), outside the allocator, or on a page that is
                not allocated (double free); nothing is freed then.
            TypeError/ValueError: slots not a 1-D integer sequence.
        """
        t = as_slots(slots, limit=(self.num_pages + 1) * self.page_size, what="slots")
        pages = sorted(set((t // self.page_size).tolist()))
        if 0 in pages:
            raise AllocatorError("slots on page 0 (padding) were never handed out")
        not_used = [p for p in pages if p not in self._used]
        if not_used:
            raise AllocatorError(f"pages {not_used[:8]} are not allocated (double free or foreign slots)")
        return self.free_pages_by_id(pages)

    def free_pages_by_id(self, pages: list[int]) -> int:
        """Free pages by id (all must be allocated; checked first). Returns the count freed."""
        bad = [p for p in pages if p not in self._used]
        if bad or len(set(pages)) != len(pages):
            raise AllocatorError(f"pages {bad[:8] or pages[:8]} are not allocated or repeated")
        for p in pages:
            self._used.remove(p)
            heapq.heappush(self._free, p)
        return len(pages)

    def check_no_leaks(self) -> None:
        """Raise AssertionError naming the pages still allocated, if any."""
        if self._used:
            raise AssertionError(f"{len(self._used)} pages still allocated: {sorted(self._used)[:16]}")


def slots_of_pages(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """All slots of ``pages`` ``(p,)`` in order: ``(p * page_size,)`` int64."""
    return (pages.view(-1, 1) * page_size + torch.arange(page_size, dtype=torch.int64)).view(-1)
