"""KV write/read throughput through the kvtier daemon vs a plain gRPC bytes-streaming echo service.

Both servers run as their own processes on unix sockets, both streams use the same chunk size; the
echo service only moves bytes (client-streaming upload, server-streaming download, no protobuf
payload parsing beyond the bytes), so the ratio is what kvtier's KV handling costs on top of gRPC.

    .venv/bin/python benchmarks/bench_daemon_io.py [--tokens 4096] [--layers 78] [--repeat 5] [--chunk-mib 1] [--json out.json]

The payload is a GLM-5.2-shaped request (fp8: 656-byte latent rows on every layer, 132 indexer bytes
a token on the 21 live layers of 78): all of its latent rows and live-layer keys+scales.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import torch

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess

ECHO_SERVICE = "kvtierbench.Echo"


# ----- the plain echo service -------------------------------------------------------------------
def run_echo_server(address: str, payload_bytes: int, chunk: int, ready: str) -> None:
    """Serve Upload (stream of bytes -> total count) and Download (n bytes in chunks) until killed."""
    data = np.random.default_rng(0).integers(0, 256, payload_bytes, dtype=np.uint8).tobytes()
    view = memoryview(data)

    def upload(request_iterator, context):
        total = 0
        sink = bytearray(payload_bytes)
        for msg in request_iterator:
            sink[total:total + len(msg)] = msg
            total += len(msg)
        return total.to_bytes(8, "little")

    def download(request, context):
        n = int.from_bytes(request, "little")
        for off in range(0, n, chunk):
            yield bytes(view[off:off + chunk])

    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    server = grpc.server(ThreadPoolExecutor(4), options=opts)
    handler = grpc.method_handlers_generic_handler(ECHO_SERVICE, {
        "Upload": grpc.stream_unary_rpc_method_handler(upload),
        "Download": grpc.unary_stream_rpc_method_handler(download),
    })
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(address)
    server.start()
    Path(ready).write_text(address)
    server.wait_for_termination()


def echo_round(address: str, payload: bytes, chunk: int) -> tuple[float, float]:
    """Seconds to upload and to download ``payload`` through the echo service."""
    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(address, options=opts) as ch:
        upload = ch.stream_unary(f"/{ECHO_SERVICE}/Upload")
        download = ch.unary_stream(f"/{ECHO_SERVICE}/Download")
        view = memoryview(payload)
        t0 = time.perf_counter()
        n = int.from_bytes(upload((bytes(view[o:o + chunk]) for o in range(0, len(payload), chunk)), timeout=600), "little")
        t1 = time.perf_counter()
        assert n == len(payload)
        out = np.empty(len(payload), dtype=np.uint8)
        off = 0
        for msg in download(len(payload).to_bytes(8, "little"), timeout=600):
            out[off:off + len(msg)] = np.frombuffer(msg, dtype=np.uint8)
            off += len(msg)
        t2 = time.perf_counter()
        assert off == len(payload)
    return t1 - t0, t2 - t1


# ----- the daemon -------------------------------------------------------------------------------
def daemon_round(c: KVTierClient, pool: str, slots: torch.Tensor, latent, index) -> tuple[float, float, int]:
    """Seconds to write and to read the request's KV through the daemon, and its bytes."""
    t0 = time.perf_counter()
    n = c.write_kv(pool, slots, latent=latent, index=index)
    t1 = time.perf_counter()
    kv = c.read_kv(pool, slots)
    t2 = time.perf_counter()
    layer = next(iter(latent))
    assert torch.equal(kv.latent[layer], latent[layer])
    return t1 - t0, t2 - t1, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=78, help="first N layers of GLM-5.2")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--chunk-mib", type=float, nargs="+", default=[1.0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--echo-server", nargs=4, metavar=("ADDR", "BYTES", "CHUNK", "READY"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.echo_server:
        run_echo_server(a.echo_server[0], int(a.echo_server[1]), int(a.echo_server[2]), a.echo_server[3])
        return

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    results = []
    with DaemonProcess(extra_args=["--device", "cpu", "--log-level", "WARNING", "--max-message-bytes", "8MiB"]) as d:
        for chunk_mib in a.chunk_mib:
            chunk = int(chunk_mib * (1 << 20))
            with KVTierClient(d.address, timeout=600, max_message_bytes=8 << 20, chunk_bytes=chunk) as c:
                pool = f"bench-{chunk}"
                info = c.create_pool("glm-5.2", num_layers=a.layers, size_tokens=-(-a.tokens // 64) * 64, pool_id=pool)
                slots = c.allocate_slots(pool, a.tokens)
                latent = {l: torch.randint(0, 256, (a.tokens, 656), dtype=torch.uint8, generator=g) for l in range(a.layers)}
                index = {l: (torch.randint(0, 256, (a.tokens, 128), dtype=torch.uint8, generator=g), torch.rand(a.tokens, generator=g))
                         for l in info.live_layers}
                nbytes = daemon_round(c, pool, slots, latent, index)[2]  # warm-up, and the payload size
                payload = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
                with tempfile.TemporaryDirectory() as tmp:
                    addr, ready = f"unix://{tmp}/echo.sock", f"{tmp}/ready"
                    proc = subprocess.Popen([sys.executable, __file__, "--echo-server", addr, str(nbytes), str(chunk), ready])
                    try:
                        while not Path(ready).exists():
                            assert proc.poll() is None, "echo server died"
                            time.sleep(0.05)
                        echo_round(addr, payload, chunk)  # warm-up
                        rounds, echo = [], []
                        for _ in range(a.repeat):  # interleaved, so both see the same machine load
                            rounds.append(daemon_round(c, pool, slots, latent, index))
                            echo.append(echo_round(addr, payload, chunk))
                    finally:
                        proc.kill()
                        proc.wait()
                c.delete_pool(pool, force=True)
            def gbps(secs: list[float], nbytes: int = nbytes) -> float:
                return nbytes / statistics.median(secs) / 1e9

            r = {
                "chunk_bytes": chunk, "payload_bytes": nbytes, "tokens": a.tokens, "layers": a.layers,
                "live_layers": len(info.live_layers), "repeat": a.repeat,
                "daemon_write_GBps": gbps([x[0] for x in rounds]), "daemon_read_GBps": gbps([x[1] for x in rounds]),
                "echo_upload_GBps": gbps([x[0] for x in echo]), "echo_download_GBps": gbps([x[1] for x in echo]),
            }
            r["write_ratio"] = r["daemon_write_GBps"] / r["echo_upload_GBps"]
            r["read_ratio"] = r["daemon_read_GBps"] / r["echo_download_GBps"]
            results.append(r)
    print(f"payload: {results[0]['payload_bytes']:,} bytes ({a.tokens} tokens, GLM-5.2 first {a.layers} layers, "
          f"{results[0]['live_layers']} with indexer), unix socket, median of {a.repeat}")
    print(f"{'chunk':>9} {'daemon write':>13} {'echo upload':>12} {'ratio':>6} {'daemon read':>12} {'echo download':>14} {'ratio':>6}")
    for r in results:
        print(f"{r['chunk_bytes'] / (1 << 20):7.2f}Mi {r['daemon_write_GBps']:10.3f}GB/s {r['echo_upload_GBps']:9.3f}GB/s "
              f"{r['write_ratio']:6.2f} {r['daemon_read_GBps']:9.3f}GB/s {r['echo_download_GBps']:11.3f}GB/s {r['read_ratio']:6.2f}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
