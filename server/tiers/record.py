"""The tier record: one unit of KV that lives and dies together, with a self-checking header.

A record holds a page (or a whole request's copy) exactly as :meth:`DSATokenToKVPool.get_cpu_copy`
lays it out: the latent rows of every layer AND the indexer page rows (FP8 keys + FP32 scales) of the
live layers only, then the source slots. Latent and indexer data are never stored, evicted or read
apart, so a prefix can never come back with a stale indexer (DESIGN.md, known faults).

Byte layout (little-endian; ``payload`` starts 64-byte aligned so it can be viewed as int64 words)::

    fixed   56 B  magic "KVTR", format version u16, flags u16, n_tokens u32, n_pages u32,
                  num_layers u32, fingerprint length u32, latent bytes u64, index bytes u64,
                  src_loc bytes u64, checksum u64 (xxh3_64)
    meta         model fingerprint (canonical JSON: name, layer count, skip mask, dtypes, page size),
                  then the layer mask: num_layers bytes, 1 where the record holds indexer data
    pad          zeros up to a multiple of 64
    payload      latent: (num_layers, n_tokens, latent_row_bytes)
                  index:  (live layers, n_pages, index_page_bytes)
                  src_loc: (n_tokens,) int64 source slots (where in the pages each token lies)

The checksum is xxh3_64 over the fixed part (checksum field zero), meta and payload, so a flipped byte
anywhere is caught. Readers treat any failed check as a miss, count it and log it; they never hand
the bytes out.
"""

from __future__ import annotations

import ctypes
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import INDEX_CHUNK_PAGES, KV_CHUNK_SLOTS, DSATokenToKVPool, first_appearance_pages
from kvtier.server.tiers.errors import RecordError

MAGIC = b"KVTR"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHHIIIIQQQQ")  # server/tiers/_recordio.c (the disk tier's reads) checks these fields too
_CHECKSUM_AT = _FIXED.size - 8
CHECKSUM_OFFSET = _CHECKSUM_AT
"""Byte offset of a record's checksum field (8 bytes, xxh3_64; the disk tier binds it to the record's key)."""
_ALIGN = 64
_memmove = ctypes.memmove


@dataclass(frozen=True)
class RecordInfo:
    """What a record's header says: ``n_tokens`` tokens on ``n_pages`` pages, ``nbytes`` in all."""

    n_tokens: int
    n_pages: int
    nbytes: int
    header_nbytes: int
    latent_nbytes: int
    index_nbytes: int


def _parse_fixed(buf: np.ndarray) -> tuple[Any, ...]:
    if buf.size < _FIXED.size:
        raise RecordError(f"record of {buf.size} bytes is shorter than its {_FIXED.size}-byte header")
    fields = _FIXED.unpack_from(buf, 0)
    if fields[0] != MAGIC:
        raise RecordError(f"bad record magic {fields[0]!r}")
    if fields[1] != FORMAT_VERSION:
        raise RecordError(f"record format version {fields[1]} is not the supported {FORMAT_VERSION}")
    return fields


_ZERO_CHECKSUM = bytes(8)


def _checksum(buf: np.ndarray, header_nbytes: int, end: int) -> int:
    """xxh3_64 of ``buf[:end]`` with the checksum field read as zeros (streamed: no copy)."""
    h = xxhash.xxh3_64(buf[:_CHECKSUM_AT])
    h.update(_ZERO_CHECKSUM)
    h.update(buf[_FIXED.size:end])
    return h.intdigest()


def verify_record(buf: torch.Tensor | np.ndarray | bytes | memoryview, *, checksum: bool = True) -> RecordInfo:
    """Check a record's magic, version, lengths and checksum (not the model): the startup scrub.
    ``checksum=False`` skips the hash (for bytes a tier verified as it read them).

    Raises:
        RecordError: naming the failed check.
    """
    arr = _as_array(buf)
    _, _, _, n_tokens, n_pages, num_layers, fp_len, lat, idx, src, stored = _parse_fixed(arr)
    header = _header_nbytes(fp_len, num_layers)
    total = header + lat + idx + src
    if arr.size != total:
        raise RecordError(f"record holds {arr.size} bytes but its header accounts for {total}")
    if src != 8 * n_tokens:
        raise RecordError(f"record src_loc holds {src} bytes for {n_tokens} tokens")
    if checksum and _checksum(arr, header, total) != stored:
        raise RecordError("record checksum (xxh3_64) mismatch: the record is damaged")
    return RecordInfo(n_tokens, n_pages, total, header, lat, idx)


