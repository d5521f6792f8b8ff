"""Page allocator: whole pages, page 0 never handed out, double frees and foreign slots refused."""

from __future__ import annotations

import pytest
import torch

from kvtier.server.pool import AllocatorError, PagedTokenAllocator, slots_of_pages


def test_alloc_hands_out_whole_pages_never_page_zero():
    alloc = PagedTokenAllocator(64 * 4, 64)
    assert (alloc.free_pages, alloc.free_tokens, alloc.used_pages) == (4, 256, 0)
    a = alloc.alloc(100)
    assert a.dtype == torch.int64 and a.tolist() == list(range(64, 164))
    assert (alloc.free_pages, alloc.free_tokens, alloc.used_pages) == (2, 128, 2)
    b = alloc.alloc(1)
    assert b.tolist() == [192]
    assert alloc.free_pages == 1
    everything = torch.cat([a, b, alloc.alloc(64)])
    assert int(everything.min()) >= 64  # nothing on page 0
    assert alloc.free_pages == 0 and alloc.alloc(1) is None
    assert alloc.alloc(0).numel() == 0


def test_alloc_returns_none_when_too_few_pages_and_changes_nothing():
    alloc = PagedTokenAllocator(64 * 3, 64)
    alloc.alloc(64)
    assert alloc.alloc(129) is None
    assert alloc.free_pages == 2
    assert alloc.alloc(128).tolist() == list(range(128, 256))


def test_free_returns_pages_and_they_are_reused_lowest_first():
    alloc = PagedTokenAllocator(64 * 4, 64)
    a, b = alloc.alloc(64), alloc.alloc(65)
    assert alloc.free(a) == 1
    assert alloc.free_pages == 2
    assert alloc.alloc(10).tolist() == list(range(64, 74))
    assert alloc.free(b[:1]) == 1  # any slot of a page frees the whole page
    assert alloc.free(b[64:]) == 1
    assert alloc.free_pages == 3


def test_double_free_raises_and_changes_nothing():
    alloc = PagedTokenAllocator(64 * 4, 64)
    a, b = alloc.alloc(64), alloc.alloc(64)
    alloc.free(a)
    with pytest.raises(AllocatorError, match="not allocated"):
        alloc.free(torch.cat([b, a]))  # b is fine, a is a double free: neither is freed
    assert alloc.used_pages == 1 and alloc.free_pages == 3
    alloc.free(b)
    alloc.check_no_leaks()


@pytest.mark.parametrize("slots, match", [([5], "page 0"), ([64 * 5], "outside"), ([-1], "negative"), ([200], "not allocated")])
def test_foreign_slots_raise_and_change_nothing(slots, match):
    alloc = PagedTokenAllocator(64 * 4, 64)
    a = alloc.alloc(64)
    with pytest.raises(ValueError, match=match):
        alloc.free(slots + a.tolist())
    assert alloc.used_pages == 1 and alloc.free_pages == 3
    assert isinstance(AllocatorError("x"), ValueError)


def test_leak_check_names_the_pages_still_allocated():
    alloc = PagedTokenAllocator(64 * 4, 64)
    alloc.alloc(64)
    b = alloc.alloc(64)
    alloc.free(b)
    with pytest.raises(AssertionError, match=r"1 pages still allocated: \[1\]"):
        alloc.check_no_leaks()


def test_bad_sizes_and_counts():
    with pytest.raises(ValueError, match="size"):
        PagedTokenAllocator(100, 64)
    with pytest.raises(ValueError, match="page_size"):
        PagedTokenAllocator(128, 0)
    alloc = PagedTokenAllocator(128, 64)
    with pytest.raises(ValueError, match="n_tokens"):
        alloc.alloc(-1)
    with pytest.raises(TypeError):
        alloc.free([1.5])


def test_slots_of_pages():
    assert slots_of_pages(torch.tensor([3, 1]), 4).tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
