"""PD transfer, the source side: the checks of a pull's source pages, and ReadPages (no grpc here).

A pull reads the source pages' write generations with the layout (:meth:`PoolEntry.generations`)
and names them in every ReadPages (:class:`Expected`); each page run is copied under the pool's
shared lock only while its pages are allocated, not being written and still of those generations,
and streamed without the lock. So every page goes out whole, as it was when the layout answered, or
the stream ends :class:`~kvtier.server.transfer.PageChanged` (module ``server/daemon/transfer.py``,
"Whole pages").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from kvtier.server.daemon.errors import InvalidArgument, NotFound
from kvtier.server.daemon.pools import PoolEntry, PoolRegistry
from kvtier.server.daemon.tenants import Caller
from kvtier.server.transfer import PageChanged, PageMappingError
from kvtier.server.transfer.pages import page_run


def check_allocated(entry: PoolEntry, pages: np.ndarray, what: str) -> None:
    """Raise InvalidArgument unless ``pages`` (int64 ids) are in range and allocated in ``entry``;
    Busy if a WriteKV is landing on one. Caller holds the pool's lock."""
    limit = entry.page_allocated.numel()
    if pages.size and int(pages.min()) < 0:
        raise InvalidArgument(f"{what} contains negative page {int(pages.min())}")
    if pages.size and int(pages.max()) >= limit:
        raise InvalidArgument(f"{what} contains page {int(pages.max())} outside pool {entry.pool_id!r} (pages 1..{limit - 1})")
    bad = pages[~entry.page_allocated[torch.from_numpy(pages)].numpy()]
    if bad.size:
        raise InvalidArgument(f"{what} contains page {int(bad[0])}, which is not allocated in pool {entry.pool_id!r}")
    entry.check_unclaimed(torch.from_numpy(pages), what)  # a write in place is landing there: Busy


class Expected:
    """Source pages and the write generations a layout answer gave them (sorted by page id)."""

    def __init__(self, ids: np.ndarray, gens: np.ndarray) -> None:
        self.ids, self.gens = ids, gens

    @classmethod
    def from_request(cls, pages: Sequence[int], generations: Sequence[int]) -> Expected | None:
        """ReadPages' ``expect_pages`` / ``expect_generations`` (None: none given).

        Raises:
            InvalidArgument: lists of different lengths.
        """
        if len(pages) != len(generations):
            raise InvalidArgument(f"expect_pages has {len(pages)} pages but expect_generations has "
                                  f"{len(generations)} generations")
        if not len(pages):
            return None
        ids = np.asarray(list(pages), dtype=np.int64)
        gens = np.asarray(list(generations), dtype=np.uint64).astype(np.int64)
        order = np.argsort(ids, kind="stable")
        return cls(ids[order], gens[order])

    def check(self, entry: PoolEntry, pages: np.ndarray, what: str) -> None:
        """Raise :class:`PageChanged` if any of ``pages`` (in range) changed since its generation was
        read: its content stamp grew past it (:meth:`PoolEntry.generations`; a claim given back since
        does not count, it restored the rows, and a page claimed now is refused Busy by
        :func:`check_allocated`). InvalidArgument for a page without a generation here. Caller holds
        the pool's lock (shared is enough)."""
        at = np.minimum(np.searchsorted(self.ids, pages), self.ids.size - 1)
        missing = self.ids[at] != pages
        if bool(missing.any()):
            raise InvalidArgument(f"{what} names page {int(pages[missing][0])} without its generation (expect_pages)")
        bad = entry.page_gen.numpy()[pages] > self.gens[at]
        if bool(bad.any()):
            raise PageChanged(f"{what}: source page {int(pages[bad][0])} of pool {entry.pool_id!r} changed (written, "
                              f"freed or allocated again) since the pull read its generation; a page is never sent "
                              f"with layers of two writes: keep the source pages allocated and unchanged until the "
                              f"pull returns, then pull again")


def read_pages(pools: PoolRegistry, caller: Caller, pool_id: str, runs: Sequence[tuple[int, str, int, int]],
               chunk: int, expect: Expected | None = None) -> Iterator[tuple[int, int, bytes]]:
    """ReadPages: ``(run index, offset, data)`` chunks (at most ``chunk`` bytes) of each
    ``(layer, component, first_page, num_pages)`` run of ``caller``'s pool ``pool_id``.

    Every run is checked (layer, component, page range, pages allocated) before the first chunk,
    and its pages again when it is copied (under the shared lock it is copied under). With
    ``expect``, every page of every run must be among its pages and is copied only while it still
    has its generation (checked under the same lock).

    Raises:
        InvalidArgument/PageMappingError: a bad run or expectation, or a run's pages freed meanwhile
            (without expectations).
        PageChanged: with expectations, a page changed since its generation was read (ABORTED).
        Busy: a run's pages are being written by a WriteKV still arriving (before or mid-stream).
        NotFound: the pool was deleted (or made again) mid-stream.
    """
    if not runs:
        raise PageMappingError("ReadPages needs at least one page run")

    def check(entry: PoolEntry, layer: int, comp: str, first: int, n: int) -> None:
        pages = np.arange(first, first + n, dtype=np.int64)
        if expect is not None:
            expect.check(entry, pages, f"run of layer {layer} {comp}")
        check_allocated(entry, pages, f"run of layer {layer} {comp}")

    with pools.locked(caller, pool_id, exclusive=False) as checked:
        for layer, comp, first, n in runs:
            page_run(checked.pool, comp, layer, first, n)
            check(checked, layer, comp, first, n)
    return _stream(pools, caller, pool_id, runs, chunk, checked, check)


def _stream(pools: PoolRegistry, caller: Caller, pool_id: str, runs: Sequence[tuple[int, str, int, int]], chunk: int,
            checked: PoolEntry, check: Callable[[PoolEntry, int, str, int, int], None]) -> Iterator[tuple[int, int, bytes]]:
    for i, (layer, comp, first, n) in enumerate(runs):
        with pools.locked(caller, pool_id, exclusive=False) as entry:  # a consistent copy of the run...
            if entry is not checked:
                raise NotFound(f"pool {pool_id!r} was deleted and made again while ReadPages streamed it; pull again")
            # checked again: the lock was let go since the first check (a WriteKV may have claimed the
            # pages and be landing rows in place, or written them, or the pages may have been freed)
            check(entry, layer, comp, first, n)
            view = page_run(entry.pool, comp, layer, first, n)
            pieces = [view[off:off + chunk].cpu().numpy().tobytes() for off in range(0, view.numel(), chunk)]
        for k, data in enumerate(pieces):  # ...streamed without holding the lock
            yield i, k * chunk, data
