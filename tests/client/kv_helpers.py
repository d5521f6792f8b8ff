"""Test data and checks for KV over the daemon: random KV, byte-for-byte comparisons.

Expected layouts are worked out here from DESIGN.md, not asked of kvtier: GLM-5.2 (``index_topk_freq=4``,
``index_skip_topk_offset=3``) skips layer l iff ``max(l - 2, 0) % 4 != 0``, so of its first 8 layers
0, 1, 2 and 6 own an indexer buffer; an fp8 latent row is 512 + 16 + 128 = 656 bytes; an indexer
page row is 64 * 132 = 8448 bytes.
"""

from __future__ import annotations

import torch

from kvtier.client import KVData

NUM_LAYERS = 8
LIVE_LAYERS = tuple(l for l in range(NUM_LAYERS) if max(l - 2, 0) % 4 == 0)  # (0, 1, 2, 6)
ROW_BYTES = 512 + 512 // 128 * 4 + 64 * 2  # 656
INDEX_PAGE_BYTES = 64 * (128 + 4)  # 8448
PAGE_SIZE = 64


def random_kv(n: int, seed: int, *, layers=range(NUM_LAYERS), live=LIVE_LAYERS, row_bytes: int = ROW_BYTES):
    """``(latent {layer: (n, row_bytes) uint8}, index {layer: ((n, 128) uint8, (n,) float32)})``, seeded."""
    g = torch.Generator().manual_seed(seed)
    latent = {l: torch.randint(0, 256, (n, row_bytes), dtype=torch.uint8, generator=g) for l in layers}
    index = {l: (torch.randint(0, 256, (n, 128), dtype=torch.uint8, generator=g),
                 torch.rand(n, generator=g, dtype=torch.float32) + 0.5) for l in live}
    return latent, index


def verify_kv(kv: KVData, latent, index) -> None:
    """Every layer of ``kv`` equals ``latent``/``index`` byte for byte, and holds nothing else."""
    assert sorted(kv.latent) == sorted(latent)
    assert sorted(kv.index_k) == sorted(index) == sorted(kv.index_scale)
    for l, rows in latent.items():
        assert torch.equal(kv.latent[l].contiguous().view(torch.uint8).view(rows.shape), rows), f"latent layer {l} differs"
    for l, (keys, scales) in index.items():
        assert torch.equal(kv.index_k[l], keys), f"index_k layer {l} differs"
        assert torch.equal(kv.index_scale[l].view(torch.int32), scales.view(torch.int32)), f"scales layer {l} differ"


def verify_same(a: KVData, b: KVData) -> None:
    """Two reads hold identical bytes."""
    verify_kv(a, {l: t.contiguous().view(torch.uint8).view(t.shape[0], -1) for l, t in b.latent.items()},
              {l: (b.index_k[l], b.index_scale[l]) for l in b.index_k})


# ----- offloaded copies of one page on a 4-layer GLM-5.2 pool (live indexer layers 0, 1, 2) -----
LAYERS4 = range(4)
LIVE4 = (0, 1, 2)


def offload_page(client, pool_id: str, key: str, seed: int, *, free_slots: bool = True):
    """Allocate one page, write seeded KV into it and offload it under ``key``; returns the OffloadResult."""
    slots = client.allocate_slots(pool_id, PAGE_SIZE)
    latent, index = random_kv(PAGE_SIZE, seed, layers=LAYERS4, live=LIVE4)
    client.write_kv(pool_id, slots, latent=latent, index=index)
    return client.offload(pool_id, key, slots, free_slots=free_slots)


def verify_restored_page(client, pool_id: str, key: str, seed: int) -> None:
    """Restore ``key`` into fresh slots, check every byte against the seeded KV, free the slots."""
    slots = client.restore(pool_id, key)
    try:
        verify_kv(client.read_kv(pool_id, slots), *random_kv(PAGE_SIZE, seed, layers=LAYERS4, live=LIVE4))
    finally:
        client.free_slots(pool_id, slots)


def put_prefix_pages(client, pool_id: str, keys: list[bytes], seed: int) -> list[str]:
    """One request over ``keys``: load what is cached, write seeded KV into the rest, store, release.
    Returns the tier each loaded page came from."""
    lease = client.load_prefix(pool_id, keys)
    try:
        fresh = lease.slots[lease.loaded_pages * PAGE_SIZE:]
        if fresh.numel():
            latent, index = random_kv(fresh.numel(), seed, layers=LAYERS4, live=LIVE4)
            client.write_kv(pool_id, fresh, latent=latent, index=index)
            client.store_prefix(lease, keys[lease.loaded_pages:], fresh)
        return list(lease.tiers)
    finally:
        client.release_prefix(lease)
