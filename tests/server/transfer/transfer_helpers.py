"""Helpers for the transfer tests: small GLM-5.2-shaped pools (8 layers, 4 skip) with random bytes."""

from __future__ import annotations

import torch

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import create_pool

# GLM-5.2 (index_topk_freq=4, offset=3) cut to 8 layers: full 0, 1, 2, 6; skip 3, 4, 5, 7.
LIVE_LAYERS = (0, 1, 2, 6)
SKIP_LAYERS = (3, 4, 5, 7)
INDEX_PAGE_BYTES = 8448
LATENT_PAGE_BYTES = 656 * 64


def filled_pool(model: DSAModelConfig, size: int = 64 * 32, role: str = "target", seed: int = 0):
    """A CPU pool whose latent and indexer bytes are random (padding page included)."""
    pool = create_pool(model, size, role=role, device="cpu")
    g = torch.Generator().manual_seed(seed)
    for buf in pool.kv_buffer:
        buf.view(torch.uint8).view(-1).copy_(torch.randint(0, 256, (buf.nbytes,), dtype=torch.uint8, generator=g))
    for layer in pool.live_layers:
        buf = pool.index_k_with_scale_buffer[layer]
        buf.view(-1).copy_(torch.randint(0, 256, (buf.nbytes,), dtype=torch.uint8, generator=g))
    return pool
