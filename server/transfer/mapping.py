"""Source -> destination page mappings: validation, token slots to pages, runs of adjacent pages.

DSA indexer data is paged (one 8448-byte row holds 64 tokens' keys and scales), so PD transfer moves
whole pages, latent and indexer alike. A token-slot mapping is accepted only when it is
page-aligned: the slots come in groups of ``page_size`` (the last group may be shorter), each group
the slots ``p * page_size + 0 .. k - 1`` of one source page ``p`` and ``q * page_size + 0 .. k - 1``
of one destination page ``q``. Such a mapping is exactly what a page allocator hands out; the
whole page moves (a short last group moves its page's tail too, bytes the destination never reads
because the page belongs to the same allocation). Anything else (e.g. token 3 of page 5 to token 7
of page 9) is refused with :class:`PageMappingError`: splicing single tokens into another page would
need a read-modify-write of the destination's indexer rows, which a one-sided read cannot do.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.server.transfer.errors import PageMappingError


def _as_ids(x: Any, what: str) -> np.ndarray:
    try:
        arr = np.asarray(x.cpu() if hasattr(x, "cpu") else x)
    except (TypeError, ValueError) as e:
        raise PageMappingError(f"{what} must be a 1-D sequence of integers: {e}") from None
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise PageMappingError(f"{what} must be a 1-D sequence of integers, got dtype {arr.dtype} shape {arr.shape}")
    arr = arr.astype(np.int64)
    if int(arr.min()) < 0:
        raise PageMappingError(f"{what} contains negative id {int(arr.min())}")
    return arr


def check_page_mapping(src_pages: Any, dst_pages: Any) -> tuple[np.ndarray, np.ndarray]:
    """Validate a page mapping ``src_pages[i] -> dst_pages[i]``.

    Args:
        src_pages, dst_pages: ``(n,)`` integer page ids (lists, numpy arrays or tensors).

    Returns:
        ``(src (n,), dst (n,))`` int64 numpy arrays.

    Raises:
        PageMappingError: unequal lengths, an empty mapping, page 0 (padding, never handed out) on
            either side, or a destination page named twice.
    """
    src, dst = _as_ids(src_pages, "src_pages"), _as_ids(dst_pages, "dst_pages")
    if src.size != dst.size:
        raise PageMappingError(f"src_pages has {src.size} pages but dst_pages has {dst.size}")
    if src.size == 0:
        raise PageMappingError("the page mapping is empty")
    for what, arr in (("src_pages", src), ("dst_pages", dst)):
        if (arr == 0).any():
            raise PageMappingError(f"{what} contains page 0, the padding page, which is never handed out")
    if np.unique(dst).size != dst.size:
        raise PageMappingError("dst_pages names a destination page twice")
    return src, dst


def pages_from_slots(src_slots: Any, dst_slots: Any, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Turn a page-aligned token-slot mapping into a page mapping (see the module docstring).

    Args:
        src_slots, dst_slots: ``(n,)`` integer token slots, ``src_slots[i] -> dst_slots[i]``.
        page_size: tokens per page.

    Returns:
        ``(src_pages (ceil(n / page_size),), dst_pages (...))`` int64, validated by :func:`check_page_mapping`.

    Raises:
        PageMappingError: unequal lengths, or a group of ``page_size`` slots that is not the start of
            one page on either side (the message names the first bad token).
    """
    src, dst = _as_ids(src_slots, "src_slots"), _as_ids(dst_slots, "dst_slots")
    if src.size != dst.size:
        raise PageMappingError(f"src_slots has {src.size} slots but dst_slots has {dst.size}")
    if src.size == 0:
        raise PageMappingError("the slot mapping is empty")
    n = src.size
    expected_offset = np.arange(n, dtype=np.int64) % page_size
    first = np.arange(n, dtype=np.int64) // page_size * page_size  # index of each token's group start
    for what, slots in (("src_slots", src), ("dst_slots", dst)):
        page_of_group = slots[first] // page_size
        bad = np.nonzero((slots % page_size != expected_offset) | (slots // page_size != page_of_group))[0]
        if bad.size:
            i = int(bad[0])
            raise PageMappingError(
                f"{what} is not page-aligned: token {i} is slot {int(slots[i])} (page {int(slots[i]) // page_size}, "
                f"offset {int(slots[i]) % page_size}) but PD transfer moves whole pages of {page_size} tokens, "
                f"so it must be offset {i % page_size} of page {int(page_of_group[i])}"
            )
    starts = np.arange(0, n, page_size)
    return check_page_mapping(src[starts] // page_size, dst[starts] // page_size)


def page_runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of pages adjacent on both sides: ``[(src_start, dst_start, num_pages), ...]``.

    The mapping is taken in source order, so runs do not depend on the order pages were listed;
    consecutive pairs join a run when ``src`` and ``dst`` both advance by exactly one page.
    """
    order = np.argsort(src, kind="stable")
    s, d = src[order], dst[order]
    if s.size == 0:
        return []
    breaks = np.nonzero((np.diff(s) != 1) | (np.diff(d) != 1))[0] + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [s.size]))
    return [(int(s[a]), int(d[a]), int(b - a)) for a, b in zip(starts, ends)]
