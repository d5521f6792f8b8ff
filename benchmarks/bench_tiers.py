"""Tier benchmark (figures, not a test).

1. Spill host -> disk: page records written one transaction each into the LMDB disk tier (what the
   host tier's write-back cascade does), against writing the same bytes to a plain file, with the
   same durability setting (``--sync``: LMDB fsyncs every commit; the plain file is fsynced after
   every record; without it neither fsyncs).
2. Restore disk -> host: the same records read back (``read_into`` a reused host buffer, checksum
   verified) against ``readinto`` of the same bytes from the plain file into the same buffer. Both
   read through the page cache (the file was just written).
3. Replay of the Mooncake trace: ``--simulate`` over all requests (hit rates, Belady bound) and the
   real replay through an embedded daemon (throughput, hit rates, bytes moved, verification).

Usage: python benchmarks/bench_tiers.py [--records 512] [--sync] [--requests N] [--skip-replay]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvtier.server.pool import create_pool, slots_of_pages
from kvtier.server.replay.scale import ReplayScale
from kvtier.server.tiers import DiskTier, DiskTierConfig, RecordCodec

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "conversation_trace.jsonl"


def make_records(n: int) -> list[torch.Tensor]:
    scale = ReplayScale()
    model = scale.model_config()
    pool = create_pool(model, 64 * 64, device="cpu")
    g = torch.Generator().manual_seed(0)
    for layer in range(model.num_layers):
        pool.set_kv_buffer(layer, torch.arange(64, 64 * 65), torch.randint(0, 256, (64 * 64, 656), dtype=torch.uint8, generator=g))
    codec = RecordCodec(model)
    return [codec.encode_from_pool(pool, slots_of_pages(torch.tensor([1 + i % 64]), 64)) for i in range(n)]


def bench_disk(records: list[torch.Tensor], sync: bool, workdir: Path, repeat: int) -> dict[str, float]:
    total = sum(r.numel() for r in records)
    out: dict[str, list[float]] = {"lmdb_write": [], "file_write": [], "lmdb_read": [], "file_read": []}
    buf = torch.empty(max(r.numel() for r in records), dtype=torch.uint8)
    for rep in range(repeat):
        d = workdir / f"lmdb{rep}"
        disk = DiskTier(DiskTierConfig(path=str(d), capacity_bytes=int(total * 2) + (64 << 20), sync=sync))
        disk.open()
        keys = [b"page-%06d" % i for i in range(len(records))]
        t = time.perf_counter()
        for k, r in zip(keys, records):
            disk.write([(k, r)])
        out["lmdb_write"].append(total / (time.perf_counter() - t))
        t = time.perf_counter()
        for k in keys:
            n = disk.read_into([k], [buf])[0]
            assert n
        out["lmdb_read"].append(total / (time.perf_counter() - t))
        disk.close()

        path = workdir / f"plain{rep}.bin"
        offsets = []
        t = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            pos = 0
            for r in records:
                f.write(memoryview(r.numpy()))
                if sync:
                    os.fsync(f.fileno())
                offsets.append((pos, r.numel()))
                pos += r.numel()
        out["file_write"].append(total / (time.perf_counter() - t))
        t = time.perf_counter()
        mv = memoryview(buf.numpy())
        with open(path, "rb", buffering=0) as f:
            for off, n in offsets:
                f.seek(off)
                f.readinto(mv[:n])
        out["file_read"].append(total / (time.perf_counter() - t))
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=512, help="page records (194,048 bytes each)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sync", action="store_true", help="fsync every commit / record")
    ap.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--json", default=None, help="write all figures here")
    args = ap.parse_args()
    figures: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="bench-tiers-") as tmp:
        records = make_records(args.records)
        mb = sum(r.numel() for r in records) / 1e6
        for sync in ([True] if args.sync else [False, True]):
            r = bench_disk(records, sync, Path(tmp), args.repeat)
            figures[f"disk_sync={sync}"] = r
            print(f"{args.records} page records ({mb:.0f} MB), sync={sync}, median of {args.repeat}:")
            print(f"  spill host->disk  LMDB {r['lmdb_write'] / 1e9:6.2f} GB/s   plain file {r['file_write'] / 1e9:6.2f} GB/s"
                  f"   ratio {r['lmdb_write'] / r['file_write']:.2f}")
            print(f"  restore disk->host LMDB {r['lmdb_read'] / 1e9:6.2f} GB/s   plain file {r['file_read'] / 1e9:6.2f} GB/s"
                  f"   ratio {r['lmdb_read'] / r['file_read']:.2f}")
        if not args.skip_replay:
            from kvtier.cli.replay import replay_through_daemon, simulate
            from kvtier.server.replay.driver import belady_bound
            from kvtier.server.replay.trace import read_trace

            reqs = read_trace(TRACE, args.requests)
            scale = ReplayScale()
            sim = simulate(reqs, scale)
            bound = belady_bound(reqs, scale)
            print(f"replay of {len(reqs):,} requests, default scale {scale.describe()['capacity_pages']} pages:")
            print(f"  simulate: {sim.seconds:.1f} s, hit rate {sim.hit_rate:.2%} "
                  f"({', '.join(f'{t} {v / sim.tokens:.2%}' for t, v in sim.hit_tokens.items())}), Belady {bound / sim.tokens:.2%}")
            real = replay_through_daemon(reqs, scale, workdir=tmp)
            print(f"  daemon:   {real.seconds:.1f} s, {real.requests / real.seconds:.1f} requests/s, "
                  f"{real.tokens / real.seconds:,.0f} tokens/s, hit rate {real.hit_rate:.2%}, "
                  f"verify failures {real.verify_failures}, equal to simulate: {real.hit_tokens == sim.hit_tokens}")
            for k, v in sorted(real.moves.items()):
                print(f"    {k:24s} {v['count']:>9,} records {v['bytes'] / 1e9:8.2f} GB")
            figures["replay"] = {"simulate": sim.to_dict(), "daemon": real.to_dict(), "belady_hit_tokens": bound}
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1, default=str))


if __name__ == "__main__":
    main()
