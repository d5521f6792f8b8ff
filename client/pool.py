"""Client methods of ``kvtier.v1.PoolService``: pools, slots, KV data, offload/restore, infos, stats.

KV payloads travel as streams of chunks of at most ``chunk_bytes`` data bytes, so no message passes
the size limit however large the payload.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.client.base import BaseClient
from kvtier.client.errors import FailedPreconditionError, InvalidArgumentError
from kvtier.client.wire import ReceiveBuffers, decode_read_chunk, encode_write_chunk
from kvtier.native import load
from kvtier.v1 import pool_pb2, pool_pb2_grpc

copy_into = load("kvtier._streamcopy").copy_into  # streaming stores, or the stand-in (kvtier.native)

Slots = Any  # (n,) int torch.Tensor, numpy array or sequence of ints

_LATENT, _INDEX_K, _INDEX_SCALE = pool_pb2.COMPONENT_LATENT, pool_pb2.COMPONENT_INDEX_K, pool_pb2.COMPONENT_INDEX_SCALE


def slot_list(slots: Slots) -> list[int]:
    """``slots`` as a list of ints for a request (no range checks here: the daemon checks them)."""
    if isinstance(slots, torch.Tensor):
        return slots.reshape(-1).tolist()
    if isinstance(slots, np.ndarray):
        return slots.reshape(-1).tolist()
    return [int(s) for s in slots]


def _as_tensor(t: torch.Tensor | np.ndarray, what: str) -> torch.Tensor:
    if isinstance(t, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(t))
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor or numpy array, got {type(t).__name__}")
    return t


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a host-copyable tensor (made by :func:`_as_tensor`), as one flat view."""
    return memoryview(t.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy())


_LATENT_ELEMENTS = {"fp8": (torch.uint8, torch.float8_e4m3fn), "bf16": (torch.bfloat16,)}