def read_header(buf: torch.Tensor | np.ndarray | bytes | memoryview, *,
                checksum: bool = True) -> tuple[DSAModelConfig, tuple[bool, ...], RecordInfo]:
    """Verify a record (:func:`verify_record`; ``checksum=False``: all but the hash) and read the
    model and layer mask its header names.

    Returns:
        ``(model, indexer_layers, info)``: ``RecordCodec(model, indexer_layers)`` decodes it.

    Raises:
        RecordError: a failed check or a header that names no valid model.
    """
    arr = _as_array(buf)
    info = verify_record(arr, checksum=checksum)
    fp_len, num_layers = _FIXED.unpack_from(arr, 0)[6], _FIXED.unpack_from(arr, 0)[5]
    meta = arr[_FIXED.size:_FIXED.size + fp_len + num_layers].tobytes()
    try:
        return model_from_fingerprint(json.loads(meta[:fp_len])), tuple(b == 1 for b in meta[fp_len:]), info
    except (ValueError, KeyError, TypeError) as e:
        raise RecordError(f"record header names no valid model: {e}") from None


def model_from_fingerprint(fp: dict[str, Any]) -> DSAModelConfig:
    """The :class:`DSAModelConfig` a :meth:`DSAModelConfig.fingerprint` dict describes.

    Raises:
        ValueError/KeyError: a missing or invalid field.
    """
    return DSAModelConfig(
        name=str(fp["name"]), num_layers=int(fp["num_layers"]), kv_lora_rank=int(fp["kv_lora_rank"]),
        qk_rope_head_dim=int(fp["qk_rope_head_dim"]), index_head_dim=int(fp["index_head_dim"]),
        kv_cache_dtype=str(fp["kv_cache_dtype"]), page_size=int(fp["page_size"]),
        skip_topk_layers=tuple(c == "S" for c in str(fp["skip_mask"])), start_layer=int(fp["start_layer"]),
    )


