"""A pull whose peer is this daemon: the source pages copied in process, no ReadPages stream.

A PullKV over gRPC from its own daemon used to hold the destination pool exclusive on one worker
thread and wait for its own ReadPages on another; once the other workers queued on that pool's
lock, ReadPages got no thread and the whole daemon stalled (issue 23, defect 3). In process, the
pull never waits for a thread. It also never holds two pool locks at once (the lock order's level 2
is one pool at a time): :meth:`PageSnapshot.take` copies the source pages out under the source
pool's shared lock alone, and :class:`LocalTransport` writes that copy into the destination pages
later, under the destination pool's exclusive lock alone. The cost is one host copy of the pulled
bytes for the length of the call (what a ReadPages stream copies too, a run at a time).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvtier.server.transfer.layout import PoolLayout
from kvtier.server.transfer.pages import layer_bytes, page_run
from kvtier.server.transfer.plan import TransferPlan


class PageSnapshot:
    """A copy of some pages of a pool: every layer's latent bytes and every indexer-owning layer's
    indexer bytes of each page.

    Attributes:
        rows: ``(component, model layer id) -> (len(pages), item_len)`` uint8 CPU tensor, row ``i``
            the bytes of ``pages[i]`` (``item_len``: the layer's bytes a page).
        row_of: page id -> its row.
    """

    def __init__(self, rows: dict[tuple[str, int], torch.Tensor], pages: np.ndarray) -> None:
        self.rows = rows
        self.row_of = {int(p): i for i, p in enumerate(pages.tolist())}

    @classmethod
    def take(cls, pool: Any, pages: np.ndarray) -> PageSnapshot:
        """Copy ``pages`` (int64 page ids, checked by the caller: allocated, in range) of ``pool``.
        The caller holds the pool's lock (shared is enough) for the call.

        Raises:
            MemoryError: no memory for the copy (``len(pages)`` x the pool's bytes a page).
        """
        index = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64))
        start = getattr(pool, "start_layer", 0)
        rows: dict[tuple[str, int], torch.Tensor] = {}
        for pos in range(pool.layer_num):
            comps = ["latent"] if pool.skip_topk_layers[pos] else ["latent", "index_k"]
            for comp in comps:
                flat, item = layer_bytes(pool, comp, start + pos)
                rows[(comp, start + pos)] = flat.view(-1, item).index_select(0, index.to(flat.device)).cpu()
        return cls(rows, pages)


class LocalTransport:
    """:class:`~kvtier.server.transfer.pull.PageTransport` that writes a :class:`PageSnapshot` into
    the destination pool's pages, item by item of the plan (so bytes, requests and batches are the
    plan's, as with the other transports). The caller holds the destination pool exclusive.

    Args:
        dst_pool: the destination pool. snapshot: the source pages, taken before.
    """

    name = "local"

    def __init__(self, dst_pool: Any, snapshot: PageSnapshot) -> None:
        self.dst_pool = dst_pool
        self.snapshot = snapshot

    def pull(self, remote: PoolLayout, plan: TransferPlan) -> None:
        """Copy every item of ``plan`` (``remote`` is the source's layout; unused: the bytes are in
        the snapshot). Raises KeyError only for a plan that names pages or layers the snapshot
        lacks (a bug: the plan and the snapshot come from the same mapping)."""
        for batch in plan.batches:
            for it in batch:
                src = self.snapshot.rows[(it.component, it.layer_id)]
                rows = torch.tensor([self.snapshot.row_of[it.src_page + k] for k in range(it.num_pages)], dtype=torch.int64)
                target = page_run(self.dst_pool, it.component, it.layer_id, it.dst_page, it.num_pages)
                target.copy_(src.index_select(0, rows).view(-1).to(target.device))
