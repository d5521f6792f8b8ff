"""CUDA only (``pytest -m cuda``): page records from a CUDA pool land in pinned host memory and come
back byte-exact. Not run on CPU machines (deselected by default; selected without a GPU they fail)."""

from __future__ import annotations

import pytest
import torch

from kvtier.server.pool import create_pool
from kvtier.server.tiers import HostTier, HostTierConfig, RecordCodec

pytestmark = pytest.mark.cuda


def test_cuda_page_round_trip_through_pinned_host_tier(model):
    pool = create_pool(model, 16 * 64, device="cuda")
    codec = RecordCodec.for_pool(model, pool)
    g = torch.Generator().manual_seed(4)
    slots = torch.arange(3 * 64, 4 * 64)
    for layer in range(4):
        pool.set_kv_buffer(layer, slots, torch.randint(0, 256, (64, 656), dtype=torch.uint8, generator=g))
    for layer in (0, 1, 2):
        pool.set_index_k_scale_buffer(layer, slots, torch.randint(0, 256, (64, 128), dtype=torch.uint8, generator=g),
                                      torch.rand(64, generator=g))
    host = HostTier(HostTierConfig(capacity_bytes=1 << 20, pin_memory=True))
    rec = codec.encode_page(pool, 3, pin_memory=True)
    assert rec.is_pinned()
    host.write([(b"k", rec)])
    with host.borrow([b"k"]) as (got,):
        assert got.is_pinned()
        codec.load_page(pool, got, 9)
    dst = torch.arange(9 * 64, 10 * 64)
    for layer in range(4):
        assert torch.equal(pool.get_kv_buffer_rows(layer, dst).cpu(), pool.get_kv_buffer_rows(layer, slots).cpu())
    for layer in (0, 1, 2):
        assert torch.equal(pool.get_index_k_scale(layer, dst)[0].cpu(), pool.get_index_k_scale(layer, slots)[0].cpu())
