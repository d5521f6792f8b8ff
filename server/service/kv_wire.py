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

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_read_chunk(layer_id: int, component: int, offset: int, data: memoryview | bytes | Sequence[memoryview]) -> bytes:
    """The wire bytes of ``ReadKVResponse(layer_id, component, offset, data)`` (fields 1-4); ``data``
    may be several buffers, joined into the one field (a packed piece that crosses segments)."""
    parts = (data,) if isinstance(data, (memoryview, bytes, bytearray)) else tuple(data)
    nbytes = sum(len(p) for p in parts)
    head = bytearray()
    if layer_id:
        head += b"\x08" + _varint(layer_id)
    if component:
        head += b"\x10" + _varint(component)
    if offset:
        head += b"\x18" + _varint(offset)
    if nbytes:
        head += b"\x22" + _varint(nbytes)
    return b"".join((head, *parts))  # the one copy of the chunk


def segment_pieces(segments: Iterable[tuple[int, int, memoryview]], chunk: int) -> Iterator[tuple[int, int, int, memoryview]]:
    """ReadKV's first form: ``(layer_id, component, offset in segment, data)`` of each message, each
    segment ``(layer_id, component, bytes)`` cut into pieces of at most ``chunk`` bytes."""
    for layer_id, comp, view in segments:
        for off in range(0, len(view), chunk):
            yield layer_id, comp, off, view[off:off + chunk]


def packed_pieces(segments: Iterable[memoryview], chunk: int) -> Iterator[tuple[int, list[memoryview]]]:
    """ReadKV's packed form: ``(offset in the whole stream, data parts)`` of each message, the
    segments' bytes in order cut into full ``chunk``-byte messages (the last one shorter) that run
    across segment boundaries."""
    parts: list[memoryview] = []
    have = start = 0
    for view in segments:
        pos = 0
        while pos < len(view):
            take = min(chunk - have, len(view) - pos)
            parts.append(view[pos:pos + take])
            have += take
            pos += take
            if have == chunk:
                yield start, parts
                start += have
                parts, have = [], 0
    if have:
        yield start, parts


def read_responses(segments: Iterable[tuple[int, int, memoryview]], chunk: int, *, packed: bool) -> Iterator[bytes]:
    """The wire bytes of each ``ReadKVResponse`` of a read of ``segments`` (``(layer_id, component,
    bytes)`` in stream order), ``chunk`` data bytes a message: one message sequence a segment, or
    ``packed``: the segments as one stream of full messages (see ``ReadKVResponse`` in pool.proto)."""
    if packed:
        for off, parts in packed_pieces((v for _, _, v in segments), chunk):
            yield encode_read_chunk(0, 0, off, parts)
    else:
        for layer_id, comp, off, piece in segment_pieces(segments, chunk):
            yield encode_read_chunk(layer_id, comp, off, piece)


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