def check_write_tensors(lay: pool_pb2.PoolLayout, n: int, latent: Mapping[int, Any], index: Mapping[int, tuple[Any, Any]]) -> None:
    """Check a write's tensors against the pool layout ``lay`` before anything is sent: latent rows
    ``(n, latent_row_bytes)`` uint8, or ``(n, kv_cache_dim)`` / ``(n, 1, kv_cache_dim)`` of the
    pool's element type (uint8 or float8_e4m3fn on an fp8 pool, bfloat16 on a bf16 one); indexer
    keys ``(n, index_head_dim)`` uint8 or float8_e4m3fn; scales ``(n,)`` or ``(n, index_head_dim //
    128)`` float32 (DESIGN.md's DSA layout).

    Raises:
        InvalidArgumentError: naming the first tensor that does not fit, what was expected and what it is.
    """
    dim, rb, hd = lay.kv_cache_dim, lay.latent_row_bytes, lay.index_head_dim
    elements = _LATENT_ELEMENTS.get(lay.kv_cache_dtype, ())
    for x, t in latent.items():
        shape, dtype = tuple(t.shape), t.dtype
        ok = (shape == (n, rb) and dtype == torch.uint8) or (shape in ((n, dim), (n, 1, dim)) and dtype in elements)
        if not ok:
            names = " or ".join(str(e).removeprefix("torch.") for e in elements)
            raw = "" if torch.uint8 in elements and dim == rb else f", or ({n}, {rb}) uint8 raw rows"
            raise InvalidArgumentError(f"latent[{x}]: expected ({n}, {dim}) {names} rows for {n} tokens{raw}, "
                                       f"got {shape} {str(dtype).removeprefix('torch.')}")
    k = max(1, hd // 128)
    for x, (keys, scales) in index.items():
        shape, dtype = tuple(keys.shape), keys.dtype
        if shape != (n, hd) or dtype not in (torch.uint8, torch.float8_e4m3fn):
            raise InvalidArgumentError(f"index[{x}] keys: expected ({n}, {hd}) uint8 (fp8) for {n} tokens, "
                                       f"got {shape} {str(dtype).removeprefix('torch.')}")
        shape, dtype = tuple(scales.shape), scales.dtype
        if shape not in ((n,), (n, k)) or dtype != torch.float32:
            raise InvalidArgumentError(f"index[{x}] scales: expected ({n},) float32 for {n} tokens, "
                                       f"got {shape} {str(dtype).removeprefix('torch.')}")


@dataclass
class KVData:
    """KV of ``n`` slots as host tensors, keyed by layer id.

    Attributes:
        latent: ``(n, kv_cache_dim)`` rows: uint8 (656-byte fp8 DSA rows) or bfloat16 (576 values).
        index_k: ``(n, index_head_dim)`` uint8 FP8 indexer keys (live layers only).
        index_scale: ``(n,)`` float32 indexer scales (``(n, k)`` when ``index_head_dim = 128 k``).
    """

    latent: dict[int, torch.Tensor] = field(default_factory=dict)
    index_k: dict[int, torch.Tensor] = field(default_factory=dict)
    index_scale: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class OffloadResult:
    """``nbytes`` host bytes stored for ``num_tokens`` tokens; ``freed_pages`` pages freed; ``durable``:
    the copy was committed to the disk tier's LMDB before the call returned (write-through with a
    healthy disk tier): it survives the daemon being killed (power loss too with ``--disk-sync``)."""

    key: str
    nbytes: int
    num_tokens: int
    freed_pages: int
    durable: bool = False


class PoolMixin(BaseClient):
    """PoolService methods. Every call has a deadline (the client's ``timeout`` unless given);
    reads, describes, lists, stats and drops retry on UNAVAILABLE; changes only on an UNAVAILABLE
    that changed nothing (slots a write still arriving is writing: :meth:`BaseClient._run`)."""

    _layouts: dict[str, pool_pb2.PoolLayout]

    @property
    def _pool(self) -> pool_pb2_grpc.PoolServiceStub:
        return self.stub(pool_pb2_grpc.PoolServiceStub)

    def layout(self, pool_id: str) -> pool_pb2.PoolLayout:
        """Layout of ``pool_id`` (fetched once, then cached)."""
        cache = self.__dict__.setdefault("_layouts", {})
        if pool_id not in cache:
            info = self.describe_pool(pool_id)
            cache[pool_id] = info.layout
            self.__dict__.setdefault("_packed_writes", {})[pool_id] = info.packed_writes
        return cache[pool_id]

    # ----- pools --------------------------------------------------------------------------------
    def create_pool(
        self,
        model: str | Path | Mapping[str, Any] = "glm-5.2",
        *,
        size_tokens: int = 0,
        memory_budget_bytes: int = 0,
        pool_id: str = "",
        role: str = "target",
        device: str = "",
        num_layers: int = 0,
        kv_cache_dtype: str = "fp8",
        page_size: int = 64,
        start_layer: int = 0,
        end_layer: int = 0,
        timeout: float | None = None,
    ) -> pool_pb2.PoolInfo:
        """Create a pool of ``size_tokens`` tokens or planned from ``memory_budget_bytes``.

        Args:
            model: a preset name, a path to an HF config.json, or its parsed dict.
            num_layers: only N layers from ``start_layer`` (0: up to ``end_layer``).
            start_layer, end_layer: a pipeline-parallel stage's model layers ``[start_layer, end_layer)``
                (``end_layer`` 0: the model's last). Layer ids in KV calls are model layer ids.

        Raises:
            InvalidArgumentError, AlreadyExistsError, ResourceExhaustedError.
        """
        spec = pool_pb2.ModelSpec(num_layers=num_layers, kv_cache_dtype=kv_cache_dtype, page_size=page_size,
                                  start_layer=start_layer, end_layer=end_layer)
        if isinstance(model, Mapping):
            spec.hf_config_json = json.dumps(dict(model))
        elif Path(model).is_file():
            spec.hf_config_json = Path(model).read_text()
            spec.name = Path(model).stem
        else:
            spec.preset = str(model)
        req = pool_pb2.CreatePoolRequest(pool_id=pool_id, model=spec, role=role, device=device)
        if size_tokens:
            req.size_tokens = size_tokens
        if memory_budget_bytes:
            req.memory_budget_bytes = memory_budget_bytes
        info = self.unary(self._pool.CreatePool, req, idempotent=False, timeout=timeout)
        self.__dict__.setdefault("_layouts", {})[info.pool_id] = info.layout
        self.__dict__.setdefault("_packed_writes", {})[info.pool_id] = info.packed_writes
        return info

    def describe_pool(self, pool_id: str, *, timeout: float | None = None) -> pool_pb2.PoolInfo:
        """Layout, sizes, per-layer bytes, skip mask and plan of a pool. Raises NotFoundError."""
        return self.unary(self._pool.DescribePool, pool_pb2.DescribePoolRequest(pool_id=pool_id), idempotent=True, timeout=timeout)

    def list_pools(self, *, timeout: float | None = None) -> list[pool_pb2.PoolInfo]:
        """Every pool of the daemon."""
        return list(self.unary(self._pool.ListPools, pool_pb2.ListPoolsRequest(), idempotent=True, timeout=timeout).pools)

    def delete_pool(self, pool_id: str, *, force: bool = False, timeout: float | None = None) -> int:
        """Delete a pool; returns the bytes freed. Raises NotFoundError, FailedPreconditionError (slots in use)."""
        resp = self.unary(self._pool.DeletePool, pool_pb2.DeletePoolRequest(pool_id=pool_id, force=force),
                          idempotent=False, timeout=timeout)
        self.__dict__.get("_layouts", {}).pop(pool_id, None)
        return resp.freed_bytes

    # ----- slots --------------------------------------------------------------------------------
    def allocate_slots(self, pool_id: str, num_tokens: int, *, timeout: float | None = None) -> torch.Tensor:
        """Allocate whole pages for ``num_tokens``; returns ``(num_tokens,)`` int64 slots.
        Raises ResourceExhaustedError when too few pages are free."""
        resp = self.unary(self._pool.AllocateSlots, pool_pb2.AllocateSlotsRequest(pool_id=pool_id, num_tokens=num_tokens),
                          idempotent=False, timeout=timeout)
        pages = torch.tensor(list(resp.pages), dtype=torch.int64)
        slots = (pages.view(-1, 1) * resp.page_size + torch.arange(resp.page_size, dtype=torch.int64)).view(-1)
        return slots[: resp.num_tokens]

    def free_slots(self, pool_id: str, slots: Slots, *, timeout: float | None = None) -> int:
        """Free every page the slots touch; returns the pages freed. Raises InvalidArgumentError."""
        return self.unary(self._pool.FreeSlots, pool_pb2.FreeSlotsRequest(pool_id=pool_id, slots=slot_list(slots)),
                          idempotent=False, timeout=timeout).freed_pages

    # ----- KV data ------------------------------------------------------------------------------
    def _write_requests(self, header: pool_pb2.KVHeader, segments: list[tuple[int, int, memoryview]], *,
                        packed: bool, allocate_tokens: int = 0) -> Iterator[bytes]:
        """Serialized ``WriteKVRequest`` messages (each piece's bytes copied once, into its message):
        the header (with ``allocate_tokens``, if any), then ``packed``: the segments back to back in
        full ``chunk_bytes`` messages that run across segment boundaries (a daemon that says
        ``PoolInfo.packed_writes``), else each segment in pieces of ``chunk_bytes``."""
        yield encode_write_chunk(0, 0, 0, [], header=header.SerializeToString(), packed=packed, allocate_tokens=allocate_tokens)
        step = self.chunk_bytes
        if not packed:
            for layer, comp, data in segments:
                for off in range(0, len(data), step):
                    yield encode_write_chunk(layer, comp, off, [data[off:off + step]])
            return
        parts: list[memoryview] = []
        have = start = 0
        for _, _, data in segments:
            pos = 0
            while pos < len(data):
                take = min(step - have, len(data) - pos)
                parts.append(data[pos:pos + take])
                have, pos = have + take, pos + take
                if have == step:
                    yield encode_write_chunk(0, 0, start, parts)
                    start, parts, have = start + have, [], 0
        if have:
            yield encode_write_chunk(0, 0, start, parts)

    def write_kv(
        self,
        pool_id: str,
        slots: Slots,
        *,
        latent: Mapping[int, torch.Tensor | np.ndarray] | None = None,
        index: Mapping[int, tuple[torch.Tensor | np.ndarray, torch.Tensor | np.ndarray]] | None = None,
        timeout: float | None = None,
    ) -> int:
        """Write latent rows and/or indexer keys+scales of ``slots``; returns the bytes written.

        Args:
            slots: ``(n,)`` allocated slots, no duplicates.
            latent: layer -> ``(n, kv_cache_dim)`` (or ``(n, 1, kv_cache_dim)``) rows of the pool's
                dtype, or raw ``(n, latent_row_bytes)`` uint8 (torch tensors or numpy arrays).
            index: live layer -> ``(keys (n, index_head_dim) uint8/float8, scales (n,) float32)``.

        Nothing is written unless the whole stream arrives and checks out (all or nothing). For KV
        of a new request, :meth:`write_new_kv` allocates the slots in the same call and writes the
        rows straight into them (one copy fewer in the daemon).

        Raises:
            InvalidArgumentError (bad slots, lengths), FailedPreconditionError (indexer data for a
            skip-topk layer), NotFoundError, DeadlineExceededError (then nothing was written).
        """
        ids = slot_list(slots)
        header, segs, packed, _ = self._write_stream(pool_id, latent, index, slots=ids, n=len(ids))
        resp = self.client_stream(self._write_kv_raw, lambda: self._write_requests(header, segs, packed=packed), timeout=timeout)
        return resp.bytes_written

    def write_new_kv(
        self,
        pool_id: str,
        *,
        latent: Mapping[int, torch.Tensor | np.ndarray] | None = None,
        index: Mapping[int, tuple[torch.Tensor | np.ndarray, torch.Tensor | np.ndarray]] | None = None,
        timeout: float | None = None,
    ) -> torch.Tensor:
        """Allocate whole pages for ``n`` tokens and write their KV, in one call; returns the
        ``(n,)`` int64 slots (the caller's to free, as from :meth:`allocate_slots`).

        ``latent`` and ``index`` as in :meth:`write_kv`, every tensor with the same ``n`` rows. The
        daemon writes the latent rows straight into the new pages as the stream arrives; the pages
        are the caller's only once the whole stream has arrived and checked out, so a call that
        fails (a broken stream, a deadline, a bad chunk) allocates nothing and leaves the pool as it
        was. In an attach session the pages belong to the session.

        Raises:
            InvalidArgumentError (tensors of unequal rows, bad lengths), ResourceExhaustedError (too
            few free pages), FailedPreconditionError (indexer data for a skip-topk layer),
            NotFoundError, DeadlineExceededError (then nothing was allocated).
        """
        header, segs, packed, n = self._write_stream(pool_id, latent, index, slots=[], n=None)
        resp = self.client_stream(self._write_kv_raw, lambda: self._write_requests(header, segs, packed=packed, allocate_tokens=n),
                                  timeout=timeout)
        pages = torch.tensor(list(resp.pages), dtype=torch.int64)
        return (pages.view(-1, 1) * resp.page_size + torch.arange(resp.page_size, dtype=torch.int64)).view(-1)[:resp.num_slots]

    def _write_stream(self, pool_id: str, latent: Any, index: Any, *, slots: list[int],
                      n: int | None) -> tuple[pool_pb2.KVHeader, list[tuple[int, int, memoryview]], bool, int]:
        """The header, segments, packed flag and token count of a WriteKV stream of ``n`` tokens
        (None: the rows of the first tensor, for a write that allocates), every tensor checked against
        the pool's layout first (:func:`check_write_tensors`)."""
        if latent is not None and not isinstance(latent, Mapping):
            raise TypeError(f"latent must be a dict {{layer id: (n, latent_row_bytes) uint8 tensor}}, got {type(latent).__name__}")
        if index is not None and not isinstance(index, Mapping):
            raise TypeError(f"index must be a dict {{live layer id: (keys (n, index_head_dim) uint8, scales (n,) float32)}}, "
                            f"got {type(index).__name__}")
        for x, pair in (index or {}).items():
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(f"index[{x}] must be a (keys, scales) pair of tensors, got {type(pair).__name__}")
        latent = {x: _as_tensor(t, f"latent[{x}]") for x, t in (latent or {}).items()}
        index = {x: (_as_tensor(k, f"index[{x}] keys"), _as_tensor(sc, f"index[{x}] scales")) for x, (k, sc) in (index or {}).items()}
        if n is None:
            first = next(iter([*latent.values(), *(k for k, _ in index.values())]), None)
            n = 0 if first is None or first.dim() == 0 else first.shape[0]
            if n == 0:
                raise InvalidArgumentError("write_new_kv needs latent or index tensors of at least one row (token)")
        lay = self.layout(pool_id)  # cached after the first call (it says whether the daemon takes packed writes)
        check_write_tensors(lay, n, latent, index)
        segs: list[tuple[int, int, memoryview]] = [(x, _LATENT, _as_bytes(t)) for x, t in latent.items()]
        for x, (keys, scales) in index.items():
            segs.append((x, _INDEX_K, _as_bytes(keys)))
            segs.append((x, _INDEX_SCALE, _as_bytes(scales)))
        header = pool_pb2.KVHeader(pool_id=pool_id, slots=slots, latent_layers=list(latent), index_layers=list(index),
                                   layout_digest=lay.fingerprint_digest)
        return header, segs, self.__dict__.get("_packed_writes", {}).get(pool_id, False), n

    def read_kv(
        self,
        pool_id: str,
        slots: Slots,
        *,
        latent_layers: list[int] | None = None,
        index_layers: list[int] | None = None,
        timeout: float | None = None,
    ) -> KVData:
        """Read KV of ``slots``. ``latent_layers`` None: every layer; ``index_layers`` None: every live
        layer; ``[]`` selects none. Returns :class:`KVData` (host tensors).

        The read names the pool layout this client has cached; if the pool was re-created with
        another layout, the cache is refreshed and the read tried once more.
        """
        try:
            return self._read_kv(pool_id, slots, latent_layers, index_layers, timeout)
        except FailedPreconditionError:
            old = self.__dict__.get("_layouts", {}).pop(pool_id, None)
            if old is None or self.layout(pool_id).fingerprint_digest == old.fingerprint_digest:
                raise
            return self._read_kv(pool_id, slots, latent_layers, index_layers, timeout)

    def _read_kv(self, pool_id: str, slots: Slots, latent_layers: list[int] | None, index_layers: list[int] | None,
                 timeout: float | None) -> KVData:
        lay = self.layout(pool_id)
        if latent_layers is None:
            latent_layers = list(range(lay.start_layer, lay.start_layer + lay.num_layers))
        if index_layers is None:
            index_layers = [lay.start_layer + i for i, c in enumerate(lay.skip_mask) if c == "F"]
        slot_ids = slot_list(slots)
        n = len(slot_ids)
        header = pool_pb2.KVHeader(pool_id=pool_id, slots=slot_ids, latent_layers=latent_layers, index_layers=index_layers,
                                   layout_digest=lay.fingerprint_digest)
        req = pool_pb2.ReadKVRequest(header=header, chunk_bytes=self.chunk_bytes, packed=True)
        scale_per_token = lay.index_head_dim // 128
        sizes = {_LATENT: lay.latent_row_bytes, _INDEX_K: lay.index_head_dim, _INDEX_SCALE: 4 * scale_per_token}
        # the stream order of KVHeader: where each segment starts in the whole stream
        order = [(x, _LATENT) for x in latent_layers] + [(x, c) for x in index_layers for c in (_INDEX_K, _INDEX_SCALE)]
        starts: dict[tuple[int, int], int] = {}
        total = 0
        for key in order:
            starts[key] = total
            total += n * sizes[key[1]]

        def consume(stream: Iterator[bytes]) -> KVData:
            recv = self.__dict__.get("_receive_buffers")
            if recv is None:
                recv = self.__dict__["_receive_buffers"] = ReceiveBuffers()
            whole = recv.take(total)  # every segment, back to back: one copy of each byte
            buf = whole.numpy()
            filled = 0
            for raw in stream:  # serialized ReadKVResponse, packed (component 0) or one segment's piece
                layer_id, comp, offset, data = decode_read_chunk(raw)
                if comp:
                    start = starts.get((layer_id, comp))
                    if start is None:
                        raise RuntimeError(f"daemon sent layer {layer_id} component {comp}, which this read did not ask for")
                    offset += start
                if offset != filled or offset + len(data) > total:
                    raise RuntimeError(f"daemon sent bytes {offset}..{offset + len(data)} of {total} out of order")
                copy_into(buf, offset, data)  # streaming stores, GIL released (kvtier/_streamcopy.c)
                filled += len(data)
            if filled != total:
                raise RuntimeError(f"daemon sent {filled} of {total} bytes")
            out = KVData()
            store_dtype = torch.bfloat16 if lay.kv_cache_dtype == "bf16" else torch.uint8
            for (layer, comp), start in starts.items():
                t = whole[start:start + n * sizes[comp]]
                if comp == _LATENT:
                    out.latent[layer] = t.view(store_dtype).view(n, lay.kv_cache_dim)
                elif comp == _INDEX_K:
                    out.index_k[layer] = t.view(n, lay.index_head_dim)
                else:
                    s = t.view(torch.float32)
                    out.index_scale[layer] = s if scale_per_token == 1 else s.view(n, scale_per_token)
            return out

        return self.server_stream(self._read_kv_raw, req, consume, idempotent=True, timeout=timeout)

    @property
    def _write_kv_raw(self) -> Any:
        """WriteKV on this client's channel taking requests already serialized (:func:`encode_write_chunk`)."""
        rpc = self.__dict__.get("_write_kv_rpc")
        if rpc is None:
            rpc = self.__dict__["_write_kv_rpc"] = self._channel.stream_unary(
                f"/{pool_pb2.DESCRIPTOR.services_by_name['PoolService'].full_name}/WriteKV", request_serializer=None,
                response_deserializer=pool_pb2.WriteKVResponse.FromString)
        return rpc

    @property
    def _read_kv_raw(self) -> Any:
        """ReadKV on this client's channel, responses left serialized (read by :mod:`kvtier.client.wire`)."""
        rpc = self.__dict__.get("_read_kv_rpc")
        if rpc is None:
            rpc = self.__dict__["_read_kv_rpc"] = self._channel.unary_stream(
                f"/{pool_pb2.DESCRIPTOR.services_by_name['PoolService'].full_name}/ReadKV", request_serializer=pool_pb2.ReadKVRequest.SerializeToString,
                response_deserializer=None)
        return rpc

    def move_kv(self, pool_id: str, tgt_slots: Slots, src_slots: Slots, *, timeout: float | None = None) -> int:
        """Copy KV (every layer, latent and indexer) of ``src_slots`` onto ``tgt_slots``; returns the count."""
        req = pool_pb2.MoveKVRequest(pool_id=pool_id, tgt_slots=slot_list(tgt_slots), src_slots=slot_list(src_slots))
        return self.unary(self._pool.MoveKV, req, idempotent=False, timeout=timeout).num_slots

    # ----- offload / restore --------------------------------------------------------------------
    def offload(self, pool_id: str, key: str, slots: Slots, *, free_slots: bool = False, timeout: float | None = None) -> OffloadResult:
        """Copy ``slots`` (latent + live indexer) to the host tier under ``key``; optionally free their pages.
        Raises AlreadyExistsError (key taken), ResourceExhaustedError (host tier full), InvalidArgumentError,
        UnavailableError (only an unhealthy tier could take it)."""
        req = pool_pb2.OffloadRequest(pool_id=pool_id, key=key, slots=slot_list(slots), free_slots=free_slots)
        r = self.unary(self._pool.Offload, req, idempotent=False, timeout=timeout)
        return OffloadResult(r.key, r.nbytes, r.num_tokens, r.freed_pages, r.durable)

    def restore(self, pool_id: str, key: str, slots: Slots | None = None, *, drop: bool = False,
                timeout: float | None = None) -> torch.Tensor:
        """Load the copy under ``key`` into ``slots`` (None: newly allocated); returns the ``(n,)`` slots.
        Raises NotFoundError, FailedPreconditionError (layout differs), ResourceExhaustedError,
        UnavailableError (the copy is on a tier that is unhealthy now; retry later)."""
        req = pool_pb2.RestoreRequest(pool_id=pool_id, key=key, slots=slot_list(slots) if slots is not None else [], drop=drop)
        return torch.tensor(list(self.unary(self._pool.Restore, req, idempotent=False, timeout=timeout).slots), dtype=torch.int64)

    def drop(self, key: str, *, timeout: float | None = None) -> bool:
        """Drop the copy under ``key``; True if there was one."""
        return self.unary(self._pool.Drop, pool_pb2.DropRequest(key=key), idempotent=True, timeout=timeout).dropped

    # ----- metadata -----------------------------------------------------------------------------
    def buffer_infos(self, pool_id: str, *, timeout: float | None = None) -> pool_pb2.BufferInfosResponse:
        """State (indexer) and contiguous (latent) buffer infos, one entry a layer, with layout and skip mask."""
        return self.unary(self._pool.GetBufferInfos, pool_pb2.BufferInfosRequest(pool_id=pool_id), idempotent=True, timeout=timeout)

    def stats(self, *, timeout: float | None = None) -> pool_pb2.StatsResponse:
        """Pools, tier usage, counters, version and uptime."""
        return self.unary(self._pool.GetStats, pool_pb2.StatsRequest(), idempotent=True, timeout=timeout)
