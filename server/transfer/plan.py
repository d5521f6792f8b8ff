"""Transfer planning: from buffer infos and a page mapping to batches of ``(src, dst, nbytes)`` ranges.

The plan is derived from buffer infos alone -- ``(data_ptrs, data_lens, item_lens)`` per component,
one entry a layer -- so it works the same against a kvtier peer and against a peer whose buffers
have SGLang's shapes. For each layer and component, page ``p`` of a buffer is the range
``(ptr + p * item_len, item_len)``; entries with ``item_len == 0`` (skip-topk layers' indexer) are
skipped and cost zero requests. Runs of pages adjacent on both sides are coalesced into one range
(one engine request costs ~50-100 us however small). Batches stay well under the engine's per-peer
queue limit (~2,000 items, DESIGN.md). Every range is checked to lie inside its layer's buffer and,
when the registered ranges are known, inside one registered range -- before anything moves.

Planning decides *what* moves *where*; engines (:mod:`kvtier.server.transfer.engine`) only move it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.server.pool.buffer_info import BufInfos
from kvtier.server.transfer.errors import LayoutMismatchError, PageMappingError
from kvtier.server.transfer.layout import COMPONENTS, PoolLayout, check_compatible
from kvtier.server.transfer.mapping import check_page_mapping, page_runs

DEFAULT_BATCH_ITEMS = 256
MAX_BATCH_ITEMS = 1024  # the engine fails (and poisons the peer) above ~2,000 queued items


@dataclass(frozen=True)
class TransferItem:
    """One contiguous range to copy: ``nbytes`` from ``src_addr`` (peer) to ``dst_addr`` (local).

    Attributes:
        component: ``"latent"`` or ``"index_k"``.
        layer_id: model layer.
        src_page, dst_page: first page of the run on each side.
        num_pages: pages in the run (adjacent on both sides).
        src_addr, dst_addr: addresses of the first byte.
        nbytes: ``num_pages * item_len``.
    """

    component: str
    layer_id: int
    src_page: int
    dst_page: int
    num_pages: int
    src_addr: int
    dst_addr: int
    nbytes: int


@dataclass
class LayerStats:
    """Bytes and requests (engine items) of one layer, per component."""

    layer_id: int
    latent_bytes: int = 0
    index_bytes: int = 0
    latent_requests: int = 0
    index_requests: int = 0


@dataclass
class TransferStats:
    """What a transfer moves (or moved): bytes and requests per component and per layer.

    Attributes:
        num_pages: pages mapped (each moves on every layer with a buffer).
        batches: engine batches (or stream calls) the items ran in.
        layers: ``(num_layers,)`` :class:`LayerStats`, one a layer (zeros on a skip layer's indexer).
    """

    num_pages: int
    batches: int
    layers: list[LayerStats] = field(default_factory=list)

    @property
    def latent_bytes(self) -> int:
        return sum(s.latent_bytes for s in self.layers)

    @property
    def index_bytes(self) -> int:
        return sum(s.index_bytes for s in self.layers)

    @property
    def total_bytes(self) -> int:
        return self.latent_bytes + self.index_bytes

    @property
    def latent_requests(self) -> int:
        return sum(s.latent_requests for s in self.layers)

    @property
    def index_requests(self) -> int:
        return sum(s.index_requests for s in self.layers)

    @property
    def total_requests(self) -> int:
        return self.latent_requests + self.index_requests


@dataclass(frozen=True)
class TransferPlan:
    """Ranges to move, in batches of at most ``max_batch_items`` items.

    Attributes:
        items: every range, layer by layer (latent, then indexer), runs in source page order.
        batches: ``items`` cut into consecutive batches.
        num_layers, num_pages: sizes of the mapping.
        first_layer: model layer id of the first buffer-info entry (a pipeline stage's start layer);
            item layer ids are model layer ids.
    """

    items: tuple[TransferItem, ...]
    batches: tuple[tuple[TransferItem, ...], ...]
    num_layers: int
    num_pages: int
    first_layer: int = 0

    def stats(self) -> TransferStats:
        """Bytes and requests per component and layer this plan moves."""
        layers = [LayerStats(self.first_layer + i) for i in range(self.num_layers)]
        for it in self.items:
            s = layers[it.layer_id - self.first_layer]
            if it.component == "latent":
                s.latent_bytes += it.nbytes
                s.latent_requests += 1
            else:
                s.index_bytes += it.nbytes
                s.index_requests += 1
        return TransferStats(self.num_pages, len(self.batches), layers)


class _Regions:
    """Sorted disjoint ``(ptr, nbytes)`` ranges answering "which one holds [addr, addr + n)"."""

    def __init__(self, ranges: Sequence[tuple[int, int]]) -> None:
        self.ranges = sorted((int(p), int(n)) for p, n in ranges if n > 0)
        self.starts = [p for p, _ in self.ranges]

    def holds(self, addr: int, nbytes: int) -> bool:
        i = bisect.bisect_right(self.starts, addr) - 1
        return i >= 0 and addr + nbytes <= self.ranges[i][0] + self.ranges[i][1]


def _check_infos(name: str, infos: BufInfos, num_layers: int) -> None:
    if any(len(part) != num_layers for part in infos):
        raise LayoutMismatchError(f"{name} buffer infos have {len(infos[0])} layers, expected {num_layers}")


def plan_transfer(
    src: dict[str, BufInfos],
    dst: dict[str, BufInfos],
    src_pages: Any,
    dst_pages: Any,
    *,
    max_batch_items: int = DEFAULT_BATCH_ITEMS,
    src_registered: Sequence[tuple[int, int]] = (),
    dst_registered: Sequence[tuple[int, int]] = (),
    first_layer: int = 0,
) -> TransferPlan:
    """Plan copying pages ``src_pages[i]`` of ``src`` onto pages ``dst_pages[i]`` of ``dst``.

    Args:
        src, dst: ``{"latent": contiguous infos, "index_k": state infos}``, each a
            ``(data_ptrs, data_lens, item_lens)`` triple with one entry a layer.
        src_pages, dst_pages: ``(n,)`` page ids (see :func:`check_page_mapping`).
        max_batch_items: items per batch, 1 .. 1024.
        src_registered, dst_registered: ranges each side's engine registered; when given, every
            range must lie inside one of them.
        first_layer: model layer id of entry 0 (both sides hold the same layers).

    Returns:
        A :class:`TransferPlan`. Entries with ``item_len == 0`` on both sides contribute nothing.

    Raises:
        PageMappingError: a bad mapping, or a page beyond a buffer's end.
        LayoutMismatchError: differing layer counts, an ``item_len`` that differs between the sides
            (or is zero on one side only), or a range outside every registered range.
        ValueError: ``max_batch_items`` out of range.
    """
    if isinstance(max_batch_items, bool) or not isinstance(max_batch_items, int) or not 1 <= max_batch_items <= MAX_BATCH_ITEMS:
        raise ValueError(f"max_batch_items must be an integer in [1, {MAX_BATCH_ITEMS}], got {max_batch_items!r}")
    for side, infos in (("src", src), ("dst", dst)):
        if set(infos) != set(COMPONENTS):
            raise ValueError(f"{side} infos must have exactly the components {COMPONENTS}, got {sorted(infos)}")
    s_pages, d_pages = check_page_mapping(src_pages, dst_pages)
    num_layers = len(dst["latent"][0])
    for side, infos in (("src", src), ("dst", dst)):
        for comp in COMPONENTS:
            _check_infos(f"{side} {comp}", infos[comp], num_layers)
    runs = page_runs(s_pages, d_pages)
    s_max, d_max = int(s_pages.max()), int(d_pages.max())
    src_regions, dst_regions = _Regions(src_registered), _Regions(dst_registered)

    items: list[TransferItem] = []
    for pos in range(num_layers):
        layer = first_layer + pos
        for comp in COMPONENTS:
            s_ptr, s_len, s_item = (part[pos] for part in src[comp])
            d_ptr, d_len, d_item = (part[pos] for part in dst[comp])
            if s_item == 0 and d_item == 0:
                continue  # no buffer on either side (skip-topk layer): zero bytes, zero requests
            if s_item != d_item or s_len == 0 or d_len == 0:
                raise LayoutMismatchError(
                    f"layer {layer} {comp}: item_len {s_item} ({s_len} bytes) on the source vs "
                    f"{d_item} ({d_len} bytes) on the destination"
                )
            for side, top, n_bytes in (("source", s_max, s_len), ("destination", d_max, d_len)):
                if (top + 1) * s_item > n_bytes:
                    raise PageMappingError(
                        f"{side} page {top} lies beyond layer {layer}'s {comp} buffer "
                        f"({n_bytes // s_item} pages of {s_item} bytes)"
                    )
            for sp, dp, n in runs:
                it = TransferItem(comp, layer, sp, dp, n, s_ptr + sp * s_item, d_ptr + dp * d_item, n * s_item)
                if src_regions.ranges and not src_regions.holds(it.src_addr, it.nbytes):
                    raise LayoutMismatchError(f"layer {layer} {comp} source pages {sp}..{sp + n - 1} lie outside every registered range of the peer")
                if dst_regions.ranges and not dst_regions.holds(it.dst_addr, it.nbytes):
                    raise LayoutMismatchError(f"layer {layer} {comp} destination pages {dp}..{dp + n - 1} lie outside every locally registered range")
                items.append(it)
    batches = tuple(tuple(items[i:i + max_batch_items]) for i in range(0, len(items), max_batch_items))
    return TransferPlan(tuple(items), batches, num_layers, int(s_pages.size), first_layer)


def plan_pull(
    local: PoolLayout, remote: PoolLayout, src_pages: Any, dst_pages: Any, *, max_batch_items: int = DEFAULT_BATCH_ITEMS,
) -> TransferPlan:
    """Plan pulling ``remote``'s pages ``src_pages`` onto ``local``'s ``dst_pages``.

    Checks the layouts first (:func:`check_compatible`), then plans from their buffer infos with
    both sides' registered ranges.

    Raises:
        LayoutMismatchError, PageMappingError, ValueError: as :func:`plan_transfer`; nothing moved.
    """
    check_compatible(local, remote)
    return plan_transfer(
        {"latent": remote.latent, "index_k": remote.index},
        {"latent": local.latent, "index_k": local.index},
        src_pages, dst_pages, max_batch_items=max_batch_items,
        src_registered=remote.registered, dst_registered=local.registered,
        first_layer=int(local.fingerprint.get("start_layer", 0)),
    )
