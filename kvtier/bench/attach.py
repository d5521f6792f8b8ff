"""Case ``attach``: a worker's KV write+read through an attached pool vs plain in-process tensors vs
WriteKV/ReadKV over gRPC, interleaved.

One GLM-5.2-shaped request (fp8: 656-byte latent rows on every layer, keys+scales on the live
layers) is written into a pool and read back three ways in each round:

* attached: the daemon's pool mapped into this process (``KVTierClient.attach``); the worker writes
  with the pool's own ``set_kv_buffer`` / ``set_index_k_scale_buffer`` and reads with
  ``get_cpu_copy(out=...)`` into one reused host buffer -- the calls an engine makes, on the daemon's memory;
* in-process (the baseline the attached path should match, ratio ~1.0): the same calls on a pool of
  the same geometry in this process's own private memory;
* gRPC: ``write_kv`` / ``read_kv`` of the same bytes over the daemon's unix socket.

What the attached worker wrote is read back over gRPC once and compared: the daemon holds those bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.bench.case import BenchContext, Case, CaseResult, Comparison, interleaved, throughput
from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess


def _write(pool: Any, slots: torch.Tensor, latent: dict, index: dict) -> None:
    for layer, rows in latent.items():
        pool.set_kv_buffer(layer, slots, rows)
    for layer, (keys, scales) in index.items():
        pool.set_index_k_scale_buffer(layer, slots, keys, scales)


class AttachCase(Case):
    name = "attach"
    title = "Worker KV write+read: attached pool vs in-process tensors vs WriteKV/ReadKV over gRPC"
    setup_steps = 1

    def settings(self, ctx: BenchContext) -> dict[str, Any]:
        return {"model": "glm-5.2", "tokens": 1024 if ctx.quick else 4096, "layers": 16 if ctx.quick else 78,
                "reps": 3 if ctx.quick else 7, "warmup": 1}


    def run(self, ctx: BenchContext) -> CaseResult:
        from kvtier.server.model_config import DSAModelConfig
        from kvtier.server.pool import create_pool

        s = self.settings(ctx)
        res = CaseResult(self.name, self.title, s)
        n, layers = s["tokens"], s["layers"]
        size = 2 * -(-n // 64) * 64 + 64  # the attached worker's request and the gRPC client's (page 0 is padding)
        local = create_pool(DSAModelConfig.from_preset("glm-5.2", num_layers=layers), size, device="cpu")
        g = torch.Generator().manual_seed(0)
        latent = {x: torch.randint(0, 256, (n, 656), dtype=torch.uint8, generator=g) for x in range(layers)}
        index = {x: (torch.randint(0, 256, (n, 128), dtype=torch.uint8, generator=g), torch.rand(n, generator=g))
                 for x in local.live_layers}
        nbytes = n * (layers * 656 + len(local.live_layers) * 132)
        s["payload_bytes"] = nbytes
        args = ["--device", "cpu", "--log-level", "WARNING", "--max-message-bytes", "8MiB", "--host-memory", "64MiB"]
        with DaemonProcess(extra_args=args) as d, \
                KVTierClient(d.address, timeout=600, max_message_bytes=8 << 20, chunk_bytes=1 << 20) as c:
            c.create_pool("glm-5.2", num_layers=layers, size_tokens=size, pool_id="bench")
            with c.attach("bench") as ap:
                slots = ap.allocate_slots(n)  # the session's own: only it may write them
                grpc_slots = c.allocate_slots("bench", n)
                out_attached = torch.empty(ap.pool.cpu_copy_nbytes(slots), dtype=torch.uint8)
                out_local = torch.empty_like(out_attached)
                _write(ap, slots, latent, index)
                kv = c.read_kv("bench", slots)
                if not (all(torch.equal(kv.latent[x], latent[x]) for x in latent)
                        and all(torch.equal(kv.index_k[x], index[x][0]) for x in index)):
                    raise RuntimeError("the daemon does not hold what the attached worker wrote")
                ctx.advance(1)
                t = interleaved({
                    "attached_write": lambda: _write(ap, slots, latent, index),
                    "attached_read": lambda: ap.get_cpu_copy(slots, out=out_attached),
                    "local_write": lambda: _write(local, slots, latent, index),
                    "local_read": lambda: local.get_cpu_copy(slots, out=out_local),
                    "grpc_write": lambda: c.write_kv("bench", grpc_slots, latent=latent, index=index),
                    "grpc_read": lambda: c.read_kv("bench", grpc_slots),
                }, s["reps"], warmup=s["warmup"], tick=lambda: ctx.advance(1))
                if not torch.equal(out_attached, out_local):
                    raise RuntimeError("attached and in-process reads of the same request differ")
        f = {k: throughput(k.replace("_", " "), nbytes, v) for k, v in t.items()}
        for op in ("write", "read"):
            res.comparisons.append(Comparison(
                f"attach.{op}_vs_in_process", f"KV {op} through the attached pool vs the same calls on in-process tensors",
                "GB/s", f[f"attached_{op}"], f[f"local_{op}"], target=0.9,
                note="same pool methods, the daemon's shared memory vs private memory: expect ~1.0"))
            res.comparisons.append(Comparison(
                f"attach.{op}_vs_grpc", f"KV {op} through the attached pool vs {'WriteKV' if op == 'write' else 'ReadKV'} over gRPC",
                "GB/s", f[f"attached_{op}"], f[f"grpc_{op}"]))
        res.figures["headline"] = {f"attached {op}": f"{f[f'attached_{op}'].value:.2f} GB/s" for op in ("write", "read")}
        return res
