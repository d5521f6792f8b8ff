"""Worker KV write+read through an attached pool vs WriteKV/ReadKV over gRPC vs plain in-process tensors.

One GLM-5.2-shaped request (fp8: 656-byte latent rows on every layer, keys+scales on the live
layers) is written into a pool and read back, three ways, interleaved in each repetition (medians):

* attached: the daemon's pool mapped into this process (``KVTierClient.attach``); the worker writes
  with the pool's own ``set_kv_buffer`` / ``set_index_k_scale_buffer`` and reads with
  ``get_cpu_copy(out=...)`` into one reused host buffer -- the calls an engine makes, on the daemon's memory;
* in-process: the same calls on a pool of the same geometry in this process's own (private) memory:
  the plain limit the attached path should match (ratio ~1.0);
* gRPC: ``write_kv`` / ``read_kv`` of the same bytes over the daemon's unix socket.

    .venv/bin/python benchmarks/bench_attach.py [--tokens 4096] [--layers 78] [--repeat 7] [--json out.json]

Every path's bytes are checked once: what the attached worker wrote reads back identically over
gRPC, so the daemon really holds it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess
from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import create_pool


def write_pool(pool, slots: torch.Tensor, latent: dict, index: dict) -> None:
    for layer, rows in latent.items():
        pool.set_kv_buffer(layer, slots, rows)
    for layer, (keys, scales) in index.items():
        pool.set_index_k_scale_buffer(layer, slots, keys, scales)


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=78, help="first N layers of GLM-5.2")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    size = -(-a.tokens // 64) * 64 + 64  # one page more than the request: slots start at page 1
    model = DSAModelConfig.from_preset("glm-5.2", num_layers=a.layers)
    local = create_pool(model, size, device="cpu")
    live = list(local.live_layers)
    latent = {l: torch.randint(0, 256, (a.tokens, 656), dtype=torch.uint8, generator=g) for l in range(a.layers)}
    index = {l: (torch.randint(0, 256, (a.tokens, 128), dtype=torch.uint8, generator=g), torch.rand(a.tokens, generator=g))
             for l in live}
    nbytes = a.tokens * (a.layers * 656 + len(live) * 132)
    with DaemonProcess(extra_args=["--device", "cpu", "--log-level", "WARNING", "--max-message-bytes", "8MiB"]) as d, \
            KVTierClient(d.address, timeout=600, max_message_bytes=8 << 20, chunk_bytes=1 << 20) as c:
        c.create_pool("glm-5.2", num_layers=a.layers, size_tokens=size, pool_id="bench")
        with c.attach("bench") as attached:
            slots = attached.allocate_slots(a.tokens)
            local_slots = slots.clone()
            out_attached = torch.empty(attached.pool.cpu_copy_nbytes(slots), dtype=torch.uint8)
            out_local = torch.empty_like(out_attached)
            # warm-up, and the check that the attached worker's bytes are the daemon's
            write_pool(attached, slots, latent, index)
            kv = c.read_kv("bench", slots)
            assert all(torch.equal(kv.latent[l], latent[l]) for l in latent) and all(
                torch.equal(kv.index_k[l], index[l][0]) for l in live), "the daemon does not hold what the worker wrote"
            write_pool(local, local_slots, latent, index)
            c.write_kv("bench", slots, latent=latent, index=index)
            runs: dict[str, list[float]] = {k: [] for k in ("attached_write", "attached_read", "local_write", "local_read",
                                                             "grpc_write", "grpc_read")}
            for _ in range(a.repeat):  # interleaved: every path sees the same machine load
                runs["attached_write"].append(timed(lambda: write_pool(attached, slots, latent, index)))
                runs["attached_read"].append(timed(lambda: attached.get_cpu_copy(slots, out=out_attached)))
                runs["local_write"].append(timed(lambda: write_pool(local, local_slots, latent, index)))
                runs["local_read"].append(timed(lambda: local.get_cpu_copy(local_slots, out=out_local)))
                runs["grpc_write"].append(timed(lambda: c.write_kv("bench", slots, latent=latent, index=index)))
                runs["grpc_read"].append(timed(lambda: c.read_kv("bench", slots)))
            assert torch.equal(out_attached, out_local)
    gb = {k: nbytes / statistics.median(v) / 1e9 for k, v in runs.items()}
    r = {"payload_bytes": nbytes, "tokens": a.tokens, "layers": a.layers, "live_layers": len(live), "repeat": a.repeat,
         **{f"{k}_GBps": v for k, v in gb.items()},
         "attached_vs_local_write": gb["attached_write"] / gb["local_write"],
         "attached_vs_local_read": gb["attached_read"] / gb["local_read"],
         "attached_vs_grpc_write": gb["attached_write"] / gb["grpc_write"],
         "attached_vs_grpc_read": gb["attached_read"] / gb["grpc_read"]}
    print(f"payload: {nbytes:,} bytes ({a.tokens} tokens, GLM-5.2 first {a.layers} layers, {len(live)} with indexer), "
          f"median of {a.repeat}, GB/s")
    print(f"{'':>10} {'attached':>9} {'in-process':>11} {'gRPC':>7} {'att/in-proc':>12} {'att/gRPC':>9}")
    for op in ("write", "read"):
        print(f"{op:>10} {gb[f'attached_{op}']:9.3f} {gb[f'local_{op}']:11.3f} {gb[f'grpc_{op}']:7.3f} "
              f"{r[f'attached_vs_local_{op}']:12.2f} {r[f'attached_vs_grpc_{op}']:9.2f}")
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
