"""Protobuf wire-format varints, shared by the client and the daemon where they write or walk a
message's bytes themselves (``client/wire.py``, ``server/service/kv_wire.py``; no server imports here)."""

from __future__ import annotations


def encode_varint(n: int) -> bytes:
    """``n`` (>= 0) as a base-128 varint, as protobuf writes it."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def read_varint(buf: bytes | memoryview, i: int, what: str = "") -> tuple[int, int]:
    """The varint at ``buf[i:]`` and the index after it.

    Raises:
        ValueError: ``what`` + "truncated or overlong varint" (past the end, or more than 64 bits).
    """
    shift = value = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError(f"{what}truncated or overlong varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