def _as_array(buf: Any) -> np.ndarray:
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.device.type != "cpu":
            raise RecordError("a record must be a 1-D uint8 host tensor")
        return buf.numpy()
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def _header_nbytes(fp_len: int, num_layers: int) -> int:
    raw = _FIXED.size + fp_len + num_layers
    return -(-raw // _ALIGN) * _ALIGN


class RecordCodec:
    """Encodes pool slots into records and records back into ``load_cpu_copy`` input, for one model
    fingerprint and one layer mask.

    Args:
        model: the model geometry (its :meth:`DSAModelConfig.fingerprint` goes into every header).
        indexer_layers: ``(num_layers,)`` True where the record carries indexer data (the pool's
            live layers: ``not skip``). Default: the model's live layers (a ``target`` pool).

    Raises:
        ValueError: a mask of the wrong length.
    """

    def __init__(self, model: DSAModelConfig, indexer_layers: tuple[bool, ...] | None = None) -> None:
        mask = tuple(not s for s in model.skip_topk_layers) if indexer_layers is None else tuple(map(bool, indexer_layers))
        if len(mask) != model.num_layers:
            raise ValueError(f"indexer_layers has {len(mask)} entries but the model has {model.num_layers} layers")
        self.model = model
        self.indexer_layers = mask
        self.live_layers = tuple(i for i, m in enumerate(mask) if m)
        self._fp = json.dumps(model.fingerprint(), sort_keys=True, separators=(",", ":")).encode()
        self._mask = bytes(int(m) for m in mask)
        self._meta = self._fp + self._mask
        self.header_nbytes = _header_nbytes(len(self._fp), model.num_layers)
        self.page_size = model.page_size
        self.row_bytes = model.latent_row_bytes
        self.index_page_bytes = model.index_page_bytes
        self.store_dtype = torch.bfloat16 if model.kv_cache_dtype == "bf16" else torch.uint8
        self._one_page: tuple[bytes, Any] | None = None  # see _page_header
        self._page_src = np.arange(self.page_size, dtype=np.int64)

    @classmethod
    def for_pool(cls, model: DSAModelConfig, pool: DSATokenToKVPool) -> RecordCodec:
        """The codec for ``pool``'s layer mask (draft/hisparse pools carry every layer's indexer)."""
        if pool.layer_num != model.num_layers or pool.row_bytes != model.latent_row_bytes or pool.page_size != model.page_size:
            raise ValueError("the pool's geometry differs from the model's")
        return cls(model, tuple(not s for s in pool.skip_topk_layers))

    # ----- sizes --------------------------------------------------------------------------------
    def latent_nbytes(self, n_tokens: int) -> int:
        """``num_layers * n_tokens * latent_row_bytes``."""
        return self.model.num_layers * n_tokens * self.row_bytes

    def index_nbytes(self, n_pages: int) -> int:
        """``live_layers * n_pages * index_page_bytes`` (skip layers: nothing)."""
        return len(self.live_layers) * n_pages * self.index_page_bytes

    def nbytes(self, n_tokens: int, n_pages: int) -> int:
        """Bytes of a record of ``n_tokens`` tokens on ``n_pages`` pages, header included."""
        return self.header_nbytes + self.latent_nbytes(n_tokens) + self.index_nbytes(n_pages) + 8 * n_tokens

    def page_nbytes(self) -> int:
        """Bytes of the record of one full page (what the prefix cache stores per page key)."""
        return self.nbytes(self.page_size, 1)

    # ----- encode -------------------------------------------------------------------------------
    def encode_from_pool(self, pool: DSATokenToKVPool, slots: torch.Tensor, *, pin_memory: bool = False,
                         out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy ``slots`` ``(n,)`` int64 of ``pool`` into a new sealed record (1-D uint8 host tensor).

        The payload is written by ``pool.get_cpu_copy(slots, out=...)`` straight into the record,
        which is ``out[:nbytes]`` when given (e.g. a host tier's :meth:`record_buffer`).

        Raises:
            ValueError/TypeError: bad slots (from the pool).
        """
        slots = torch.as_tensor(slots, dtype=torch.int64).reshape(-1).cpu()
        pages, _ = first_appearance_pages(slots, self.page_size)
        n, p = slots.numel(), pages.numel()
        rec = self._buffer(self.nbytes(n, p), pin_memory, out)
        lat, idx = self.latent_nbytes(n), self.index_nbytes(p)
        start = self.header_nbytes
        pool.get_cpu_copy(slots, out=rec[start:start + lat + idx])
        rec[start + lat + idx:].view(torch.int64).copy_(slots)
        self.seal(rec, n, p)
        return rec

    def seal(self, rec: torch.Tensor, n_tokens: int, n_pages: int) -> None:
        """Write the header and checksum of ``rec`` whose payload (latent, index, src_loc) is in place."""
        arr = rec.numpy()
        fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, 0, n_tokens, n_pages, self.model.num_layers, len(self._fp),
                            self.latent_nbytes(n_tokens), self.index_nbytes(n_pages), 8 * n_tokens, 0)
        arr[:_FIXED.size] = np.frombuffer(fixed, dtype=np.uint8)
        arr[_FIXED.size:_FIXED.size + len(self._meta)] = np.frombuffer(self._meta, dtype=np.uint8)
        arr[_FIXED.size + len(self._meta):self.header_nbytes] = 0
        digest = _checksum(arr, self.header_nbytes, arr.size)
        arr[_CHECKSUM_AT:_FIXED.size] = np.frombuffer(struct.pack("<Q", digest), dtype=np.uint8)

    @staticmethod
    def _buffer(nbytes: int, pin_memory: bool, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
        if out.dtype != torch.uint8 or out.dim() != 1 or out.device.type != "cpu" or not out.is_contiguous() or out.numel() < nbytes:
            raise ValueError(f"out must be a contiguous 1-D uint8 host tensor of at least {nbytes} bytes")
        return out[:nbytes]

    def _page_header(self) -> tuple[bytes, Any]:
        """The header of every one-page record of this codec with its checksum field zero, and an
        xxh3_64 state that has hashed it (a one-page record's checksum is that state over its payload)."""
        if self._one_page is None:
            ps = self.page_size
            fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, 0, ps, 1, self.model.num_layers, len(self._fp),
                                self.latent_nbytes(ps), self.index_nbytes(1), 8 * ps, 0)
            header = fixed + self._meta + b"\0" * (self.header_nbytes - len(fixed) - len(self._meta))
            h = xxhash.xxh3_64()
            h.update(header)
            self._one_page = (header, h)
        return self._one_page

    def encode_page(self, pool: DSATokenToKVPool, page: int, *, pin_memory: bool = False,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """A sealed record of one whole pool page (the prefix cache's unit): the same bytes as
        :meth:`encode_from_pool` of the page's slots, copied as one strided copy per component
        (every layer's rows of that page; every live layer's page row) after a header made once,
        into ``out[:nbytes]`` when given.

        Args:
            out: build the record in the first :meth:`page_nbytes` bytes of this contiguous 1-D uint8
                host tensor (e.g. a transfer engine's registered staging memory) instead of a new one.

        Raises:
            ValueError: ``page`` outside the pool, or ``out`` too small or not a 1-D uint8 host tensor.
        """
        ps = self.page_size
        if not 0 <= page < pool.num_slots // ps or page >= pool.num_pages:
            raise ValueError(f"page {page} is outside the pool")
        header, hashed = self._page_header()
        rec = self._buffer(self.nbytes(ps, 1), pin_memory, out)
        s, lat_n, idx_n = self.header_nbytes, self.latent_nbytes(ps), self.index_nbytes(1)
        L, rb = self.model.num_layers, self.row_bytes
        if not self._copy_page(pool, page, rec.data_ptr(), into_record=True):
            lat_arena, idx_arena = pool.arena("latent"), pool.arena("index_k")
            rec[s:s + lat_n].view(L, ps, rb).copy_(lat_arena.view(L, pool.num_slots, rb)[:, page * ps:(page + 1) * ps])
            if idx_n:
                rows = idx_arena.view(len(self.live_layers), pool.num_pages, self.index_page_bytes)
                rec[s + lat_n:s + lat_n + idx_n].view(len(self.live_layers), self.index_page_bytes).copy_(rows[:, page])
            pool._sync()
        arr = rec.numpy()
        arr[s + lat_n + idx_n:].view(np.int64)[:] = self._page_src + page * ps
        arr[:s] = np.frombuffer(header, dtype=np.uint8)
        h = hashed.copy()
        h.update(memoryview(arr[s:]))
        arr[_CHECKSUM_AT:_FIXED.size] = np.frombuffer(struct.pack("<Q", h.intdigest()), dtype=np.uint8)
        return rec

    def _copy_page(self, pool: DSATokenToKVPool, page: int, rec_addr: int, *, into_record: bool) -> bool:
        """Copy pool page ``page`` (checked by the caller) into the payload of the one-page record at
        address ``rec_addr`` (``into_record``) or back, by one ``memmove`` per layer's latent rows
        and per live layer's indexer page row, when the pool lies in host memory; a torch copy of the
        strided views cost ~25 us more a page (BENCHMARKS.md, fix 14). Returns False (nothing
        copied) for a device pool: the caller copies with torch.

        Layouts: pool latent ``(layers, slots, row_bytes)`` and indexer ``(live, pages, page_bytes)``
        arenas (server/pool/dsa.py); record payload ``(layers, page_size, row_bytes)`` then ``(live,
        page_bytes)`` (this module's docstring)."""
        lat_arena = pool.arena("latent")
        if lat_arena.device.type != "cpu":
            return False
        ps, rb, ipb = self.page_size, self.row_bytes, self.index_page_bytes
        chunk = ps * rb
        rec_at = rec_addr + self.header_nbytes
        pool_at, stride = lat_arena.data_ptr() + page * chunk, pool.num_slots * rb
        for layer in range(self.model.num_layers):
            a, b = rec_at + layer * chunk, pool_at + layer * stride
            _memmove(a, b, chunk) if into_record else _memmove(b, a, chunk)
        if self.live_layers:
            rec_at += self.latent_nbytes(ps)
            pool_at, stride = pool.arena("index_k").data_ptr() + page * ipb, pool.num_pages * ipb
            for pos in range(len(self.live_layers)):
                a, b = rec_at + pos * ipb, pool_at + pos * stride
                _memmove(a, b, ipb) if into_record else _memmove(b, a, ipb)
        return True

    def load_page(self, pool: DSATokenToKVPool, rec: torch.Tensor, page: int, *, verified: bool = False) -> None:
        """Write a one-page record (checked as :meth:`check` checks it) onto pool page ``page``: one
        strided copy per component. ``verified``: the record's checksum was checked when it was read
        (its hash is not taken again; every other check is made).

        Raises:
            RecordError: the record fails its checks or is not one whole page in slot order.
            ValueError: ``page`` outside the pool.
        """
        ps = self.page_size
        header, hashed = self._page_header()
        arr = _as_array(rec)
        s, lat_n, idx_n = self.header_nbytes, self.latent_nbytes(ps), self.index_nbytes(1)
        if arr.size != s + lat_n + idx_n + 8 * ps or bytes(arr[:_CHECKSUM_AT]) != header[:_CHECKSUM_AT] \
                or bytes(arr[_FIXED.size:s]) != header[_FIXED.size:]:
            self.check(rec)  # names what differs (another model, mask, length, a damaged header)
            raise RecordError("not a one-page record in slot order")
        if not verified:
            h = hashed.copy()
            h.update(memoryview(arr[s:]))
            if h.intdigest() != struct.unpack_from("<Q", arr, _CHECKSUM_AT)[0]:
                raise RecordError("record checksum (xxh3_64) mismatch: the record is damaged")
        if not np.array_equal(arr[s + lat_n + idx_n:].view(np.int64) % ps, self._page_src):
            raise RecordError("not a one-page record in slot order")
        if not 0 <= page < pool.num_pages or page >= pool.num_slots // ps:
            raise ValueError(f"page {page} is outside the pool")
        if arr.flags.c_contiguous and self._copy_page(pool, page, arr.ctypes.data, into_record=False):
            return
        L, rb, dev = self.model.num_layers, self.row_bytes, pool.device
        t = rec if isinstance(rec, torch.Tensor) else torch.from_numpy(arr)
        dst = pool.arena("latent").view(L, pool.num_slots, rb)[:, page * ps:(page + 1) * ps]
        dst.copy_(t[s:s + lat_n].view(L, ps, rb).to(dev, non_blocking=True))
        if idx_n:
            rows = pool.arena("index_k").view(len(self.live_layers), pool.num_pages, self.index_page_bytes)
            rows[:, page].copy_(t[s + lat_n:s + lat_n + idx_n].view(len(self.live_layers), -1).to(dev, non_blocking=True))
        pool._sync()

    def encode_copy(self, copy: dict[str, Any], *, pin_memory: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """A sealed record of a ``get_cpu_copy`` result (one copy of its bytes), in ``out[:nbytes]``
        when given.

        Raises:
            ValueError: the copy's layout differs from this codec's (layers, chunk shapes).
        """
        src = torch.as_tensor(copy.get("src_loc"), dtype=torch.int64).reshape(-1).cpu()
        n = src.numel()
        pages, _ = first_appearance_pages(src, self.page_size)
        p = pages.numel()
        rec = self._buffer(self.nbytes(n, p), pin_memory, out)
        latent, index, src_out = self.payload(rec, n, p)
        kv, idx = copy["kv"], copy["index_k"]
        if len(kv) != self.model.num_layers or len(idx) != self.model.num_layers:
            raise ValueError(f"the copy has {len(kv)} latent and {len(idx)} indexer layers, the codec {self.model.num_layers}")
        for layer, chunks in enumerate(kv):
            rows = torch.cat([c.reshape(c.shape[0], -1).contiguous().view(torch.uint8) for c in chunks]) if chunks else None
            if rows is None or tuple(rows.shape) != (n, self.row_bytes):
                raise ValueError(f"copy['kv'][{layer}] does not hold {n} rows of {self.row_bytes} bytes")
            latent[layer].copy_(rows)
        for layer in range(self.model.num_layers):
            chunks = idx[layer]
            if not self.indexer_layers[layer]:
                if chunks:
                    raise ValueError(f"copy['index_k'][{layer}] has data but the layer has no indexer buffer")
                continue
            rows = torch.cat(list(chunks)) if chunks else torch.empty(0, self.index_page_bytes, dtype=torch.uint8)
            if tuple(rows.shape) != (p, self.index_page_bytes):
                raise ValueError(f"copy['index_k'][{layer}] does not hold {p} page rows of {self.index_page_bytes} bytes")
            index[self.live_layers.index(layer)].copy_(rows)
        src_out.copy_(src)
        self.seal(rec, n, p)
        return rec

    def payload(self, rec: torch.Tensor, n_tokens: int, n_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views ``(latent (L, n, row_bytes), index (live, p, page_bytes), src_loc (n,) int64)`` of ``rec``."""
        s, lat, idx = self.header_nbytes, self.latent_nbytes(n_tokens), self.index_nbytes(n_pages)
        latent = rec[s:s + lat].view(self.model.num_layers, n_tokens, self.row_bytes)
        index = rec[s + lat:s + lat + idx].view(len(self.live_layers), n_pages, self.index_page_bytes)
        src = rec[s + lat + idx:s + lat + idx + 8 * n_tokens].view(torch.int64)
        return latent, index, src

    # ----- decode -------------------------------------------------------------------------------
    def check(self, rec: torch.Tensor | np.ndarray | bytes, *, checksum: bool = True) -> RecordInfo:
        """Verify ``rec`` completely for this codec: magic, version, model fingerprint, layer mask,
        lengths, checksum (``checksum=False``: all but the hash, for bytes a tier just verified).

        Raises:
            RecordError: naming the first failed check.
        """
        arr = _as_array(rec)
        info = verify_record(arr, checksum=checksum)
        meta = arr[_FIXED.size:_FIXED.size + len(self._meta)].tobytes()
        fp_len = _FIXED.unpack_from(arr, 0)[6]
        if fp_len != len(self._fp) or meta[:len(self._fp)] != self._fp:
            raise RecordError("record model fingerprint differs from the reader's (another model, layer count, "
                              "skip mask, dtype or page size)")
        if meta[len(self._fp):] != self._mask:
            raise RecordError("record layer mask differs from the reader's (another pool role)")
        if info.latent_nbytes != self.latent_nbytes(info.n_tokens) or info.index_nbytes != self.index_nbytes(info.n_pages):
            raise RecordError("record lengths do not match its token and page counts")
        return info

    def to_cpu_copy(self, rec: torch.Tensor, *, checksum: bool = True) -> dict[str, Any]:
        """Check ``rec`` (:meth:`check`; ``checksum=False``: all but the hash, for a record whose
        checksum was just verified) and view it as a ``get_cpu_copy`` result for ``pool.load_cpu_copy``.

        Returns:
            ``{"kv": [layer][chunk (c, 1, kv_cache_dim)], "index_k": [layer][chunk (p, page_bytes)],
            "src_loc": (n,) int64}`` -- views into ``rec`` (no copy); ``[]`` on skip layers.

        Raises:
            RecordError: the record fails :meth:`check`.
        """
        info = self.check(rec, checksum=checksum)
        n, p = info.n_tokens, info.n_pages
        latent, index, src = self.payload(rec, n, p)
        kv_dim = self.model.kv_cache_dim
        rows = latent.view(self.store_dtype).view(self.model.num_layers, n, 1, kv_dim)
        kv = [[rows[layer, i:i + KV_CHUNK_SLOTS] for i in range(0, n, KV_CHUNK_SLOTS)] for layer in range(self.model.num_layers)]
        index_k: list[list[torch.Tensor]] = [[] for _ in range(self.model.num_layers)]
        for pos, layer in enumerate(self.live_layers):
            index_k[layer] = [index[pos, i:i + INDEX_CHUNK_PAGES] for i in range(0, p, INDEX_CHUNK_PAGES)]
        return {"kv": kv, "index_k": index_k, "src_loc": src}
