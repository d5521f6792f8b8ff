"""CUDA only (``pytest -m cuda``): pages of a CUDA pool published to a real Mooncake Store (records
encoded from the device straight into the tier's registered staging memory) and loaded byte-exact
into another CUDA pool by a second client. Deselected by default; selected without a GPU it fails."""

from __future__ import annotations

import pytest
import torch

from kvtier.server.pool import PagedTokenAllocator, create_pool
from kvtier.server.tiers import PrefixCache, RecordCodec, TierStack
from kvtier.server.tiers.mooncake_store import MooncakeStoreTier

from test_mooncake_store import tier_config
from tierkit import keys_for

pytestmark = pytest.mark.cuda


def test_cuda_pages_through_the_store(model, mooncake_master):
    a_tier, b_tier = MooncakeStoreTier(tier_config(mooncake_master)), None
    a_tier.open()
    b_tier = MooncakeStoreTier(tier_config(mooncake_master, key_prefix=a_tier.config.key_prefix))
    b_tier.open()
    try:
        ns = b"p:" + bytes.fromhex(model.fingerprint_digest())
        pool_a, pool_b = (create_pool(model, 16 * 64, device="cuda") for _ in range(2))
        a = PrefixCache(TierStack([a_tier]), PagedTokenAllocator(pool_a.size, 64), RecordCodec.for_pool(model, pool_a),
                        pool=pool_a, namespace=ns)
        b = PrefixCache(TierStack([b_tier]), PagedTokenAllocator(pool_b.size, 64), RecordCodec.for_pool(model, pool_b),
                        pool=pool_b, namespace=ns)
        keys = keys_for(2, seed=21)
        ld = a.load(keys)
        g = torch.Generator().manual_seed(21)
        lat = {l: torch.randint(0, 256, (128, 656), dtype=torch.uint8, generator=g) for l in range(4)}
        idx = {l: (torch.randint(0, 256, (128, 128), dtype=torch.uint8, generator=g), torch.rand(128, generator=g))
               for l in (0, 1, 2)}
        for l, rows in lat.items():
            pool_a.set_kv_buffer(l, ld.slots, rows.cuda())
        for l, (k, s) in idx.items():
            pool_a.set_index_k_scale_buffer(l, ld.slots, k.cuda(), s.cuda())
        a.store(ld.lease, keys, ld.slots)
        a.release(ld.lease)
        got = b.load(keys)
        assert got.tiers == ["mooncake"] * 2
        for l, rows in lat.items():
            assert torch.equal(pool_b.get_kv_buffer_rows(l, got.slots).cpu().view(torch.uint8).reshape(128, 656), rows)
        for l, (k, s) in idx.items():
            kk, ss = pool_b.get_index_k_scale(l, got.slots)
            assert torch.equal(kk.cpu(), k) and torch.equal(ss.cpu().view(torch.int32), s.view(torch.int32))
        b.release(got.lease)
    finally:
        a_tier.close()
        b_tier.close()
