"""SGLang's own pools for the backend tests: a DSA device pool, its MLA host KV pool and its DSA
indexer host pool, built on CPU as SGLang's hybrid pool assembler builds them (``override_kv_cache_dim``
= the device pool's 656-byte fp8 row), plus a backend created through SGLang's StorageBackendFactory."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str
from sglang.srt.runtime_context import get_parallel

PS = 64
MODEL_NAME = "zai-org/GLM-5.2"


def glm_skips(layer: int) -> bool:
    """GLM-5.2: layer l skips top-k iff max(l - 2, 0) % 4 != 0 (index_topk_freq 4, offset 3)."""
    return max(layer - 2, 0) % 4 != 0


class HostPools:
    """SGLang's host pools of GLM-5.2 layers [start, end), fp8, ``size`` device tokens, host ratio 2."""

    def __init__(self, start: int = 20, end: int = 24, layout: str = "page_first_direct", size: int = 1024,
                 dtype: torch.dtype = torch.float8_e4m3fn) -> None:
        skip = [glm_skips(layer) for layer in range(start, end)]
        with get_parallel().override(attn_dcp_size=1):
            self.device = DSATokenToKVPool(
                size=size, page_size=PS, kv_lora_rank=512, dtype=dtype, qk_rope_head_dim=64, layer_num=end - start,
                device="cpu", index_head_dim=128, enable_memory_saver=False,
                kv_cache_dim=656 if dtype == torch.float8_e4m3fn else 576,
                start_layer=start, end_layer=end, skip_topk_layers=skip)
            self.kv = MLATokenToKVPoolHost(
                self.device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PS, layout, pin_memory=False, device="cpu",
                device_capacity_tokens=size, start_layer=start, end_layer=end, target_layer_num=end - start,
                override_kv_cache_dim=self.device.kv_cache_dim)
            self.index = DSAIndexerPoolHost(make_dsa_indexer_pool_decl(self.device), self.kv, pin_memory=False,
                                            device="cpu")
        self.layers, self.live = end - start, sum(not s for s in skip)

    def alloc(self, pages: int) -> torch.Tensor:
        """Host token indices of ``pages`` whole pages (SGLang's host allocator)."""
        idx = self.kv.alloc(pages * PS)
        assert idx is not None and idx.numel() == pages * PS
        return idx

    def page_ids(self, idx: torch.Tensor) -> list[int]:
        return (idx.reshape(-1, PS)[:, 0] // PS).tolist()

    def fill(self, idx: torch.Tensor, seed: int) -> None:
        """Random bytes into the KV and indexer host pages at ``idx``."""
        g = torch.Generator().manual_seed(seed)
        for p in self.page_ids(idx):
            kv = self.kv_page(p).view(torch.uint8)
            kv.copy_(torch.randint(0, 256, kv.shape, dtype=torch.uint8, generator=g))
            ix = self.index_page(p)
            ix.copy_(torch.randint(0, 256, ix.shape, dtype=torch.uint8, generator=g))

    def kv_page(self, page: int) -> torch.Tensor:
        """The KV host page as SGLang holds it (page_first: (64, layers, 1, 656); direct: (layers, 64, 1, 656))."""
        if self.kv.layout == "page_first":
            return self.kv.kv_buffer[page * PS:(page + 1) * PS]
        return self.kv.kv_buffer[page]

    def index_page(self, page: int) -> torch.Tensor:
        return self.index.index_k_with_scale_buffer[page]

    def snapshot(self, idx: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.kv_page(p).view(torch.uint8).clone(), self.index_page(p).clone()) for p in self.page_ids(idx)]

    def zero(self, idx: torch.Tensor) -> None:
        for p in self.page_ids(idx):
            self.kv_page(p).zero_()
            self.index_page(p).zero_()


def storage_config(extra: dict, *, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                   is_mla: bool = True, page_first: bool = False) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=is_mla, enable_storage_metrics=False, is_page_first_layout=page_first, model_name=MODEL_NAME,
        extra_config={"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
                      "class_name": "KVTierStorage", "interface_v1": 1, **extra})


def make_backend(pools: HostPools, extra: dict, **cfg):
    """The backend as SGLang's cache controller makes and attaches it (StorageBackendFactory
    ``dynamic``, then register_mem_pool_host, register_mem_host_pool_v2(INDEXER), on_host_pools_registered)."""
    config = storage_config(extra, page_first=pools.kv.layout == "page_first", **cfg)
    backend = StorageBackendFactory.create_backend("dynamic", config, pools.kv)
    backend.register_mem_pool_host(pools.kv)
    backend.register_mem_host_pool_v2(pools.index, PoolName.INDEXER)
    backend.on_host_pools_registered()
    return backend


def page_keys(n: int, salt: int = 0) -> list[str]:
    """SGLang's own chained page hashes of ``n`` pages of token ids."""
    keys, prior = [], None
    for p in range(n):
        prior = get_hash_str(list(range(salt * 10**6 + p * PS, salt * 10**6 + (p + 1) * PS)), prior)
        keys.append(prior)
    return keys


def indexer(keys, idx, **kw) -> list[PoolTransfer]:
    return [PoolTransfer(name=PoolName.INDEXER, host_indices=idx, keys=list(keys), **kw)]


def store(backend, keys, idx) -> None:
    """Write pages the way SGLang's HybridCacheController backs them up: indexer (v2) first, then KV (v1)."""
    assert backend.batch_set_v2(indexer(keys, idx))[PoolName.INDEXER] == [True] * len(keys)
    assert backend.batch_set_v1(keys, idx) == [True] * len(keys)


def load(backend, keys, idx) -> tuple[list[bool], list[bool]]:
    """Read pages the way SGLang's controller prefetches them: KV (v1), then the indexer sidecar (v2)."""
    kv = backend.batch_get_v1(keys, idx)
    return kv, backend.batch_get_v2(indexer(keys, idx))[PoolName.INDEXER]
