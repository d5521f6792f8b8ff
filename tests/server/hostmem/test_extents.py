"""The page-run allocator against a page-by-page reference (a list of owners), plus its edge cases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.server.hostmem import ExtentAllocator


def test_best_fit_reuses_the_freed_run_and_merges_neighbours():
    a = ExtentAllocator(16)
    x, y, z = a.alloc(4), a.alloc(4), a.alloc(4)
    assert (x, y, z) == (0, 4, 8)
    a.free(y, 4)
    assert a.alloc(3) == 4  # the 4-page hole fits 3 best (the 4-page tail at 12 too: lower address wins)
    a.free(4, 3)
    a.free(x, 4)
    a.free(z, 4)
    s = a.stats()
    assert (s.used_pages, s.free_runs, s.largest_free_run) == (0, 1, 16)  # merged back into one run


def test_a_request_larger_than_every_free_run_gets_none_and_changes_nothing():
    a = ExtentAllocator(8)
    a.alloc(3)
    b = a.alloc(2)
    a.alloc(3)
    a.free(b, 2)
    before = a.stats()
    assert a.alloc(3) is None
    after = a.stats()
    assert (after.used_pages, after.free_runs, after.failed_allocs) == (before.used_pages, before.free_runs, 1)


def test_double_free_and_bad_sizes_are_refused():
    a = ExtentAllocator(4)
    s = a.alloc(2)
    a.free(s, 2)
    with pytest.raises(ValueError, match="double free"):
        a.free(s, 2)
    with pytest.raises(ValueError):
        a.alloc(0)
    with pytest.raises(ValueError):
        ExtentAllocator(0)


def test_frees_from_finalizers_are_applied_at_the_next_call():
    a = ExtentAllocator(4)
    s = a.alloc(4)
    a.free_later(s, 4)  # what a finalizer does: no lock taken
    assert a.alloc(4) == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9), st.integers(0, 50)), min_size=1, max_size=60))
def test_matches_a_page_by_page_reference(ops):
    """Random allocs and frees: handed-out runs never overlap, lie inside the pages, and a request
    fails only when no run of free pages is that long (checked on a page-by-page model)."""
    pages = 32
    a = ExtentAllocator(pages)
    owner = [None] * pages
    live: list[tuple[int, int]] = []
    for i, (is_alloc, n, pick) in enumerate(ops):
        if is_alloc or not live:
            start = a.alloc(n)
            longest = max((len(r) for r in "".join("." if o is None else "x" for o in owner).split("x")), default=0)
            if start is None:
                assert longest < n
                continue
            assert 0 <= start and start + n <= pages
            assert all(owner[p] is None for p in range(start, start + n))
            for p in range(start, start + n):
                owner[p] = i
            live.append((start, n))
        else:
            start, n = live.pop(pick % len(live))
            (a.free_later if pick % 2 else a.free)(start, n)
            for p in range(start, start + n):
                owner[p] = None
        assert a.stats().used_pages == sum(o is not None for o in owner)
