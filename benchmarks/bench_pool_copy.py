"""Host-copy throughput of a GLM-5.2-shaped pool: kvtier vs plain torch gather/scatter, same bytes.

Measures, for one request of ``--tokens`` tokens on a pool of ``--size`` tokens (78 layers, fp8
656-byte latent rows, indexer buffers on the 21 live layers only):

* kvtier ``get_cpu_copy`` (fresh host buffer, and into a reused ``out=`` buffer) and ``load_cpu_copy``
  onto other slots;
* the SGLang-style baseline on the same pool and the same bytes: per layer ``index_select`` of the
  latent rows and of the indexer page rows into fresh tensors, then ``index_copy_`` of uint8 latent
  rows and ``index_put_`` of the page rows;
* the bytes a skip-aware copy moves against an all-layers copy (a pool with an indexer on every layer)
  of the same request, and the time kvtier takes for the latter (reused ``out=``).

Figures are medians over ``--reps`` repetitions (one warm-up first). Not a test: it prints figures.

    .venv/bin/python benchmarks/bench_pool_copy.py [--size 32768] [--tokens 4096] [--reps 9] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import PagedTokenAllocator, create_pool


def median_seconds(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds of each function. Repetitions are interleaved (a, b, c, a, b, c, ...) so that
    load from other processes on a shared machine hits every path alike; one warm-up round first."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(reps + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def fill(pool) -> None:
    g = torch.Generator().manual_seed(0)
    chunk = torch.randint(0, 256, (1 << 24,), dtype=torch.uint8, generator=g)
    for buf in [b.view(torch.uint8).reshape(-1) for b in pool.kv_buffer] + [b.reshape(-1) for b in pool.index_k_with_scale_buffer]:
        for i in range(0, buf.numel(), chunk.numel()):
            n = min(chunk.numel(), buf.numel() - i)
            buf[i:i + n].copy_(chunk[:n])


def sglang_style(pool, src, dst, src_pages, dst_pages):
    """Per-layer gather into fresh tensors, then uint8 scatter (what SGLang's CPU path does)."""
    live = [i for i, b in enumerate(pool.index_k_with_scale_buffer) if b.numel()]

    def get():
        kv = [pool.kv_buffer[layer].index_select(0, src) for layer in range(pool.layer_num)]
        idx = {layer: pool.index_k_with_scale_buffer[layer].index_select(0, src_pages) for layer in live}
        return kv, idx

    copy = get()

    def load():
        kv, idx = copy
        for layer in range(pool.layer_num):
            pool.kv_buffer[layer].index_copy_(0, dst, kv[layer])
        for layer in live:
            pool.index_k_with_scale_buffer[layer].index_put_((dst_pages,), idx[layer])

    return get, load


def run(size: int, tokens: int, reps: int) -> dict:
    model = DSAModelConfig.from_preset("glm-5.2")
    pool = create_pool(model, size, role="target", device="cpu")
    fill(pool)
    alloc = PagedTokenAllocator(size, model.page_size)
    # a request's slots as a real allocator hands them out, on pages scattered over the pool
    alloc.alloc(size // 4)
    src = alloc.alloc(tokens)
    alloc.alloc(size // 8)
    dst = alloc.alloc(tokens)
    ps = model.page_size
    src_pages, dst_pages = torch.unique(src // ps), torch.unique(dst // ps)
    nbytes = pool.cpu_copy_nbytes(src)
    latent_bytes = pool.latent_copy_nbytes(tokens)
    index_bytes = nbytes - latent_bytes

    out = torch.empty(nbytes, dtype=torch.uint8)
    copy = pool.get_cpu_copy(src)
    full = create_pool(model, size, role="draft", device="cpu")  # indexer on all 78 layers
    fill(full)
    all_bytes = full.cpu_copy_nbytes(src)
    full_out = torch.empty(all_bytes, dtype=torch.uint8)
    full_copy = full.get_cpu_copy(src)
    b_get, b_load = sglang_style(pool, src, dst, src_pages, dst_pages)
    s = median_seconds({
        "get_cpu_copy": lambda: pool.get_cpu_copy(src),
        "get_cpu_copy_out": lambda: pool.get_cpu_copy(src, out=out),
        "load_cpu_copy": lambda: pool.load_cpu_copy(copy, dst),
        "baseline_gather": b_get,
        "baseline_scatter": b_load,
        "all_layers_get_cpu_copy": lambda: full.get_cpu_copy(src, out=full_out),
        "all_layers_load_cpu_copy": lambda: full.load_cpu_copy(full_copy, dst),
    }, reps)
    t_get, t_get_out, t_load = s["get_cpu_copy"], s["get_cpu_copy_out"], s["load_cpu_copy"]
    t_b_get, t_b_load = s["baseline_gather"], s["baseline_scatter"]
    t_full_get, t_full_load = s["all_layers_get_cpu_copy"], s["all_layers_load_cpu_copy"]

    gbps = lambda b, t: b / t / 1e9  # noqa: E731
    return {
        "model": "glm-5.2", "kv_cache_dtype": "fp8", "pool_size_tokens": size, "request_tokens": tokens,
        "reps": reps, "torch_threads": torch.get_num_threads(),
        "bytes": {"skip_aware": nbytes, "latent": latent_bytes, "index_k": index_bytes, "all_layers": all_bytes,
                  "saved": all_bytes - nbytes, "all_layers_over_skip_aware": all_bytes / nbytes},
        "seconds": {"get_cpu_copy": t_get, "get_cpu_copy_out": t_get_out, "load_cpu_copy": t_load,
                    "baseline_gather": t_b_get, "baseline_scatter": t_b_load,
                    "all_layers_get_cpu_copy": t_full_get, "all_layers_load_cpu_copy": t_full_load},
        "gb_per_s": {"get_cpu_copy": gbps(nbytes, t_get), "get_cpu_copy_out": gbps(nbytes, t_get_out),
                     "load_cpu_copy": gbps(nbytes, t_load), "baseline_gather": gbps(nbytes, t_b_get),
                     "baseline_scatter": gbps(nbytes, t_b_load),
                     "all_layers_get_cpu_copy": gbps(all_bytes, t_full_get),
                     "all_layers_load_cpu_copy": gbps(all_bytes, t_full_load)},
        "ratios": {"get_vs_baseline": t_b_get / t_get, "get_out_vs_baseline": t_b_get / t_get_out,
                   "load_vs_baseline": t_b_load / t_load,
                   "round_trip_vs_baseline": (t_b_get + t_b_load) / (t_get_out + t_load),
                   "all_layers_round_trip_over_skip_aware": (t_full_get + t_full_load) / (t_get_out + t_load)},
    }


def print_table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s, g, b = r["seconds"], r["gb_per_s"], r["bytes"]
    t = Table(width=110, title=f"GLM-5.2 fp8 pool of {r['pool_size_tokens']:,} tokens, request of {r['request_tokens']:,} tokens "
                    f"(medians of {r['reps']}, {r['torch_threads']} torch threads)")
    for col, just in (("path", "left"), ("bytes", "right"), ("ms", "right"), ("GB/s", "right")):
        t.add_column(col, justify=just)
    rows = [
        ("kvtier get_cpu_copy (fresh host buffer)", b["skip_aware"], "get_cpu_copy"),
        ("kvtier get_cpu_copy (reused out=)", b["skip_aware"], "get_cpu_copy_out"),
        ("kvtier load_cpu_copy", b["skip_aware"], "load_cpu_copy"),
        ("baseline: per-layer index_select, fresh tensors", b["skip_aware"], "baseline_gather"),
        ("baseline: per-layer uint8 index_copy_/index_put_", b["skip_aware"], "baseline_scatter"),
        ("kvtier get_cpu_copy (reused out=), indexer on all 78 layers", b["all_layers"], "all_layers_get_cpu_copy"),
        ("kvtier load_cpu_copy, indexer on all 78 layers", b["all_layers"], "all_layers_load_cpu_copy"),
    ]
    for name, nbytes, key in rows:
        t.add_row(name, f"{nbytes:,}", f"{s[key] * 1e3:.1f}", f"{g[key]:.2f}")
    c = Console(width=110)
    c.print(t)
    q = r["ratios"]
    c.print(f"speed-up over baseline: get {q['get_vs_baseline']:.2f}x (reused out= {q['get_out_vs_baseline']:.2f}x), "
            f"load {q['load_vs_baseline']:.2f}x, round trip {q['round_trip_vs_baseline']:.2f}x")
    c.print(f"bytes a request moves: skip-aware {b['skip_aware']:,} (latent {b['latent']:,} + indexer {b['index_k']:,}) "
            f"vs all layers {b['all_layers']:,}: {b['saved']:,} bytes saved ({b['all_layers_over_skip_aware']:.3f}x); "
            f"the all-layers round trip (reused out=) takes {q['all_layers_round_trip_over_skip_aware']:.2f}x as long")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=32768, help="pool size in tokens (default 32768)")
    ap.add_argument("--tokens", type=int, default=4096, help="request length in tokens (default 4096)")
    ap.add_argument("--reps", type=int, default=9, help="repetitions per figure (default 9)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    r = run(args.size, args.tokens, args.reps)
    print(json.dumps(r)) if args.json else print_table(r)


if __name__ == "__main__":
    main()
