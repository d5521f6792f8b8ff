"""Case ``copies``: a request's host copy, ``get_cpu_copy`` / ``load_cpu_copy``, as SGLang calls them.

A GLM-5.2-shaped CPU pool (78 layers, fp8 656-byte latent rows, indexer buffers on the 21 live layers);
one request of ``tokens`` tokens on whole pages scattered over the pool (a seeded shuffle, as a
long-running allocator hands them out), loaded back onto other scattered pages. Per round, in this
order (medians after a warm-up round):

* kvtier ``pool.get_cpu_copy(src)`` with no ``out=`` (exactly SGLang's call; the result is dropped at
  once, as a caller dropping its copy) and ``pool.load_cpu_copy(copy, dst)``;
* the plain limit of the same bytes: per layer an int64-view ``index_select`` of the latent rows and
  indexer page rows into one reused host buffer, and ``index_copy_`` of it back;
* SGLang's CPU path as a model (per layer ``index_select`` into fresh tensors; uint8 ``index_copy_``
  and ``index_put_`` back), always;
* SGLang 0.5.23's own ``DSATokenToKVPool`` (same geometry, slots and bytes) where an interpreter that
  imports SGLang is found (:mod:`kvtier.bench.sglang_pool`);
* the same kvtier round trip on a pool with an indexer on all 78 layers (bytes and time saved).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvtier.bench.case import BenchContext, Case, CaseResult, Comparison, Figure, interleaved, throughput
from kvtier.bench.sglang_pool import SGLangPool, find_sglang_python
from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import DSATokenToKVPool, create_pool, slots_of_pages
from kvtier.server.pool.device_copy import copy_threads


def fill_random(pool: DSATokenToKVPool, seed: int) -> None:
    """Every byte of the pool's buffers from a seeded generator (16 MiB of random bytes repeated)."""
    g = torch.Generator().manual_seed(seed)
    chunk = torch.randint(0, 256, (1 << 24,), dtype=torch.uint8, generator=g)
    bufs = [b.view(torch.uint8).reshape(-1) for b in pool.kv_buffer] + [b.reshape(-1) for b in pool.index_k_with_scale_buffer]
    for buf in bufs:
        for i in range(0, buf.numel(), chunk.numel()):
            n = min(chunk.numel(), buf.numel() - i)
            buf[i:i + n].copy_(chunk[:n])


