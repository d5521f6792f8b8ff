"""Client methods of ``kvtier.v1.StorageService``: units (an engine's pages) in the daemon's tiers.

A unit is one page of one pipeline stage: its KV part (``(num_layers, page_size, latent_row_bytes)``
bytes, layer-major) and, for a DSA model, its index part (``(live layers, page_size * 132)`` bytes,
the live layers in order), kept by the daemon as ONE record: present whole or absent. See
``proto/kvtier/v1/storage.proto``. SGLang's HiCache backend (``kvtier.integrations.sglang``) is the
main user; any engine with page keys can use it::

    space = UnitSpaceSpec.for_model("GLM-5.2", num_layers=20, start_layer=20, skip_mask="SSFS...",
                                    kv_cache_dtype="fp8")
    c.put_units(space, [b"hash0"], "both", data)    # data: (space.part_nbytes("both"),) uint8
    c.exist_units(space, [b"hash0", b"hash1"])      # 1: the longest prefix of whole units
    found = c.get_units(space, [b"hash0"], "both", out)

On the daemon's machine the bytes can go through shared memory instead of gRPC messages: open a
storage session (``kvtier.client.staging``), write the parts into one of its staging buffers and
call ``put_units_staged`` / ``get_units_staged`` through the session's client (only keys and the
buffer's index and offset travel over gRPC)::

    with c.storage_session() as s:
        buf = s.buffer(space.part_nbytes("both"))
        buf.tensor.copy_(data)
        s.client.put_units_staged(space, [b"hash0"], "both", buf.index)
        s.client.get_units_staged(space, [b"hash0"], "both", buf.index)   # [True]; bytes in buf.tensor
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.client.base import BaseClient
from kvtier.v1 import pool_pb2, storage_pb2, storage_pb2_grpc

PARTS = {"kv": storage_pb2.UNIT_PART_KV, "index": storage_pb2.UNIT_PART_INDEX, "both": storage_pb2.UNIT_PART_BOTH}
INDEX_QUANT_BLOCK = 128


@dataclass(frozen=True)
class UnitSpaceSpec:
    """Which units: a stage's geometry, whether units carry the indexer, and the shard scope.

    Attributes:
        model_name: the model's name (units of two names never mix).
        num_layers, start_layer: the stage's layers ``[start_layer, start_layer + num_layers)``.
        kv_lora_rank, qk_rope_head_dim, index_head_dim: MLA / indexer dimensions.
        kv_cache_dtype: ``fp8`` (656-byte rows for DeepSeek dims) or ``bf16``.
        page_size: tokens per page.
        latent_row_bytes: bytes of one token's latent row on one layer (the daemon checks it).
        skip_mask: one ``S`` (skip-topk: no indexer) or ``F`` per layer of the stage.
        with_index: units hold the live layers' indexer rows.
        scope: "" where every tensor-parallel rank reads the same unit (MLA), else the shard's name.
    """

    model_name: str
    num_layers: int
    start_layer: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    kv_cache_dtype: str
    page_size: int
    latent_row_bytes: int
    skip_mask: str
    with_index: bool = True
    scope: str = ""

    @property
    def live_layers(self) -> int:
        """Layers that own an indexer buffer (``F`` in the mask)."""
        return self.skip_mask.count("F")

    @property
    def kv_nbytes(self) -> int:
        """Bytes of one unit's KV part."""
        return self.num_layers * self.page_size * self.latent_row_bytes

    @property
    def index_nbytes(self) -> int:
        """Bytes of one unit's index part (0 without the indexer)."""
        per_token = self.index_head_dim + self.index_head_dim // INDEX_QUANT_BLOCK * 4
        return self.live_layers * self.page_size * per_token if self.with_index else 0

    def part_nbytes(self, part: str) -> int:
        """Bytes of ``part`` (``kv``, ``index`` or ``both``: KV then index) of one unit."""
        return {"kv": self.kv_nbytes, "index": self.index_nbytes, "both": self.kv_nbytes + self.index_nbytes}[part]

    def message(self) -> storage_pb2.UnitSpace:
        """The wire form."""
        lay = pool_pb2.PoolLayout(model_name=self.model_name, num_layers=self.num_layers, start_layer=self.start_layer,
                                  kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim,
                                  index_head_dim=self.index_head_dim, kv_cache_dtype=self.kv_cache_dtype,
                                  page_size=self.page_size, latent_row_bytes=self.latent_row_bytes,
                                  skip_mask=self.skip_mask)
        return storage_pb2.UnitSpace(layout=lay, with_index=self.with_index, scope=self.scope)


