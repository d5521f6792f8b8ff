"""Byte views of a pool's pages by (component, layer, page), for transports without an engine.

The gRPC fallback reads page runs out of the source pool and writes them into the destination pool;
both go through these views of the per-layer buffers (the same bytes the buffer infos describe).
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.server.transfer.errors import PageMappingError


def layer_bytes(pool: Any, component: str, layer_id: int) -> tuple[torch.Tensor, int]:
    """A flat uint8 view of model layer ``layer_id``'s buffer and its ``item_len`` (bytes a page).

    Raises:
        PageMappingError: unknown component or layer, or a layer without a buffer (skip layer).
    """
    start = getattr(pool, "start_layer", 0)
    if not start <= layer_id < start + pool.layer_num:
        raise PageMappingError(f"layer {layer_id} outside the pool's layers [{start}, {start + pool.layer_num})")
    pos = layer_id - start
    if component == "latent":
        return pool.kv_buffer[pos].view(torch.uint8).view(-1), pool.row_bytes * pool.page_size
    if component == "index_k":
        if pool.skip_topk_layers[pos]:
            raise PageMappingError(f"layer {layer_id} skips top-k and has no indexer buffer")
        return pool.index_k_with_scale_buffer[pos].view(-1), pool.index_page_bytes
    raise PageMappingError(f"component must be 'latent' or 'index_k', got {component!r}")


def page_run(pool: Any, component: str, layer_id: int, first_page: int, num_pages: int) -> torch.Tensor:
    """The bytes of pages ``first_page .. first_page + num_pages - 1``: a ``(num_pages * item_len,)`` uint8 view.

    Raises:
        PageMappingError: pages outside the buffer (or page 0, the padding page), or a bad layer/component.
    """
    flat, item = layer_bytes(pool, component, layer_id)
    pages = flat.numel() // item
    if num_pages <= 0 or first_page < 1 or first_page + num_pages > pages:
        raise PageMappingError(
            f"pages {first_page}..{first_page + num_pages - 1} outside layer {layer_id}'s {component} buffer "
            f"(pages 1..{pages - 1})"
        )
    return flat[first_page * item:(first_page + num_pages) * item]
