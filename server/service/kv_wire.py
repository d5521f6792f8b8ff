"""ReadKV responses serialized by hand: one copy of a chunk's bytes instead of three.

protobuf's Python runtime copies a ``bytes`` field into a message when it is built and again when
the message is serialized, on top of the ``bytes`` object the chunk had to be made into first
(per MiB: 72 + 75 + 163 us here; BENCHMARKS.md). A ``ReadKVResponse`` is four scalar fields and the
data, so the daemon writes its wire form itself -- the field tags and varints, then the chunk joined
straight from the gathered array -- and registers ReadKV with an identity serializer
(:func:`with_raw_responses`). The bytes on the wire are what ``ReadKVResponse.SerializeToString``
produces (proto3: fields at their default are left out; checked in the tests), so any client --
protobuf's own parser included -- reads them unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import grpc


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_read_chunk(layer_id: int, component: int, offset: int, data: memoryview | bytes) -> bytes:
    """The wire bytes of ``ReadKVResponse(layer_id, component, offset, data)`` (fields 1-4)."""
    head = bytearray()
    if layer_id:
        head += b"\x08" + _varint(layer_id)
    if component:
        head += b"\x10" + _varint(component)
    if offset:
        head += b"\x18" + _varint(offset)
    if len(data):
        head += b"\x22" + _varint(len(data))
    return b"".join((head, data))  # the one copy of the chunk


def with_raw_responses(add_to_server: Callable[[Any, grpc.Server], None], methods: Iterable[str]) -> Callable[[Any, grpc.Server], None]:
    """A generated ``add_XServicer_to_server`` whose ``methods`` send what the servicer yields as is
    (already serialized bytes); every other method keeps its generated handler.

    Raises:
        RuntimeError: the generated function did not register its handlers by method name (a
            grpcio-tools version that kvtier's stubs are not generated with).
    """
    raw = set(methods)

    def add(servicer: Any, server: grpc.Server) -> None:
        rec = _Recorder()
        add_to_server(servicer, rec)  # type: ignore[arg-type]
        if not rec.handlers or not raw <= set(rec.handlers):
            raise RuntimeError(f"the generated stubs registered no handlers for {sorted(raw - set(rec.handlers))}")
        handlers = dict(rec.handlers)
        for name in raw:
            h = handlers[name]
            if not h.unary_stream:
                raise RuntimeError(f"{name} is not a server-streaming method")
            handlers[name] = grpc.unary_stream_rpc_method_handler(h.unary_stream, request_deserializer=h.request_deserializer,
                                                                  response_serializer=None)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(rec.service, handlers),))
        server.add_registered_method_handlers(rec.service, handlers)

    return add


class _Recorder:
    """Stands in for a server while a generated function registers its handlers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers come by name below

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.service, self.handlers = service, dict(handlers)
