"""Building a pool from a model config and a role."""

from __future__ import annotations

from typing import Literal

import torch

from kvtier.server.hostmem import HostArena
from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool.dsa import DSATokenToKVPool

PoolRole = Literal["target", "draft", "hisparse"]
POOL_ROLES: tuple[str, ...] = ("target", "draft", "hisparse")


def skip_mask_for_role(model: DSAModelConfig, role: str) -> tuple[bool, ...]:
    """The skip mask a pool of ``role`` uses: the model's for ``target``; none for ``draft``
    (speculative) and ``hisparse`` pools, which keep an indexer buffer on every layer.

    Raises:
        ValueError: unknown role.
    """
    if role == "target":
        return model.skip_topk_layers
    if role in ("draft", "hisparse"):
        return (False,) * model.num_layers
    raise ValueError(f"role must be one of {POOL_ROLES}, got {role!r}")


def create_pool(
    model: DSAModelConfig,
    size: int,
    *,
    role: str = "target",
    device: str | torch.device = "auto",
    index_buf_size: int | None = None,
    shared: bool = False,
    host_arena: HostArena | None = None,
) -> DSATokenToKVPool:
    """A :class:`DSATokenToKVPool` of ``size`` tokens with ``model`'s geometry, layer range
    (``model.start_layer``, ``model.num_layers``) and ``role`'s skip mask (``host_arena``: where its
    host copies live; see :class:`MLATokenToKVPool`).

    Raises:
        ValueError: unknown role, bad size or device.
    """
    return DSATokenToKVPool(
        size=size,
        page_size=model.page_size,
        kv_lora_rank=model.kv_lora_rank,
        qk_rope_head_dim=model.qk_rope_head_dim,
        layer_num=model.num_layers,
        device=device,
        kv_cache_dtype=model.kv_cache_dtype,
        index_head_dim=model.index_head_dim,
        index_buf_size=index_buf_size,
        skip_topk_layers=skip_mask_for_role(model, role),
        shared=shared,
        start_layer=model.start_layer,
        host_arena=host_arena,
    )
