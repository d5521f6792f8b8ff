"""ReadKV responses read and WriteKV requests written without protobuf's message objects: the
chunk's bytes are copied once, into a receive buffer that is used again once the caller drops the
result (:class:`ReceiveBuffers`), or into the request's wire bytes (:func:`encode_write_chunk`).

protobuf's Python runtime copies a ``bytes`` field out of the parsed message on every read of it, on
top of the parse (per MiB: 71 + 75 us here; BENCHMARKS.md). ReadKV's responses are four scalar
fields and the data, so the client takes them raw (no deserializer) and walks the wire format
itself: field tags and varints, the data as a view into the received bytes. Unknown fields are
skipped as protobuf would; a malformed message raises ValueError.
"""

from __future__ import annotations

import weakref
from collections import deque

import numpy as np
import torch

from kvtier.protowire import encode_varint, read_varint


def encode_write_chunk(layer_id: int, component: int, offset: int, parts: list[memoryview], *, packed: bool = False,
                       header: bytes | None = None, allocate_tokens: int = 0) -> bytes:
    """The wire bytes of ``WriteKVRequest(header, layer_id, component, offset, data, packed,
    allocate_tokens)`` with ``data`` the ``parts`` joined (the one copy of the chunk; ``header`` a
    serialized ``KVHeader``), exactly what protobuf's ``SerializeToString`` writes (fields in number
    order, defaults left out)."""
    nbytes = sum(len(p) for p in parts)
    head = bytearray()
    if header is not None:
        head += b"\x0a" + encode_varint(len(header)) + header
    if layer_id:
        head += b"\x10" + encode_varint(layer_id)
    if component:
        head += b"\x18" + encode_varint(component)
    if offset:
        head += b"\x20" + encode_varint(offset)
    if nbytes:
        head += b"\x2a" + encode_varint(nbytes)
    tail = b"\x30\x01" if packed else b""
    if allocate_tokens:
        tail += b"\x38" + encode_varint(allocate_tokens)
    return b"".join((head, *parts, tail))


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    return read_varint(buf, i, "ReadKVResponse: ")


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


class ReceiveBuffers:
    """Host buffers ReadKV results are received into, used again once a result is dropped.

    A fresh buffer of a 100 MB read is page-faulted as the bytes arrive (~27 ms of a 110 MB read
    here, 15% of it; BENCHMARKS.md, fix 7); a result's tensors are views of one buffer, and when the
    caller has dropped all of them the buffer is kept for the next read of the same size (a
    finalizer on the array the tensors' storage holds). At most ``keep`` buffers and ``max_bytes`` are kept;
    a buffer is never handed out while any view of it is alive.

    Thread safety: frees come from whichever thread drops the last view; the free list is a deque
    (atomic appends and pops) and a read takes a buffer with one pop, so no lock is needed.
    """

    def __init__(self, keep: int = 2, max_bytes: int = 1 << 30) -> None:
        self.keep, self.max_bytes = keep, max_bytes
        self._free: deque[np.ndarray] = deque()

    def take(self, nbytes: int) -> torch.Tensor:
        """A ``(nbytes,)`` uint8 host tensor: a kept buffer of exactly that size, or a new one. Every
        view of it -- torch views, ``.numpy()`` and numpy views of that -- keeps it from reuse."""
        base = None
        for _ in range(len(self._free)):
            try:
                cand = self._free.popleft()
            except IndexError:
                break
            if cand.size == nbytes:
                base = cand
                break
            self._free.append(cand)  # another size: kept for its own reads
        if base is None:
            base = np.empty(nbytes, dtype=np.uint8)
        view = base[:]  # held only by the tensor's storage; the base is reachable only from the finalizer
        weakref.finalize(view, self._give_back, base)
        return torch.from_numpy(view)

    def _give_back(self, base: np.ndarray) -> None:
        if base.size <= self.max_bytes and len(self._free) < self.keep and \
                sum(b.size for b in list(self._free)) + base.size <= self.max_bytes:
            self._free.append(base)
