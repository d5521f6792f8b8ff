"""Case ``daemon``: the daemon's data path (WriteKV / ReadKV over a unix socket) vs a plain gRPC
bytes echo of the same bytes in the same chunks (:mod:`kvtier.bench.echo`), interleaved.

The payload is one GLM-5.2-shaped request: latent rows of every layer (656-byte fp8 rows) and the
live layers' keys+scales (132 bytes a token on 21 of 78 layers). WriteKV is timed both ways users
call it: into slots allocated before (``write_kv``: their pages claimed, the latent rows written in
place as they arrive after an undo copy of the rows they replace, all or nothing) and as the write
that allocates its pages (``write_new_kv``: the rows land in the new
pages as they arrive; each round's pages are freed, untimed, before the next). Both servers are
their own processes; what both writes wrote is read back and checked byte for byte.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.bench.case import BenchContext, Case, CaseResult, Comparison, interleaved, throughput
from kvtier.bench.echo import EchoClient, wait_ready
from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess


class DaemonIOCase(Case):
    name = "daemon"
    title = "Daemon data path (WriteKV/ReadKV, unix socket) vs a plain gRPC byte echo"
    setup_steps = 2

    def settings(self, ctx: BenchContext) -> dict[str, Any]:
        return {"model": "glm-5.2", "tokens": 2048 if ctx.quick else 4096, "layers": 78, "chunk_bytes": 1 << 20,
                "reps": 3 if ctx.quick else 7, "warmup": 1, "transport": "unix socket"}


    def run(self, ctx: BenchContext) -> CaseResult:
        s = self.settings(ctx)
        res = CaseResult(self.name, self.title, s)
        chunk, n = s["chunk_bytes"], s["tokens"]
        g = torch.Generator().manual_seed(0)
        args = ["--device", "cpu", "--log-level", "WARNING", "--max-message-bytes", "8MiB", "--host-memory", "1GiB"]
        with DaemonProcess(extra_args=args) as d, \
                KVTierClient(d.address, timeout=600, max_message_bytes=8 << 20, chunk_bytes=chunk) as c:
            info = c.create_pool("glm-5.2", num_layers=s["layers"], size_tokens=2 * -(-n // 64) * 64 + 64, pool_id="bench")
            slots = c.allocate_slots("bench", n)
            latent = {x: torch.randint(0, 256, (n, 656), dtype=torch.uint8, generator=g) for x in range(s["layers"])}
            index = {x: (torch.randint(0, 256, (n, 128), dtype=torch.uint8, generator=g), torch.rand(n, generator=g))
                     for x in info.live_layers}
            nbytes = c.write_kv("bench", slots, latent=latent, index=index)
            s["payload_bytes"] = nbytes
            payload = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
            sock_dir = Path(tempfile.mkdtemp(prefix="kvtier-echo-"))  # short: unix socket paths are <= 107 bytes
            ready = sock_dir / "ready"
            addr = f"unix://{sock_dir}/echo.sock"
            proc = subprocess.Popen([sys.executable, "-m", "kvtier.bench.echo", addr, str(nbytes), str(chunk), str(ready)])
            try:
                wait_ready(Path(ready), proc)
                echo = EchoClient(addr, payload, chunk)
                ctx.advance(1)
                got: dict[str, Any] = {}
                fresh: list[torch.Tensor] = []

                def free_fresh() -> None:  # untimed, before each round: the last round's new pages
                    while fresh:
                        c.free_slots("bench", fresh.pop())

                t = interleaved({
                    "daemon_write": lambda: c.write_kv("bench", slots, latent=latent, index=index),
                    "echo_upload": echo.upload,
                    "daemon_write_new": lambda: fresh.append(c.write_new_kv("bench", latent=latent, index=index)),
                    "daemon_read": lambda: got.__setitem__("kv", c.read_kv("bench", slots)),
                    "echo_download": echo.download,
                }, s["reps"], warmup=s["warmup"], tick=lambda: ctx.advance(1), setup=free_fresh)
                echo.close()
                got["new"] = c.read_kv("bench", fresh[-1])
                free_fresh()
            finally:
                proc.kill()
                proc.wait()
                shutil.rmtree(sock_dir, ignore_errors=True)
            for kv in (got["kv"], got["new"]):
                if not all(torch.equal(kv.latent[x], latent[x]) for x in latent) or \
                        not all(torch.equal(kv.index_k[x], index[x][0]) for x in index):
                    raise RuntimeError("ReadKV returned other bytes than WriteKV wrote")
            c.delete_pool("bench", force=True)
        ctx.advance(1)
        res.comparisons.append(Comparison("daemon.write_vs_echo", "WriteKV into named slots (pages claimed, rows in place with an undo copy: all or nothing) vs echo upload",
                                          "GB/s", throughput("kvtier WriteKV", nbytes, t["daemon_write"]),
                                          throughput("gRPC byte echo upload", nbytes, t["echo_upload"]), target=0.9))
        res.comparisons.append(Comparison("daemon.write_new_vs_echo",
                                          "WriteKV that allocates its pages (write_new_kv: rows land in the new pages as they arrive) vs echo upload",
                                          "GB/s", throughput("kvtier WriteKV allocating", nbytes, t["daemon_write_new"]),
                                          throughput("gRPC byte echo upload", nbytes, t["echo_upload"]), target=0.9))
        res.comparisons.append(Comparison("daemon.read_vs_echo", "ReadKV (consistent snapshot, streamed) vs echo download",
                                          "GB/s", throughput("kvtier ReadKV", nbytes, t["daemon_read"]),
                                          throughput("gRPC byte echo download", nbytes, t["echo_download"]), target=0.9))
        res.figures["seconds"] = t
        return res
