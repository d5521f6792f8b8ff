"""Prefill-decode transfer: PullKV throughput against raw Mooncake reads and the gRPC fallback.

Two real daemons on 127.0.0.1 (both ``--transfer-engine mooncake``), each with a GLM-5.2 pool
(78 layers, 21 with an indexer buffer, fp8 656-byte latent rows) and a draft pool of the same model
(indexer on every layer). A request of ``--pages`` pages is written on the prefill side and pulled
to other pages on the decode side:

* PullKV over the Mooncake Transfer Engine (coalesced ranges, batches of 256) and over the gRPC
  fallback (ReadPages streams);
* in the same run, raw ``transfer_sync_read`` of the same bytes between two engines in this process:
  one contiguous read of the total (the ceiling), and one read per page and component (8448-byte and
  41984-byte items, what an uncoalesced transfer list costs);
* skip-aware bytes (target pool) vs all-layer bytes (draft pool) for the same request.

Prints a table (medians of ``--repeat`` runs). Figures, not a test.

    .venv/bin/python benchmarks/bench_pd_transfer.py --pages 32 --repeat 5
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvtier.client import DaemonProcess, KVTierClient
from kvtier.server.model_config import DSAModelConfig
from kvtier.server.transfer import MooncakeTransferEngine

PS = 64


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


class RawReads:
    """Two engines in this process with ``total_bytes`` registered each: the raw baseline."""

    def __init__(self, total_bytes: int, items: list[int]) -> None:
        self.a, self.b = MooncakeTransferEngine(), MooncakeTransferEngine()
        self.src = torch.randint(0, 256, (total_bytes,), dtype=torch.uint8)
        self.dst = torch.zeros(total_bytes, dtype=torch.uint8)
        self.a.register([(self.src.data_ptr(), total_bytes)])
        self.b.register([(self.dst.data_ptr(), total_bytes)])
        self.total, self.items = total_bytes, items

    def one(self) -> None:
        """One ``transfer_sync_read`` of all the bytes."""
        self.b.read_raw(self.a.endpoint, self.dst.data_ptr(), self.src.data_ptr(), self.total)

    def per_item(self) -> None:
        """One ``transfer_sync_read`` per page and component (no coalescing)."""
        off, sp, dp = 0, self.src.data_ptr(), self.dst.data_ptr()
        for n in self.items:
            self.b.read_raw(self.a.endpoint, dp + off, sp + off, n)
            off += n

    def verify(self) -> None:
        assert torch.equal(self.src, self.dst)
        self.dst.zero_()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=32, help="pages in the request (64 tokens each)")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--pool-tokens", type=int, default=4096)
    args = ap.parse_args()
    model = DSAModelConfig.from_preset("glm-5.2")
    n_live, n_layers = len(model.live_indexer_layers), model.num_layers
    lat_page, idx_page = model.latent_row_bytes * PS, model.index_page_bytes
    pages = args.pages
    flags = ["--pool", f"glm-5.2:{args.pool_tokens}", "--device", "cpu", "--transfer-engine", "mooncake"]
    total = n_layers * pages * lat_page + n_live * pages * idx_page
    raw = RawReads(total, [lat_page] * (n_layers * pages) + [idx_page] * (n_live * pages))
    with DaemonProcess("127.0.0.1:0", extra_args=flags) as pre_d, DaemonProcess("127.0.0.1:0", extra_args=flags) as dec_d, \
            KVTierClient(pre_d.address, timeout=600) as pre, KVTierClient(dec_d.address, timeout=600) as dec:
        cases: dict[str, Callable[[], Any]] = {}
        for role in ("target", "draft"):
            pool = "default" if role == "target" else "draft"
            if role == "draft":
                for c in (pre, dec):
                    c.create_pool("glm-5.2", size_tokens=args.pool_tokens, pool_id="draft", role="draft", device="cpu")
            src = pre.allocate_slots(pool, pages * PS)
            g = torch.Generator().manual_seed(1)
            latent = {x: torch.randint(0, 256, (src.numel(), 656), dtype=torch.uint8, generator=g) for x in range(n_layers)}
            pre.write_kv(pool, src, latent=latent)
            dec.allocate_slots(pool, PS)  # destination pages differ from the source's
            dst = dec.allocate_slots(pool, pages * PS)
            sp, dp = (src[::PS] // PS).tolist(), (dst[::PS] // PS).tolist()
            for transport in ("mooncake", "grpc"):
                cases[f"{role}/{transport}"] = functools.partial(
                    dec.pull_kv, pool, pre_d.address, pool, src_pages=sp, dst_pages=dp, transport=transport)
        cases["raw/one"], cases["raw/per_item"] = raw.one, raw.per_item
        for fn in cases.values():  # warm-up: connections, handshakes, registrations
            fn()
        raw.verify()
        walls: dict[str, list[float]] = {k: [] for k in cases}
        results: dict[str, list[Any]] = {k: [] for k in cases}
        for _ in range(args.repeat):  # interleaved, so drift on a busy machine hits every case alike
            for name, fn in cases.items():
                dt, out = timed(fn)
                walls[name].append(dt)
                results[name].append(out)
        raw.verify()

    gb = 1e9
    wall = {k: statistics.median(v) for k, v in walls.items()}
    print(f"GLM-5.2 request of {pages} pages ({pages * PS} tokens); {n_layers} layers, {n_live} with an indexer buffer; "
          f"medians of {args.repeat} interleaved runs")
    print()
    print("| pool | transport | bytes moved | indexer bytes | ranges (latent + indexer) | wall | GB/s (wall) | GB/s (moving) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in ("target/mooncake", "target/grpc", "draft/mooncake", "draft/grpc"):
        r = results[name][-1]
        inside = statistics.median(x.seconds for x in results[name])
        role, transport = name.split("/")
        print(f"| {role} | PullKV {transport} | {r.total_bytes:,} | {r.index_bytes:,} | {r.latent_requests} + {r.index_requests} | "
              f"{wall[name] * 1e3:.1f} ms | {r.total_bytes / wall[name] / gb:.2f} | {r.total_bytes / inside / gb:.2f} |")
    print(f"| raw | one transfer_sync_read of the same bytes | {total:,} | | 1 | {wall['raw/one'] * 1e3:.1f} ms | "
          f"{total / wall['raw/one'] / gb:.2f} | |")
    print(f"| raw | transfer_sync_read per page and component | {total:,} | | {len(raw.items)} | "
          f"{wall['raw/per_item'] * 1e3:.1f} ms | {total / wall['raw/per_item'] / gb:.2f} | |")
    print()
    t, d = results["target/mooncake"][-1], results["draft/mooncake"][-1]
    assert t.total_bytes == total and t.index_bytes == n_live * pages * idx_page and d.index_bytes == n_layers * pages * idx_page
    print(f"PullKV mooncake / raw one read: {wall['raw/one'] / wall['target/mooncake']:.2f}; "
          f"PullKV mooncake / PullKV grpc: {wall['target/grpc'] / wall['target/mooncake']:.2f}x; "
          f"vs raw per-page reads: {wall['raw/per_item'] / wall['target/mooncake']:.2f}x")
    print(f"skip-aware indexer bytes {t.index_bytes:,} ({n_live} x {pages} x {idx_page}) vs all-layer "
          f"{d.index_bytes:,} ({n_layers} x {pages} x {idx_page}); total {t.total_bytes:,} vs "
          f"{d.total_bytes:,} bytes (-{1 - t.total_bytes / d.total_bytes:.1%}); ranges "
          f"{t.latent_requests + t.index_requests} vs {d.latent_requests + d.index_requests}")


if __name__ == "__main__":
    main()
