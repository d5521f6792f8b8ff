"""ReadKV responses read without protobuf's message objects: the chunk's bytes are copied once.

protobuf's Python runtime copies a ``bytes`` field out of the parsed message on every read of it, on
top of the parse (per MiB: 71 + 75 us here; BENCHMARKS.md). ReadKV's responses are four scalar
fields and the data, so the client takes them raw (no deserializer) and walks the wire format
itself: field tags and varints, the data as a view into the received bytes. Unknown fields are
skipped as protobuf would; a malformed message raises ValueError.
"""

from __future__ import annotations


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("ReadKVResponse: truncated or overlong varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def decode_read_chunk(buf: bytes) -> tuple[int, int, int, memoryview]:
    """``(layer_id, component, offset, data)`` of a serialized ``ReadKVResponse`` (fields 1-4); ``data``
    is a view into ``buf`` (no copy). Missing fields are 0 / empty, as in protobuf.

    Raises:
        ValueError: a truncated message or a wire type protobuf would not accept.
    """
    layer = comp = offset = 0
    data = memoryview(b"")
    view = memoryview(buf)
    i, n = 0, len(buf)
    while i < n:
        key, i = _varint(buf, i)
        field, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(buf, i)
            if field == 1:
                layer = v & 0xFFFFFFFF
            elif field == 2:
                comp = v
            elif field == 3:
                offset = v
        elif wt == 2:
            ln, i = _varint(buf, i)
            if i + ln > n:
                raise ValueError("ReadKVResponse: truncated length-delimited field")
            if field == 4:
                data = view[i:i + ln]
            i += ln
        elif wt == 1:
            i += 8
        elif wt == 5:
            i += 4
        else:
            raise ValueError(f"ReadKVResponse: unsupported wire type {wt}")
    if i != n:
        raise ValueError("ReadKVResponse: truncated fixed-width field")
    return layer, comp, offset, data
