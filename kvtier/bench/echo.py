"""A plain gRPC bytes echo service, the daemon data path's baseline (``python -m kvtier.bench.echo``).

``Upload`` (client stream of raw bytes -> their count) and ``Download`` (n bytes in chunks), generic
handlers with no protobuf messages: only what gRPC itself costs, in a process with the daemon's glibc
malloc settings (:func:`~kvtier.server.hostmem.malloc.keep_freed_memory`, which the daemon sets at
start) so that neither side refaults its message buffers. Run as its own process:
``python -m kvtier.bench.echo ADDRESS PAYLOAD_BYTES CHUNK_BYTES READY_FILE`` (serves until killed).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

from kvtier.server.hostmem.malloc import keep_freed_memory

SERVICE = "kvtierbench.Echo"
OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def serve(address: str, payload_bytes: int, chunk: int, ready: str) -> None:
    keep_freed_memory()  # the daemon's malloc settings (server/hostmem/malloc.py): the same process, minus kvtier
    data = np.random.default_rng(0).integers(0, 256, payload_bytes, dtype=np.uint8).tobytes()
    view = memoryview(data)

    sink = bytearray(payload_bytes)  # reused and faulted in once, as the daemon's staging (a host-arena block)

    def upload(request_iterator, context):
        total = 0
        for msg in request_iterator:
            sink[total:total + len(msg)] = msg
            total += len(msg)
        return total.to_bytes(8, "little")

    def download(request, context):
        n = int.from_bytes(request, "little")
        for off in range(0, n, chunk):
            yield bytes(view[off:off + chunk])

    server = grpc.server(ThreadPoolExecutor(4), options=OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Upload": grpc.stream_unary_rpc_method_handler(upload),
        "Download": grpc.unary_stream_rpc_method_handler(download),
    }),))
    server.add_insecure_port(address)
    server.start()
    Path(ready).write_text(address)
    server.wait_for_termination()


class EchoClient:
    """Times one upload and one download of ``payload`` through the echo service at ``address``."""

    def __init__(self, address: str, payload: bytes, chunk: int) -> None:
        self.channel = grpc.insecure_channel(address, options=OPTIONS)
        self.upload_rpc = self.channel.stream_unary(f"/{SERVICE}/Upload")
        self.download_rpc = self.channel.unary_stream(f"/{SERVICE}/Download")
        self.payload, self.chunk = payload, chunk
        self.out = np.empty(len(payload), dtype=np.uint8)

    def upload(self) -> None:
        view = memoryview(self.payload)
        n = int.from_bytes(self.upload_rpc((bytes(view[o:o + self.chunk]) for o in range(0, len(view), self.chunk)),
                                           timeout=600), "little")
        if n != len(self.payload):
            raise RuntimeError(f"echo upload counted {n} bytes of {len(self.payload)}")

    def download(self) -> None:
        off = 0
        for msg in self.download_rpc(len(self.payload).to_bytes(8, "little"), timeout=600):
            self.out[off:off + len(msg)] = np.frombuffer(msg, dtype=np.uint8)
            off += len(msg)
        if off != len(self.payload):
            raise RuntimeError(f"echo download got {off} bytes of {len(self.payload)}")

    def close(self) -> None:
        self.channel.close()


def wait_ready(ready: Path, proc, timeout_s: float = 60.0) -> None:
    """Wait until the server wrote ``ready`` (raise if the process died or it took too long)."""
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"echo server exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError("echo server did not start")
        time.sleep(0.05)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