@dataclass(frozen=True)
class PutUnitsResult:
    """Per key whether the part was accepted (stored, waiting for its other part, or the unit was
    already whole); units this call completed; parts that now wait."""

    accepted: list[bool]
    completed: int
    pending: int


def _part(part: str) -> int:
    if part not in PARTS:
        raise ValueError(f"unit part must be one of {sorted(PARTS)}, got {part!r}")
    return PARTS[part]


def _flat_bytes(t: torch.Tensor, nbytes: int, what: str) -> np.ndarray:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous host tensor")
    flat = t.reshape(-1).view(torch.uint8)
    if flat.numel() < nbytes:
        raise ValueError(f"{what} holds {flat.numel()} bytes, the units need {nbytes}")
    return flat[:nbytes].numpy()


class StorageMixin(BaseClient):
    """StorageService methods; exists, get and stats retry on UNAVAILABLE, put and clear never do."""

    @property
    def _storage(self) -> storage_pb2_grpc.StorageServiceStub:
        return self.stub(storage_pb2_grpc.StorageServiceStub)

    def exist_units(self, space: UnitSpaceSpec, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """The longest prefix of ``keys`` whose units are whole and present (a unit with one part
        only is never counted). Raises InvalidArgumentError (bad space or keys)."""
        req = storage_pb2.ExistUnitsRequest(space=space.message(), keys=list(keys))
        return self.unary(self._storage.ExistUnits, req, idempotent=True, timeout=timeout).prefix_units

    def _put_requests(self, space: UnitSpaceSpec, keys: list[bytes], part: str, data: np.ndarray,
                      writer: bytes) -> Iterator[storage_pb2.PutUnitsRequest]:
        mv, step = memoryview(data), self.chunk_bytes
        yield storage_pb2.PutUnitsRequest(space=space.message(), keys=keys, part=_part(part),
                                          data=bytes(mv[:step]), writer=writer)
        for off in range(step, len(mv), step):
            yield storage_pb2.PutUnitsRequest(data=bytes(mv[off:off + step]))

    def put_units(self, space: UnitSpaceSpec, keys: Sequence[bytes], part: str, data: torch.Tensor, *,
                  writer: bytes | None = None, timeout: float | None = None) -> PutUnitsResult:
        """Store ``part`` of each key's unit; ``data`` holds the parts in key order, concatenated
        (``len(keys) * space.part_nbytes(part)`` bytes of a contiguous host tensor, any dtype).
        ``writer`` (at most 64 bytes): who writes; a unit's two parts are joined only when one
        writer sent both. None: this client's own :attr:`writer_id` (pass one id of your own when an
        engine sends a unit's parts through different clients); ``b""``: the attach session, else
        one writer for all the tenant's calls without one.

        Raises:
            ValueError: ``data`` too small or not a host tensor (nothing sent).
            InvalidArgumentError: the daemon refused the space, keys or sizes (nothing stored).
        """
        keys = list(keys)
        buf = _flat_bytes(data, len(keys) * space.part_nbytes(part), "data")
        writer = self.writer_id if writer is None else writer
        r = self.client_stream(self._storage.PutUnits, lambda: self._put_requests(space, keys, part, buf, writer),
                               timeout=timeout)
        return PutUnitsResult(list(r.accepted), r.completed, r.pending)

    def get_units(self, space: UnitSpaceSpec, keys: Sequence[bytes], part: str, out: torch.Tensor, *,
                  timeout: float | None = None) -> list[bool]:
        """Read ``part`` of each key's unit into ``out`` (unit ``i`` at byte ``i * part_nbytes``;
        a contiguous host tensor of at least ``len(keys) * part_nbytes`` bytes). Returns per key
        whether its unit was whole and present (a miss leaves its bytes of ``out`` as they were,
        or partly written if the stream broke off).

        Raises:
            ValueError: ``out`` too small (nothing asked). InvalidArgumentError (space, keys).
        """
        keys = list(keys)
        n_part = space.part_nbytes(part)
        dst = _flat_bytes(out, len(keys) * n_part, "out")
        req = storage_pb2.GetUnitsRequest(space=space.message(), keys=keys, part=_part(part), chunk_bytes=self.chunk_bytes)

        def consume(stream: Iterator[storage_pb2.GetUnitsResponse]) -> list[bool]:
            got = [0] * len(keys)
            for m in stream:
                if m.unit >= len(keys) or m.offset != got[m.unit] or m.offset + len(m.data) > n_part:
                    raise RuntimeError(f"daemon sent unit {m.unit} bytes out of order")
                at = m.unit * n_part + m.offset
                dst[at:at + len(m.data)] = np.frombuffer(m.data, dtype=np.uint8)
                got[m.unit] += len(m.data)
            return [g == n_part for g in got]

        return self.server_stream(self._storage.GetUnits, req, consume, idempotent=True, timeout=timeout)

    def put_units_staged(self, space: UnitSpaceSpec, keys: Sequence[bytes], part: str, buffer: int, offset: int = 0, *,
                         writer: bytes | None = None, timeout: float | None = None) -> PutUnitsResult:
        """Store ``part`` of each key's unit from staging buffer ``buffer`` of this client's storage
        session (unit ``i`` at byte ``offset + i * part_nbytes``; written completely before the call;
        ``writer`` as in :meth:`put_units`).
        Call it through :attr:`StagingSession.client <kvtier.client.staging.StagingSession.client>`.

        Raises:
            FailedPreconditionError: the client is not in a storage or attach session.
            InvalidArgumentError: space, keys, or a region that does not lie in the buffer (nothing stored).
            NotFoundError: the session has ended.
        """
        req = storage_pb2.PutUnitsStagedRequest(space=space.message(), keys=list(keys), part=_part(part),
                                                staging=storage_pb2.StagingRegion(buffer=buffer, offset=offset),
                                                writer=self.writer_id if writer is None else writer)
        r = self.unary(self._storage.PutUnitsStaged, req, idempotent=False, timeout=timeout)
        return PutUnitsResult(list(r.accepted), r.completed, r.pending)

    def get_units_staged(self, space: UnitSpaceSpec, keys: Sequence[bytes], part: str, buffer: int, offset: int = 0, *,
                         timeout: float | None = None) -> list[bool]:
        """Read ``part`` of each key's unit into staging buffer ``buffer`` of this client's session
        (unit ``i`` at byte ``offset + i * part_nbytes``, in place when this returns); per key
        whether its unit was whole and present (a miss leaves its bytes as they were).

        Raises:
            FailedPreconditionError: not in a session. InvalidArgumentError: space, keys or region.
            NotFoundError: the session has ended.
        """
        req = storage_pb2.GetUnitsStagedRequest(space=space.message(), keys=list(keys), part=_part(part),
                                                staging=storage_pb2.StagingRegion(buffer=buffer, offset=offset))
        return list(self.unary(self._storage.GetUnitsStaged, req, idempotent=True, timeout=timeout).found)

    def clear_units(self, space: UnitSpaceSpec, *, timeout: float | None = None) -> int:
        """Remove the caller's units of ``space`` (and waiting parts); returns how many."""
        req = storage_pb2.ClearUnitsRequest(space=space.message())
        return self.unary(self._storage.ClearUnits, req, idempotent=False, timeout=timeout).removed

    def unit_stats(self, *, timeout: float | None = None) -> dict[str, int]:
        """The caller's tenant's unit counters (``units_stored``, ``parts_pending``, ``pending_bytes``,
        ``partial_expired``, ``partial_evicted``, ``hits``, ``misses``, ...)."""
        return dict(self.unary(self._storage.GetUnitStats, storage_pb2.UnitStatsRequest(), idempotent=True,
                               timeout=timeout).counters)
