"""The SGLang storage case of ``kvtier bench``, run by an interpreter that imports SGLang 0.5.23.

``PYTHON -m kvtier.bench.sglang_storage_worker '{"pages": 128, "reps": 5, "start": 20, "end": 40, "workdir": DIR}'``
prints one JSON object: per-round seconds of every path and the bytes each moved.

All backends get the same pages of SGLang's own host pools (``MLATokenToKVPoolHost`` page_first,
``DSAIndexerPoolHost``) of a GLM-5.2 stage, and are called the way SGLang's cache controller calls
each: kvtier (``dynamic``, ``interface_v1``) with ``batch_set_v2([INDEXER])`` + ``batch_set_v1`` and
``batch_get_v1`` + ``batch_get_v2([INDEXER])``, twice -- ``transport: shm`` (page bytes through a
storage session's shared-memory staging buffers) and ``transport: grpc`` (gRPC streams), both to one
daemon on a unix socket with its host tier --; SGLang's ``file`` backend (HiCacheFile, not zero-copy)
with ``batch_set`` of ``get_data_page`` pages + ``batch_set_v2([INDEXER])`` and ``batch_get`` into
dummy pages + ``set_from_flat_data_page`` + ``batch_get_v2([INDEXER])``; and the plain limit of the
same bytes: each page's KV and indexer range (``get_page_buffer_meta``) copied once into one reused
buffer (set) and back out of it (get). Rounds are interleaved (every set, then every get), each
round and backend on fresh page keys; every get is checked byte for byte (untimed).
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import numpy as np


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # SGLang prints on import
    cfg = json.loads(sys.argv[1])
    import torch

    torch.set_num_threads(int(cfg.get("threads", 1)))
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str
    from sglang.srt.runtime_context import get_parallel

    from kvtier.client import KVTierClient
    from kvtier.client.spawn import DaemonProcess

    ps, n, reps, start, end = 64, int(cfg["pages"]), int(cfg["reps"]), int(cfg["start"]), int(cfg["end"])
    skip = [max(layer - 2, 0) % 4 != 0 for layer in range(start, end)]
    size = 2 * n * ps
    with get_parallel().override(attn_dcp_size=1):
        dev = DSATokenToKVPool(size=size, page_size=ps, kv_lora_rank=512, dtype=torch.float8_e4m3fn, qk_rope_head_dim=64,
                               layer_num=end - start, device="cpu", index_head_dim=128, enable_memory_saver=False,
                               kv_cache_dim=656, start_layer=start, end_layer=end, skip_topk_layers=skip)
        kv = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 1.0, 0, ps, "page_first", pin_memory=False,
                                  device="cpu", device_capacity_tokens=size, start_layer=start, end_layer=end,
                                  target_layer_num=end - start, override_kv_cache_dim=dev.kv_cache_dim)
        ix = DSAIndexerPoolHost(make_dsa_indexer_pool_decl(dev), kv, pin_memory=False, device="cpu")
    src, dst = kv.alloc(n * ps), kv.alloc(n * ps)
    g = torch.Generator().manual_seed(1)
    kv.kv_buffer.view(torch.uint8).copy_(torch.randint(0, 256, kv.kv_buffer.shape, dtype=torch.uint8, generator=g))
    ix.index_k_with_scale_buffer.copy_(torch.randint(0, 256, ix.index_k_with_scale_buffer.shape, dtype=torch.uint8,
                                                     generator=g))
    src_pages, dst_pages = (src[::ps] // ps).tolist(), (dst[::ps] // ps).tolist()
    unit_bytes = (end - start) * ps * 656 + sum(not s for s in skip) * 8448

    def config(extra):
        return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                    is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
                                    model_name="zai-org/GLM-5.2", extra_config=extra)

    d = DaemonProcess(f"unix://{cfg['workdir']}/bench-kv.sock",
                      extra_args=["--device", "cpu", "--host-memory", str(2 * unit_bytes * n * (reps + 2) + (64 << 20))])
    d.start()
    try:
        def kvtier(transport):
            return StorageBackendFactory.create_backend("dynamic", config(
                {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang", "class_name": "KVTierStorage",
                 "interface_v1": 1, "address": d.address, "transport": transport}), kv)

        backends = {
            "shm": kvtier("shm"),
            "grpc": kvtier("grpc"),
            "file": StorageBackendFactory.create_backend("file", config(
                {"file_storage_path": f"{cfg['workdir']}/hicache-file"}), kv),
        }
        for b in backends.values():
            b.register_mem_pool_host(kv)
            b.register_mem_host_pool_v2(kv, PoolName.KV)
            b.register_mem_host_pool_v2(ix, PoolName.INDEXER)
            b.on_host_pools_registered()
        fb = backends["file"]

        def keys_of(rnd, salt):
            keys, prior = [], None
            for p in range(n):
                prior = get_hash_str([rnd, p, salt] * (ps // 2), prior)
                keys.append(prior)
            return keys

        def sidecar(keys, idx):
            return [PoolTransfer(name=PoolName.INDEXER, host_indices=idx, keys=keys)]

        def k_set(kb):
            def run(keys):
                assert all(kb.batch_set_v2(sidecar(keys, src))[PoolName.INDEXER]) and all(kb.batch_set_v1(keys, src))
            return run

        def k_get(kb):
            def run(keys):
                assert all(kb.batch_get_v1(keys, dst)) and all(kb.batch_get_v2(sidecar(keys, dst))[PoolName.INDEXER])
            return run

        # the plain limit: every page's KV and indexer bytes copied once, into / out of one reused buffer
        def _view(ptr, nbytes):
            return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr)))

        def ranges(idx):
            kp, ks = kv.get_page_buffer_meta(idx)
            ip, is_ = ix.get_page_buffer_meta(idx)
            return [_view(int(p), int(s)) for p, s in zip([*kp, *ip], [*ks, *is_])]

        src_views, dst_views = ranges(src), ranges(dst)
        plain = torch.empty(unit_bytes * n, dtype=torch.uint8)
        offs = [0]
        for v in src_views:
            offs.append(offs[-1] + v.numel())

        def p_set(keys):
            for v, a, b in zip(src_views, offs, offs[1:]):
                plain[a:b].copy_(v)

        def p_get(keys):
            for v, a, b in zip(dst_views, offs, offs[1:]):
                v.copy_(plain[a:b])

        def f_set(keys):
            assert fb.batch_set(keys, [kv.get_data_page(src[i * ps]) for i in range(n)])
            assert all(fb.batch_set_v2(sidecar(keys, src))[PoolName.INDEXER])

        def f_get(keys):
            pages = fb.batch_get(keys, [kv.get_dummy_flat_data_page() for _ in keys])
            assert all(p is not None for p in pages)
            for i, p in enumerate(pages):
                kv.set_from_flat_data_page(dst[i * ps], p)
            assert all(fb.batch_get_v2(sidecar(keys, dst))[PoolName.INDEXER])

        def check() -> None:
            for s, t in zip(src_pages, dst_pages):
                assert torch.equal(kv.kv_buffer[s * ps:(s + 1) * ps].view(torch.uint8), kv.kv_buffer[t * ps:(t + 1) * ps].view(torch.uint8))
                assert torch.equal(ix.index_k_with_scale_buffer[s], ix.index_k_with_scale_buffer[t])

        def clear_dst() -> None:
            for t in dst_pages:
                kv.kv_buffer[t * ps:(t + 1) * ps].zero_()
                ix.index_k_with_scale_buffer[t].zero_()

        paths = [("shm_set", k_set(backends["shm"])), ("grpc_set", k_set(backends["grpc"])), ("file_set", f_set),
                 ("plain_set", p_set), ("shm_get", k_get(backends["shm"])), ("grpc_get", k_get(backends["grpc"])),
                 ("file_get", f_get), ("plain_get", p_get)]
        times: dict[str, list[float]] = {name: [] for name, _ in paths}
        salts = {"shm": 1, "grpc": 2, "file": 3, "plain": 4}
        for rnd in range(reps + 1):
            for name, fn in paths:
                keys = keys_of(rnd, salts[name.split("_")[0]])   # a get reads what its set wrote this round
                if name.endswith("get"):
                    clear_dst()
                t0 = time.perf_counter()
                fn(keys)
                dt = time.perf_counter() - t0
                if name.endswith("get"):
                    check()
                if rnd:
                    times[name].append(dt)
            print(f"round {rnd} done", file=sys.stderr, flush=True)
        with KVTierClient(d.address) as c:
            counters = c.unit_stats()
        staged = {"shm_staged_calls": backends["shm"].transport.staged_calls,
                  "shm_grpc_calls": backends["shm"].transport.grpc_calls}
        backends["shm"].close()
        backends["grpc"].close()
    finally:
        d.stop()
        d.cleanup()
    out.write(json.dumps({"times": times, "unit_bytes": unit_bytes, "pages": n, "layers": end - start,
                          "live_layers": sum(not s for s in skip), "bytes": unit_bytes * n,
                          "daemon_bytes": {k: v for k, v in counters.items() if k.startswith(("put_bytes", "get_bytes"))},
                          **staged}) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