def scattered_pages(num_pages: int, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two disjoint sets of ``count`` pages each from pages ``1 .. num_pages - 1`` (page 0 is padding)."""
    perm = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
    if 2 * count > perm.size:
        raise ValueError(f"the pool has {perm.size} usable pages; two requests of {count} pages do not fit")
    return torch.from_numpy(perm[:count].copy()), torch.from_numpy(perm[count:2 * count].copy())


class PlainCopy:
    """The plain limit: int64-view ``index_select`` into one reused host buffer and ``index_copy_`` back,
    on the pool's public per-layer buffers (``kv_buffer``, ``index_k_with_scale_buffer``)."""

    def __init__(self, pool: DSATokenToKVPool, src: torch.Tensor, dst: torch.Tensor) -> None:
        ps, rb = pool.page_size, pool.row_bytes
        self.src, self.dst = src, dst
        self.src_pages, self.dst_pages = src[::ps] // ps, dst[::ps] // ps
        self.lat = [b.view(torch.uint8).view(b.shape[0], rb).view(torch.int64) for b in pool.kv_buffer]
        self.idx = [b.view(torch.int64) for b in pool.index_k_with_scale_buffer if b.numel()]
        n, p = src.numel(), self.src_pages.numel()
        lat_bytes = len(self.lat) * n * rb
        self.nbytes = lat_bytes + len(self.idx) * p * pool.index_page_bytes
        self.buf = torch.empty(self.nbytes, dtype=torch.uint8)
        self.buf.fill_(0)  # faulted once, reused by every call
        self.lat_out = self.buf[:lat_bytes].view(torch.int64).view(len(self.lat), n, rb // 8)
        self.idx_out = self.buf[lat_bytes:].view(torch.int64).view(len(self.idx), p, pool.index_page_bytes // 8)

    def get(self) -> None:
        for layer, words in enumerate(self.lat):
            torch.index_select(words, 0, self.src, out=self.lat_out[layer])
        for pos, words in enumerate(self.idx):
            torch.index_select(words, 0, self.src_pages, out=self.idx_out[pos])

    def load(self) -> None:
        for layer, words in enumerate(self.lat):
            words.index_copy_(0, self.dst, self.lat_out[layer])
        for pos, words in enumerate(self.idx):
            words.index_copy_(0, self.dst_pages, self.idx_out[pos])


class SGLangModel:
    """SGLang's CPU path as a model: per layer ``index_select`` into fresh tensors, uint8 scatters back."""

    def __init__(self, pool: DSATokenToKVPool, src: torch.Tensor, dst: torch.Tensor) -> None:
        ps = pool.page_size
        self.pool, self.src, self.dst = pool, src, dst
        self.src_pages, self.dst_pages = src[::ps] // ps, dst[::ps] // ps
        self.live = [i for i, b in enumerate(pool.index_k_with_scale_buffer) if b.numel()]
        self.copy = self.get()

    def get(self) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        kv = [b.index_select(0, self.src) for b in self.pool.kv_buffer]
        idx = {layer: self.pool.index_k_with_scale_buffer[layer].index_select(0, self.src_pages) for layer in self.live}
        return kv, idx

    def load(self) -> None:
        kv, idx = self.copy
        for layer, b in enumerate(self.pool.kv_buffer):
            b.index_copy_(0, self.dst, kv[layer])
        for layer in self.live:
            self.pool.index_k_with_scale_buffer[layer].index_put_((self.dst_pages,), idx[layer])


class CopiesCase(Case):
    name = "copies"
    title = "get_cpu_copy / load_cpu_copy of one request (GLM-5.2, fp8, CPU pool)"
    setup_steps = 3

    def settings(self, ctx: BenchContext) -> dict[str, Any]:
        return {"model": "glm-5.2", "kv_cache_dtype": "fp8", "pool_tokens": 12288 if ctx.quick else 32768,
                "request_tokens": 4096, "reps": 5 if ctx.quick else 15, "warmup": 1, "seed": 0,
                "torch_threads": torch.get_num_threads(), "copy_threads": copy_threads()}


    def run(self, ctx: BenchContext) -> CaseResult:
        s = self.settings(ctx)
        res = CaseResult(self.name, self.title, s)
        model = DSAModelConfig.from_preset("glm-5.2")
        ps = model.page_size
        pool = create_pool(model, s["pool_tokens"], role="target", device="cpu")
        full = create_pool(model, s["pool_tokens"], role="draft", device="cpu")  # indexer on all 78 layers
        fill_random(pool, 1)
        fill_random(full, 2)
        src_pages, dst_pages = scattered_pages(pool.num_slots // ps, s["request_tokens"] // ps, s["seed"])
        src, dst = slots_of_pages(src_pages, ps), slots_of_pages(dst_pages, ps)
        nbytes, all_bytes = pool.cpu_copy_nbytes(src), full.cpu_copy_nbytes(src)
        plain, model_path = PlainCopy(pool, src, dst), SGLangModel(pool, src, dst)
        assert plain.nbytes == nbytes
        ctx.advance(1)

        sgl, sgl_python = None, find_sglang_python(ctx.sglang_python)
        if sgl_python[0] is not None:
            sgl = SGLangPool(sgl_python[0], {"size": s["pool_tokens"], "page_size": ps, "layers": model.num_layers,
                                             "skip": list(pool.skip_topk_layers), "src": src.tolist(),
                                             "dst": dst.tolist(), "threads": torch.get_num_threads(), "seed": 3})
            res.figures["sglang"] = {"python": sgl_python[0], "version": sgl.info["sglang"], "torch": sgl.info["torch"]}
            if sgl.info["nbytes"] != nbytes:
                raise RuntimeError(f"SGLang's copy holds {sgl.info['nbytes']} bytes, kvtier's {nbytes}: not the same bytes")
        else:
            res.left_out["copies.*_vs_sglang"] = sgl_python[1]
        ctx.advance(1)
        try:
            kept = pool.get_cpu_copy(src)
            kept_full = full.get_cpu_copy(src)
            fns = {
                "kvtier_get": lambda: pool.get_cpu_copy(src),
                "plain_get": plain.get,
                "model_get": model_path.get,
                "kvtier_load": lambda: pool.load_cpu_copy(kept, dst),
                "plain_load": plain.load,
                "model_load": model_path.load,
                "all_layers_round_trip": lambda: full.load_cpu_copy(full.get_cpu_copy(src), dst),
                "skip_aware_round_trip": lambda: pool.load_cpu_copy(pool.get_cpu_copy(src), dst),
            }
            sgl_times: dict[str, list[float]] = {"get": [], "load": []}
            if sgl is not None:
                def sgl_round() -> None:  # timed inside the worker; warm-up rounds dropped below
                    sgl_times["get"].append(sgl.get())
                    sgl_times["load"].append(sgl.load())
                fns["sglang"] = sgl_round
            t = interleaved(fns, s["reps"], warmup=s["warmup"], tick=lambda: ctx.advance(1))
            self._verify(pool, src, dst)
            if sgl is not None and not sgl.check():
                raise RuntimeError("SGLang's load_cpu_copy did not restore the source bytes")
        finally:
            if sgl is not None:
                sgl.close()
        del kept, kept_full

        get_k, load_k = throughput("kvtier get_cpu_copy(indices)", nbytes, t["kvtier_get"]), \
            throughput("kvtier load_cpu_copy(copy, indices)", nbytes, t["kvtier_load"])
        c = res.comparisons
        c.append(Comparison("copies.get_cpu_copy_vs_plain", "get_cpu_copy as SGLang calls it vs plain int64 index_select into a reused buffer",
                            "GB/s", get_k, throughput("plain int64 index_select, reused buffer", nbytes, t["plain_get"]), target=0.8))
        c.append(Comparison("copies.load_cpu_copy_vs_plain", "load_cpu_copy vs plain int64 index_copy_", "GB/s",
                            load_k, throughput("plain int64 index_copy_", nbytes, t["plain_load"]), target=0.9))
        if sgl is not None:
            w = s["warmup"]
            c.append(Comparison("copies.get_cpu_copy_vs_sglang", f"get_cpu_copy vs SGLang {sgl.info['sglang']} DSATokenToKVPool.get_cpu_copy",
                                "GB/s", get_k, throughput(f"SGLang {sgl.info['sglang']} get_cpu_copy", nbytes, sgl_times["get"][w:]), target=5.0))
            c.append(Comparison("copies.load_cpu_copy_vs_sglang", f"load_cpu_copy vs SGLang {sgl.info['sglang']} DSATokenToKVPool.load_cpu_copy",
                                "GB/s", load_k, throughput(f"SGLang {sgl.info['sglang']} load_cpu_copy", nbytes, sgl_times["load"][w:]), target=3.0))
        c.append(Comparison("copies.get_cpu_copy_vs_sglang_model", "get_cpu_copy vs SGLang's CPU path as modelled (fresh tensor per layer)",
                            "GB/s", get_k, throughput("per-layer index_select, fresh tensors", nbytes, t["model_get"])))
        c.append(Comparison("copies.load_cpu_copy_vs_sglang_model", "load_cpu_copy vs SGLang's CPU path as modelled (uint8 index_copy_/index_put_)",
                            "GB/s", load_k, throughput("per-layer uint8 index_copy_/index_put_", nbytes, t["model_load"])))
        c.append(Comparison("copies.bytes_skip_aware_vs_all_layers", "bytes a request's copy holds: skip-aware vs indexer on all 78 layers",
                            "bytes", Figure("skip-aware (21 live indexer layers)", nbytes), Figure("indexer on all 78 layers", all_bytes),
                            higher_is_better=False))
        c.append(Comparison("copies.round_trip_skip_aware_vs_all_layers", "get+load round trip: skip-aware pool vs indexer on all layers",
                            "ms", Figure.from_samples("skip-aware round trip", [x * 1e3 for x in t["skip_aware_round_trip"]]),
                            Figure.from_samples("all-layers round trip", [x * 1e3 for x in t["all_layers_round_trip"]]),
                            higher_is_better=False))
        res.figures["bytes"] = {"copy": nbytes, "latent": pool.latent_copy_nbytes(src.numel()),
                                "index_k": nbytes - pool.latent_copy_nbytes(src.numel()), "all_layers": all_bytes}
        res.figures["seconds"] = {k: v for k, v in t.items() if k != "sglang"}
        ctx.advance(1)
        return res

    @staticmethod
    def _verify(pool: DSATokenToKVPool, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The last load left ``src``'s bytes at ``dst`` (every path copies the same bytes there)."""
        ps = pool.page_size
        for b in pool.kv_buffer:
            if not torch.equal(b[dst], b[src]):
                raise RuntimeError("load_cpu_copy did not restore the source latent rows")
        for b in pool.index_k_with_scale_buffer:
            if b.numel() and not torch.equal(b[dst[::ps] // ps], b[src[::ps] // ps]):
                raise RuntimeError("load_cpu_copy did not restore the source indexer pages")
