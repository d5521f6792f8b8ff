"""ReadKV responses serialized and WriteKV requests parsed by hand: one copy of a chunk's bytes
instead of three.

protobuf's Python runtime copies a ``bytes`` field into a message when it is built and again when
the message is serialized, on top of the ``bytes`` object the chunk had to be made into first
(per MiB: 72 + 75 + 163 us here; BENCHMARKS.md). A ``ReadKVResponse`` is four scalar fields and the
data, so the daemon writes its wire form itself -- the field tags and varints, then the chunk joined
straight from the gathered array -- and registers ReadKV with an identity serializer
(:func:`with_raw_messages`). The bytes on the wire are what ``ReadKVResponse.SerializeToString``
produces (proto3: fields at their default are left out; checked in the tests), so any client --
protobuf's own parser included -- reads them unchanged. WriteKV's requests are parsed the other
way round (:func:`decode_write_request`, registered as the method's request deserializer): the
header through protobuf, the data left as a view into the received bytes (protobuf's runtime copied
it once at the parse and once more at each read of ``.data``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvtier.protowire import encode_varint, read_varint
from kvtier.v1 import pool_pb2


def encode_read_chunk(layer_id: int, component: int, offset: int, data: memoryview | bytes | Sequence[memoryview]) -> bytes:
    """The wire bytes of ``ReadKVResponse(layer_id, component, offset, data)`` (fields 1-4); ``data``
    may be several buffers, joined into the one field (a packed piece that crosses segments)."""
    parts = (data,) if isinstance(data, (memoryview, bytes, bytearray)) else tuple(data)
    nbytes = sum(len(p) for p in parts)
    head = bytearray()
    if layer_id:
        head += b"\x08" + encode_varint(layer_id)
    if component:
        head += b"\x10" + encode_varint(component)
    if offset:
        head += b"\x18" + encode_varint(offset)
    if nbytes:
        head += b"\x22" + encode_varint(nbytes)
    return b"".join((head, *parts))  # the one copy of the chunk


@dataclass(frozen=True)
class WriteChunk:
    """A ``WriteKVRequest`` read without protobuf's message object (:func:`decode_write_request`):
    ``data`` is a view into the received bytes (no copy)."""

    header: pool_pb2.KVHeader | None
    packed: bool
    layer_id: int
    component: int
    offset: int
    data: memoryview
    allocate_tokens: int = 0


def decode_write_request(buf: bytes) -> WriteChunk:
    """Parse a serialized ``WriteKVRequest`` as protobuf would (fields 1-7; unknown fields and
    fields of another wire type skipped, the last value of a repeated scalar kept, header
    occurrences merged), the data left as a view into ``buf``.

    Raises:
        ValueError: truncated, a bad varint or an unknown wire type (gRPC's request deserializer;
            the method then answers INVALID_ARGUMENT).
    """
    header: pool_pb2.KVHeader | None = None
    packed, layer, comp, offset, data, allocate = False, 0, 0, 0, memoryview(b""), 0
    view = memoryview(buf)
    i, n = 0, len(buf)
    while i < n:
        key, i = read_varint(buf, i)
        field, wt = key >> 3, key & 7
        if wt == 0:
            v, i = read_varint(buf, i)
            if field == 2:
                layer = v & 0xFFFFFFFF
            elif field == 3:
                comp = v & 0xFFFFFFFF
                comp = comp - (1 << 32) if comp >= 1 << 31 else comp  # an int32 enum
            elif field == 4:
                offset = v
            elif field == 6:
                packed = v != 0
            elif field == 7:
                allocate = v
        elif wt == 2:
            ln, i = read_varint(buf, i)
            if i + ln > n:
                raise ValueError("truncated length-delimited field")
            if field == 5:
                data = view[i:i + ln]
            elif field == 1:
                header = header or pool_pb2.KVHeader()
                header.MergeFromString(view[i:i + ln].tobytes())
            i += ln
        elif wt == 1:
            i += 8
        elif wt == 5:
            i += 4
        else:
            raise ValueError(f"unsupported wire type {wt}")
        if i > n:
            raise ValueError("truncated fixed-width field")
    return WriteChunk(header, packed, layer, comp, offset, data, allocate)


def with_raw_messages(add_to_server: Callable[[Any, grpc.Server], None], responses: Iterable[str] = (),
                      requests: Mapping[str, Callable[[bytes], Any]] | None = None) -> Callable[[Any, grpc.Server], None]:
    """A generated ``add_XServicer_to_server`` whose ``responses`` methods (server streams) send what
    the servicer yields as is (already serialized bytes) and whose ``requests`` methods (client
    streams) read their requests with the given deserializer; every other method keeps its
    generated handler.

    Raises:
        RuntimeError: the generated function did not register its handlers by method name (a
            grpcio-tools version that kvtier's stubs are not generated with).
    """
    raw, readers = set(responses), dict(requests or {})

    def add(servicer: Any, server: grpc.Server) -> None:
        rec = _Recorder()
        add_to_server(servicer, rec)  # type: ignore[arg-type]
        missing = (raw | set(readers)) - set(rec.handlers)
        if not rec.handlers or missing:
            raise RuntimeError(f"the generated stubs registered no handlers for {sorted(missing)}")
        handlers = dict(rec.handlers)
        for name in raw:
            h = handlers[name]
            if not h.unary_stream:
                raise RuntimeError(f"{name} is not a server-streaming method")
            handlers[name] = grpc.unary_stream_rpc_method_handler(h.unary_stream, request_deserializer=h.request_deserializer,
                                                                  response_serializer=None)
        for name, reader in readers.items():
            h = handlers[name]
            if not h.stream_unary:
                raise RuntimeError(f"{name} is not a client-streaming method")
            handlers[name] = grpc.stream_unary_rpc_method_handler(h.stream_unary, request_deserializer=reader,
                                                                  response_serializer=h.response_serializer)
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
