"""Pure-Python stand-in for ``_recordio`` (the disk tier's window read, ``_recordio.c``), used where
the extension was not built (:mod:`kvtier.native`): the same calls, codes and errors, through numpy
copies and the ``xxhash`` package (the checksum streamed with the field read as zeros, as
``record.verify_record`` computes it). Slower: a copy and a separate hash pass per record, with the
GIL held between them."""

from __future__ import annotations

import struct

import numpy as np
import xxhash

FUSED_COPY_HASH = 0
"""The one-pass copy and hash is native only."""

NONE_SOURCE, ERR_SHORT, ERR_MAGIC, ERR_VERSION, ERR_LENGTH, ERR_SRC_LOC, ERR_CHECKSUM = -1, -2, -3, -4, -5, -6, -7

_FIXED = struct.Struct("<4sHHIIIIQQQQ")  # record.py's header; the checksum in its last 8 bytes
_FIXED_BYTES, _CHECKSUM_AT, _ALIGN, _VERSION = 56, 48, 64, 1
_ZERO = bytes(8)


def _src(buf: object) -> np.ndarray:
    view = memoryview(buf)  # type: ignore[arg-type]
    if not view.c_contiguous:
        raise BufferError("a C-contiguous source buffer is needed")
    return np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, dtype=np.uint8)


def _dst(buf: object) -> np.ndarray:
    view = memoryview(buf)  # type: ignore[arg-type]
    if view.readonly or not view.c_contiguous:
        raise BufferError("a writable C-contiguous destination buffer is needed")
    return np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, dtype=np.uint8)


def _hash_zeroed(data: np.ndarray) -> int:
    h = xxhash.xxh3_64(data[:_CHECKSUM_AT])
    h.update(_ZERO)
    h.update(data[_FIXED_BYTES:])
    return h.intdigest()


def _copy_one(dst: np.ndarray, src: np.ndarray, verify: bool) -> int:
    n = src.size
    if not verify:
        dst[:n] = src
        return 0
    if n < _FIXED_BYTES:
        return ERR_SHORT
    magic, version, _, n_tokens, _, num_layers, fp_len, lat, idx, srcb, stored = _FIXED.unpack_from(src, 0)
    if magic != b"KVTR":
        return ERR_MAGIC
    if version != _VERSION:
        return ERR_VERSION
    header = (_FIXED_BYTES + fp_len + num_layers + _ALIGN - 1) // _ALIGN * _ALIGN
    if lat > n or idx > n or srcb > n or header + lat + idx + srcb != n:
        return ERR_LENGTH
    if srcb != 8 * n_tokens:
        return ERR_SRC_LOC
    dst[:n] = src
    return n_tokens if _hash_zeroed(dst[:n]) == stored else ERR_CHECKSUM


def copy_check(srcs: list, dsts: list, verify: bool) -> list[int]:
    """Copy each record of ``srcs`` into ``dsts`` (None: no record) and, with ``verify``, check it.

    Returns:
        One int per record: ``n_tokens`` (0 without ``verify``), :data:`NONE_SOURCE`, or a negative
        ``ERR_*`` code (the destination then holds the copied bytes, or nothing for a bad header).

    Raises:
        ValueError: lists of different lengths, or a destination smaller than its record (before
            anything is copied).
        BufferError: a buffer that is not contiguous (or a destination that is not writable), as
            the native module's buffer requests raise.
    """
    srcs, dsts = list(srcs), list(dsts)
    if len(srcs) != len(dsts):
        raise ValueError(f"copy_check got {len(srcs)} sources but {len(dsts)} destinations")
    pairs: list[tuple[np.ndarray, np.ndarray] | None] = []
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        if s is None:
            pairs.append(None)
            continue
        sa, da = _src(s), _dst(d)
        if da.size < sa.size:
            raise ValueError(f"destination {i} holds {da.size} bytes, too small for its {sa.size}-byte record")
        pairs.append((sa, da))
    return [NONE_SOURCE if p is None else _copy_one(p[1], p[0], bool(verify)) for p in pairs]


def xxh3_64(data: object) -> int:
    """xxh3_64 of a buffer's bytes."""
    return xxhash.xxh3_64_intdigest(_src(data))


def copy_xxh3(dst: object, src: object) -> int:
    """Copy ``src`` into ``dst`` and return xxh3_64 of the copy with the checksum field (bytes 48-55)
    read as zeros.

    Raises:
        ValueError: ``dst`` smaller than ``src``, or ``src`` shorter than the 56-byte header.
    """
    s, d = _src(src), _dst(dst)
    if d.size < s.size:
        raise ValueError(f"destination holds {d.size} bytes, too small for {s.size}")
    if s.size < _FIXED_BYTES:
        raise ValueError(f"copy_xxh3 needs at least {_FIXED_BYTES} bytes, got {s.size}")
    d[:s.size] = s
    return _hash_zeroed(d[:s.size])
