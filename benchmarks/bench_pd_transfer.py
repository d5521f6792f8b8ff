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

import torch

from kvtier.client import DaemonProcess, KVTierClient
from kvtier.server.model_config import DSAModelConfig
from kvtier.server.transfer import MooncakeTransferEngine

PS = 64


def median_time(fn, repeat: int) -> float:
    """Median seconds of ``repeat`` calls after one untimed warm-up (connection setup, registration)."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def raw_reads(total_bytes: int, items: list[int], repeat: int) -> tuple[float, float]:
    """(seconds for one contiguous read of total_bytes, seconds for one read per item), medians."""
    a, b = MooncakeTransferEngine(), MooncakeTransferEngine()
    src = torch.randint(0, 256, (total_bytes,), dtype=torch.uint8)
    dst = torch.zeros(total_bytes, dtype=torch.uint8)
    a.register([(src.data_ptr(), total_bytes)])
    b.register([(dst.data_ptr(), total_bytes)])
    sp, dp = src.data_ptr(), dst.data_ptr()
    one = median_time(lambda: b.read_raw(a.endpoint, dp, sp, total_bytes), repeat)
    assert torch.equal(src, dst)
    dst.zero_()

    def per_item() -> None:
        off = 0
        for n in items:
            b.read_raw(a.endpoint, dp + off, sp + off, n)
            off += n

    many = median_time(per_item, repeat)
    return one, many


def _pull_into(results: list, dec: KVTierClient, pool: str, peer: str, sp: list[int], dp: list[int], transport: str) -> None:
    results.append(dec.pull_kv(pool, peer, pool, src_pages=sp, dst_pages=dp, transport=transport))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=32, help="pages in the request (64 tokens each)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--pool-tokens", type=int, default=4096)
    args = ap.parse_args()
    model = DSAModelConfig.from_preset("glm-5.2")
    n_live, n_layers = len(model.live_indexer_layers), model.num_layers
    lat_page, idx_page = model.latent_row_bytes * PS, model.index_page_bytes
    pages = args.pages
    flags = ["--pool", f"glm-5.2:{args.pool_tokens}", "--device", "cpu", "--transfer-engine", "mooncake"]
    with DaemonProcess("127.0.0.1:0", extra_args=flags) as pre_d, DaemonProcess("127.0.0.1:0", extra_args=flags) as dec_d, \
            KVTierClient(pre_d.address, timeout=600) as pre, KVTierClient(dec_d.address, timeout=600) as dec:
        rows = []
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
                results: list = []
                pull = functools.partial(_pull_into, results, dec, pool, pre_d.address, sp, dp, transport)
                wall = median_time(pull, args.repeat)
                r = results[-1]
                inside = statistics.median(x.seconds for x in results[1:])
                rows.append((role, transport, r, wall, inside))
        target_mc = next(r for role, t, r, _, _ in rows if role == "target" and t == "mooncake")
        items = [lat_page] * (n_layers * pages) + [idx_page] * (n_live * pages)
        one, many = raw_reads(target_mc.total_bytes, items, args.repeat)

    gb = 1e9
    print(f"GLM-5.2 request of {pages} pages ({pages * PS} tokens); {n_layers} layers, {n_live} with an indexer buffer; "
          f"medians of {args.repeat}")
    print()
    print("| pool | transport | bytes moved | indexer bytes | ranges (latent + indexer) | PullKV wall | GB/s (wall) | GB/s (moving) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for role, transport, r, wall, inside in rows:
        print(f"| {role} | {transport} | {r.total_bytes:,} | {r.index_bytes:,} | {r.latent_requests} + {r.index_requests} | "
              f"{wall * 1e3:.1f} ms | {r.total_bytes / wall / gb:.2f} | {r.total_bytes / inside / gb:.2f} |")
    print(f"| raw | one transfer_sync_read of the same bytes | {target_mc.total_bytes:,} | | 1 | {one * 1e3:.1f} ms | "
          f"{target_mc.total_bytes / one / gb:.2f} | |")
    print(f"| raw | transfer_sync_read per page and component | {target_mc.total_bytes:,} | | {len(items)} | {many * 1e3:.1f} ms | "
          f"{target_mc.total_bytes / many / gb:.2f} | |")
    print()
    draft_mc = next(r for role, t, r, _, _ in rows if role == "draft" and t == "mooncake")
    print(f"skip-aware indexer bytes {target_mc.index_bytes:,} ({n_live} x {pages} x {idx_page}) vs all-layer "
          f"{draft_mc.index_bytes:,} ({n_layers} x {pages} x {idx_page}); total {target_mc.total_bytes:,} vs "
          f"{draft_mc.total_bytes:,} bytes (-{1 - target_mc.total_bytes / draft_mc.total_bytes:.1%})")
    assert target_mc.index_bytes == n_live * pages * idx_page and draft_mc.index_bytes == n_layers * pages * idx_page


if __name__ == "__main__":
    main()
