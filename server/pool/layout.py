"""A pool's geometry and the place of each per-layer view, as plain data (JSON-ready).

Local attach sends these to a worker, which builds kvtier's own :class:`DSATokenToKVPool` over its
mapping of the daemon's arenas (:func:`pool_from_geometry`) and checks that every view lands where
the daemon's does (:func:`pool_views` on both sides must be equal): one implementation, the same
bytes through the same views.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvtier.server.pool.dsa import DSATokenToKVPool

GEOMETRY_KEYS = ("size", "page_size", "kv_lora_rank", "qk_rope_head_dim", "layer_num", "kv_cache_dtype",
                 "index_head_dim", "index_buf_size", "skip_topk_layers", "start_layer")


def pool_geometry(pool: DSATokenToKVPool) -> dict[str, Any]:
    """The constructor arguments that rebuild ``pool``'s layout (:data:`GEOMETRY_KEYS`)."""
    return {"size": pool.size, "page_size": pool.page_size, "kv_lora_rank": pool.kv_lora_rank,
            "qk_rope_head_dim": pool.qk_rope_head_dim, "layer_num": pool.layer_num,
            "kv_cache_dtype": pool.kv_cache_dtype, "index_head_dim": pool.index_head_dim,
            "index_buf_size": pool.index_buf_size, "skip_topk_layers": [bool(s) for s in pool.skip_topk_layers],
            "start_layer": pool.start_layer}


def _view(t: torch.Tensor, base: torch.Tensor) -> list[Any]:
    return [t.data_ptr() - base.data_ptr() if t.numel() else 0, list(t.shape), str(t.dtype).removeprefix("torch.")]


def pool_views(pool: DSATokenToKVPool) -> dict[str, list[list[Any]]]:
    """Each per-layer buffer as ``[byte offset in its arena, shape, dtype]``: ``kv_buffer`` (in the
    ``latent`` arena) and ``index_k_with_scale_buffer`` (in the ``index_k`` arena; skip layers
    ``[0, [0, cols], "uint8"]``)."""
    lat, idx = pool.arena("latent"), pool.arena("index_k")
    return {"kv_buffer": [_view(b, lat) for b in pool.kv_buffer],
            "index_k_with_scale_buffer": [_view(b, idx) for b in pool.index_k_with_scale_buffer]}


def pool_from_geometry(geometry: Mapping[str, Any], *, device: str | torch.device,
                       arenas: Mapping[str, torch.Tensor]) -> DSATokenToKVPool:
    """A :class:`DSATokenToKVPool` of ``geometry`` (:func:`pool_geometry`) over existing ``arenas``.

    Raises:
        ValueError/TypeError: a geometry with missing or extra keys, bad values, or arenas that do not fit.
    """
    if not isinstance(geometry, Mapping) or set(geometry) != set(GEOMETRY_KEYS):
        got = sorted(geometry) if isinstance(geometry, Mapping) else type(geometry).__name__
        raise ValueError(f"a pool geometry has the keys {list(GEOMETRY_KEYS)}, got {got}")
    g = dict(geometry)
    skip = g.pop("skip_topk_layers")
    if not isinstance(skip, list) or not all(isinstance(s, bool) for s in skip):
        raise ValueError("skip_topk_layers must be a list of booleans")
    return DSATokenToKVPool(g.pop("size"), g.pop("page_size"), g.pop("kv_lora_rank"), g.pop("qk_rope_head_dim"),
                            g.pop("layer_num"), device, g.pop("kv_cache_dtype"), g.pop("index_head_dim"),
                            g.pop("index_buf_size"), skip, start_layer=g.pop("start_layer"), arenas=arenas)
