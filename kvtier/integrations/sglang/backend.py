"""``KVTierStorage``: kvtier as SGLang's HiCache L3 storage backend, DSA KV and indexer as one unit.

SGLang 0.5.23 loads it with ``--hicache-storage-backend dynamic`` and the extra config
``{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang", "class_name": "KVTierStorage",
"interface_v1": 1, ...}`` (``StorageBackendFactory`` checks it subclasses ``HiCacheStorage`` and calls
``KVTierStorage(storage_config, kwargs)``); every other setting comes from the extra config
(:class:`~kvtier.integrations.sglang.settings.BackendSettings`).

How SGLang's cache controller uses it (``managers/cache_controller.py``,
``mem_cache/hybrid_cache/hybrid_cache_controller.py``) and what kvtier does:

* prefetch query: ``batch_exists_v2(keys, [PoolTransfer(INDEXER, ALL_PAGES)])`` -> the longest prefix
  of whole units (a unit is stored only with both parts, so a page whose indexer is missing is never
  counted); both pools get that count.
* prefetch read: ``batch_get_v1(keys, host_indices)`` for the KV pool, then ``batch_get_v2([INDEXER])``
  with the same keys and host indices (SGLang clamps to the smaller hit count). kvtier reads BOTH
  parts of each unit in the v1 call, from one record, and writes the indexer rows into the indexer
  host pool there; the v2 call then finds them delivered. So KV and indexer of a page always come
  from the same record: a unit evicted between the calls cannot give KV without its indexer.
* backup: ``batch_set_v2([INDEXER])`` first, then ``batch_set_v1`` for the KV pool. The daemon holds
  the first part, invisible, until the second completes the unit (or a timeout drops it).
* MLA keeps one writer: on ranks where ``storage_config.is_storage_writer`` is False every set
  returns False and stores nothing; every rank reads the same units (their keys carry no tp rank).
* Data path (``transport``, :mod:`~kvtier.integrations.sglang.transport`): with the daemon on this
  machine (a unix-socket address) page bytes go through shared-memory staging buffers of a storage
  session (only keys and offsets over gRPC); to a remote daemon (TCP) as gRPC streams.
* Failures never reach SGLang as exceptions: a daemon that is down, slow or refusing gives misses,
  ``False`` and a log line (at most one a minute per kind). Bad keys and sizes give ``False``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo, PoolHitPolicy, PoolName, PoolTransfer,
    PoolTransferResult,
)

from kvtier.client.storage import UnitSpaceSpec
from kvtier.integrations.sglang.host_pages import BadHostIndices, PagePart, describe_stage
from kvtier.integrations.sglang.settings import BackendSettings
from kvtier.integrations.sglang.transport import UnitTransport, make_transport

log = logging.getLogger("kvtier.sglang")
T = TypeVar("T")
MAX_KEY_BYTES = 256
LOG_EVERY_S = 60.0


class KVTierStorage(HiCacheStorage):
    """SGLang HiCache storage backend over a kvtier daemon's tiers.

    Args:
        storage_config: SGLang's :class:`HiCacheStorageConfig` (tp/pp/cp ranks, ``is_mla_model``,
            ``model_name``, ``extra_config`` with the backend's settings).
        kwargs: what the dynamic loader passes beside it (unused).

    Raises:
        ValueError: unusable settings (unknown extra-config keys, a bad value, ``transport`` shm
            with a TCP address) -- at construction, so SGLang's startup names them.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.settings = BackendSettings.from_extra_config(storage_config.extra_config)
        self.model_name = self.settings.model_name or (storage_config.model_name or "")
        if not self.model_name:
            raise ValueError("kvtier backend: SGLang gave no model_name; set \"model_name\" in the extra config")
        self.is_writer = bool(storage_config.is_storage_writer)
        self.scope = _scope(storage_config)
        self.transport: UnitTransport = make_transport(self.settings)
        self.kv_host: Any = None
        self.index_host: Any = None
        self._space: UnitSpaceSpec | None = None
        self._kv: PagePart | None = None
        self._index: PagePart | None = None
        self._local = threading.local()   # per thread: {key: host page index} the last v1 get delivered indexer rows for
        self._last_log: dict[str, float] = {}
        self._log_lock = threading.Lock()
        self._metrics_lock = threading.Lock()
        self._prefetch_pages: list[int] = []
        self._backup_pages: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_bw: list[float] = []

    # ----- registration ---------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.kv_host = mem_pool_host
        self._space = None

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if host_pool_name == PoolName.INDEXER:
            self.index_host = host_pool
            self._space = None
        elif host_pool_name != PoolName.KV:
            self._warn(f"pool:{host_pool_name}", "kvtier backend: host pool %s is not stored by kvtier; its transfers "
                       "report no pages", host_pool_name)

    def on_host_pools_registered(self) -> None:
        """Work out the unit space now: a layout kvtier cannot store fails SGLang's attach with a
        ValueError saying what to change (the one place the backend raises after construction)."""
        self._stage()

    def _stage(self) -> UnitSpaceSpec:
        if self._space is None:
            if self.kv_host is None:
                raise ValueError("kvtier backend: no host KV pool registered")
            space = describe_stage(self.kv_host, self.index_host, model_name=self.model_name, scope=self.scope)
            token_major = ((space.page_size, space.num_layers, space.latent_row_bytes)
                           if self.kv_host.layout == "page_first" else None)
            self._kv = PagePart(self.kv_host, space.kv_nbytes, token_major)
            self._index = PagePart(self.index_host, space.index_nbytes) if space.with_index else None
            self._space = space
            log.info("kvtier backend: %s layers %d-%d (%s, %s), units of %d KV + %d indexer bytes, scope %r, via %s",
                     space.model_name, space.start_layer, space.start_layer + space.num_layers - 1,
                     space.kv_cache_dtype, self.kv_host.layout, space.kv_nbytes, space.index_nbytes, space.scope,
                     self.transport.name)
        return self._space

    # ----- failure handling -----------------------------------------------------------------------
    def _warn(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._log_lock:
            if now - self._last_log.get(kind, -LOG_EVERY_S) < LOG_EVERY_S:
                return
            self._last_log[kind] = now
        log.warning(msg, *args)

    def _guard(self, what: str, fallback: T, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - never into SGLang's controller: a miss and a log line
            self._warn(what, "kvtier backend: %s failed (%s: %s); answering a miss", what, type(e).__name__, e)
            return fallback

    @staticmethod
    def _falses(keys: Any) -> list[bool]:
        """``[False]`` a key, ``[]`` where ``keys`` has no length: the answer to a call that failed."""
        try:
            return [False] * len(keys)
        except TypeError:
            return []

    @classmethod
    def _v2_falses(cls, transfers: Any) -> dict[str, list[bool]]:
        """``{pool name: [False] a key}`` of the well-formed transfers: a v2 call that failed."""
        out: dict[str, list[bool]] = {}
        try:
            for t in transfers:
                name = getattr(t, "name", None)
                if isinstance(name, str):
                    out[name] = cls._falses(getattr(t, "keys", None) or [])
        except TypeError:
            pass
        return out

    @staticmethod
    def _keys(keys: Sequence[Any]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for k in keys:
            raw = k.encode() if isinstance(k, str) else bytes(k) if isinstance(k, (bytes, bytearray)) else b""
            out.append(raw if 1 <= len(raw) <= MAX_KEY_BYTES else None)
        return out

    def _batches(self, n: int, unit_bytes: int) -> list[range]:
        per = max(1, self.transport.call_bytes() // max(unit_bytes, 1))
        return [range(i, min(n, i + per)) for i in range(0, n, per)]

    # ----- presence -------------------------------------------------------------------------------
    def _exists(self, keys: Sequence[Any]) -> int:
        good = self._keys(keys)
        n_good = next((i for i, k in enumerate(good) if k is None), len(good))
        if n_good == 0:
            return 0
        return self.transport.exists(self._stage(), good[:n_good])  # type: ignore[arg-type]

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self._guard("exists", 0, lambda: self._exists(keys))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        return self._guard("exists_v2", PoolTransferResult(0, {}, []),
                           lambda: self._exists_v2(keys, pool_transfers or []))

    def _exists_v2(self, keys: Sequence[Any], pool_transfers: Sequence[PoolTransfer]) -> PoolTransferResult:
        n = self._exists(keys)
        hits: dict[str, int] = {PoolName.KV: n} if n else {}
        final = n
        for t in pool_transfers:
            ours = t.name in (PoolName.KV, PoolName.INDEXER) and (t.name == PoolName.KV or self.index_host is not None)
            if ours and t.hit_policy == PoolHitPolicy.ALL_PAGES:
                if n:
                    hits[t.name] = n
            else:
                final = 0  # a pool kvtier does not keep cannot be restored from it
        return PoolTransferResult(final, hits, list(range(1, final + 1)))

    # ----- writes ---------------------------------------------------------------------------------
    def _set(self, keys: Sequence[Any], host_indices: torch.Tensor, part: str) -> list[bool]:
        if not self.is_writer:
            self._warn("not-writer", "kvtier backend: this rank is not the storage writer (MLA: one writer per page); "
                       "its sets store nothing")
            return [False] * len(keys)
        space = self._stage()
        pool = self._kv if part == "kv" else self._index
        if pool is None:
            return [False] * len(keys)
        try:
            pages = pool.pages(host_indices, len(keys))
        except BadHostIndices as e:
            self._warn(f"set-{part}", "kvtier backend: %s set of %d keys: %s; nothing stored", part, len(keys), e)
            return [False] * len(keys)
        good = self._keys(keys)
        out = [False] * len(keys)
        t0, moved = time.perf_counter(), 0
        sel = [i for i, k in enumerate(good) if k is not None]
        for batch in self._batches(len(sel), pool.part_nbytes):
            idx = [sel[j] for j in batch]
            stage = self.transport.staging(len(idx) * pool.part_nbytes)
            pool.gather([pages[i] for i in idx], stage.tensor)
            ok = self.transport.put(space, [good[i] for i in idx], part, stage)  # type: ignore[misc]
            for i, a in zip(idx, ok):
                out[i] = bool(a)
            moved += len(idx) * pool.part_nbytes
        if part == "kv":  # a page is counted once, with its KV part (the indexer part rides along)
            self._record(self._backup_pages, self._backup_bw, sum(out), moved, time.perf_counter() - t0)
        return out

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._guard("batch_set_v1", self._falses(keys), lambda: self._set(keys, host_indices, "kv"))

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._guard("batch_set_v2", self._v2_falses(transfers), lambda: self._set_v2(transfers))

    def _set_v2(self, transfers: Sequence[PoolTransfer]) -> dict[str, list[bool]]:
        return self._each_transfer("batch_set_v2", transfers, self._set)

    def _each_transfer(self, op: str, transfers: Sequence[PoolTransfer],
                       move: Callable[[Sequence[Any], torch.Tensor, str], list[bool]]) -> dict[str, list[bool]]:
        """``move(keys, host_indices, part)`` for each v2 transfer (KV: part ``kv``, INDEXER: ``index``),
        each under its own guard: a pool kvtier does not keep, or a transfer that fails, is all False."""
        out: dict[str, list[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            part = {PoolName.KV: "kv", PoolName.INDEXER: "index"}.get(t.name)
            if part is None or (part == "index" and self.index_host is None):
                out[t.name] = [False] * len(keys)
                continue
            out[t.name] = self._guard(f"{op}:{t.name}", self._falses(keys),
                                      lambda: move(keys, t.host_indices, part))  # noqa: B023 - called at once
        return out

    # ----- reads ----------------------------------------------------------------------------------
    def _get(self, keys: Sequence[Any], host_indices: torch.Tensor, part: str) -> list[bool]:
        """``part``: ``kv`` (with the indexer rows too where the space has them: one record) or ``index``.

        The memo of indexer rows a v1 read delivered (``self._local.delivered``) is cleared when a v1
        read starts and when an indexer read uses it: a refused or failed v1 call leaves nothing for
        the v2 call after it to answer from, and a memo answers one v2 call only."""
        if part == "kv":
            self._local.delivered = {}
            memo: dict[bytes, int] = {}
        else:
            memo, self._local.delivered = getattr(self._local, "delivered", {}), {}
        space = self._stage()
        try:
            kv_pages = self._kv.pages(host_indices, len(keys)) if part == "kv" else None  # type: ignore[union-attr]
            idx_pages = self._index.pages(host_indices, len(keys)) if self._index is not None else None
        except BadHostIndices as e:
            self._warn(f"get-{part}", "kvtier backend: %s get of %d keys: %s; a miss", part, len(keys), e)
            return [False] * len(keys)
        if part == "index" and idx_pages is None:
            return [False] * len(keys)
        wire = "both" if part == "kv" and space.with_index else part
        n_wire = space.part_nbytes(wire)
        good = self._keys(keys)
        out = [False] * len(keys)
        delivered: dict[bytes, int] = {}
        t0, moved = time.perf_counter(), 0
        if part == "index":
            firsts = host_indices.reshape(len(keys), -1)[:, 0].tolist() if len(keys) else []
            for i, k in enumerate(good):
                if k is not None and memo.get(k) == firsts[i]:
                    out[i] = True
            sel = [i for i, k in enumerate(good) if k is not None and not out[i]]
        else:
            sel = [i for i, k in enumerate(good) if k is not None]
            firsts = host_indices.reshape(len(keys), -1)[:, 0].tolist() if len(keys) else []
        for batch in self._batches(len(sel), n_wire):
            idx = [sel[j] for j in batch]
            found, data = self.transport.get(space, [good[i] for i in idx], wire)  # type: ignore[misc]
            rows = data.view(len(idx), n_wire)   # the very bytes this read filled
            hit = [j for j, f in enumerate(found) if f]
            if part == "kv":
                self._kv.scatter(rows[:, :space.kv_nbytes], [kv_pages[i] for i in idx], hit)  # type: ignore[union-attr,index]
                if wire == "both":
                    self._index.scatter(rows[:, space.kv_nbytes:], [idx_pages[i] for i in idx], hit)  # type: ignore[union-attr,index]
                    delivered.update({good[idx[j]]: firsts[idx[j]] for j in hit})  # type: ignore[misc]
            else:
                self._index.scatter(rows, [idx_pages[i] for i in idx], hit)  # type: ignore[union-attr,index]
            for j in hit:
                out[idx[j]] = True
            moved += len(hit) * n_wire
        if part == "kv":
            self._local.delivered = delivered
        if moved:  # pages read from kvtier (an indexer read answered by the v1 read moves nothing)
            self._record(self._prefetch_pages, self._prefetch_bw, moved // n_wire, moved, time.perf_counter() - t0)
        return out

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._guard("batch_get_v1", self._falses(keys), lambda: self._get(keys, host_indices, "kv"))

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._guard("batch_get_v2", self._v2_falses(transfers), lambda: self._get_v2(transfers))

    def _get_v2(self, transfers: Sequence[PoolTransfer]) -> dict[str, list[bool]]:
        return self._each_transfer("batch_get_v2", transfers, self._get)

    # ----- the legacy (non-zero-copy) interface: a flat host page of the KV pool ------------------
    def _flat_page(self, t: Any) -> torch.Tensor | None:
        space = self._stage()
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous() \
                or t.numel() * t.element_size() != space.kv_nbytes:
            return None
        return t.reshape(-1).view(torch.uint8)

    def _legacy_get(self, keys: Sequence[Any], targets: Sequence[Any]) -> list[torch.Tensor | None]:
        space = self._stage()
        good, pages = self._keys(keys), [self._flat_page(t) for t in targets]
        sel = [i for i in range(len(keys)) if good[i] is not None and pages[i] is not None]
        out: list[torch.Tensor | None] = [None] * len(keys)
        for batch in self._batches(len(sel), space.kv_nbytes):
            idx = [sel[j] for j in batch]
            found, data = self.transport.get(space, [good[i] for i in idx], "kv")  # type: ignore[misc]
            rows = data.view(len(idx), space.kv_nbytes)   # the very bytes this read filled
            hit = [j for j, f in enumerate(found) if f]
            self._kv.scatter(rows, [pages[i] for i in idx], hit)  # type: ignore[union-attr,misc]
            for j in hit:
                out[idx[j]] = targets[idx[j]]
        return out

    def _legacy_set(self, keys: Sequence[Any], values: Sequence[Any]) -> bool:
        if not self.is_writer:
            return False
        space = self._stage()
        good, pages = self._keys(keys), [self._flat_page(v) for v in values]
        if any(k is None for k in good) or any(p is None for p in pages):
            return False
        ok = True
        for batch in self._batches(len(keys), space.kv_nbytes):
            idx = list(batch)
            stage = self.transport.staging(len(idx) * space.kv_nbytes)
            self._kv.gather([pages[i] for i in idx], stage.tensor)  # type: ignore[union-attr,misc]
            ok &= all(self.transport.put(space, [good[i] for i in idx], "kv", stage))  # type: ignore[misc]
        return ok

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self._guard("get", [None], lambda: self._legacy_get([key], [target_location]))[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[torch.Tensor | None]:
        none: list[torch.Tensor | None] = [None] * len(self._falses(keys))
        return self._guard("batch_get", none,
                           lambda: self._legacy_get(keys, list(target_locations or [None] * len(keys))))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self._guard("set", False, lambda: self._legacy_set([key], [value]))

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        return self._guard("batch_set", False, lambda: self._legacy_set(keys, list(values or [])) if values else False)

    # ----- housekeeping ---------------------------------------------------------------------------
    def clear(self) -> bool:
        """Remove this stage's units (this tenant's, this scope's) from the daemon's tiers."""
        return self._guard("clear", False, lambda: self.transport.clear(self._stage()) >= 0)

    def kvtier_stats(self) -> dict[str, int]:
        """The daemon's unit counters of this tenant ({} when it cannot be reached)."""
        return self._guard("stats", {}, self.transport.stats)

    def _record(self, pages: list[int], bws: list[float], n: int, nbytes: int, seconds: float) -> None:
        if n:
            with self._metrics_lock:
                pages.append(n)
                bws.append(nbytes / seconds / 1e9 if seconds > 0 else 0.0)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (None where they cannot be built)."""
        return self._guard("get_stats", None, self._storage_metrics)

    def _storage_metrics(self) -> Any:
        """SGLang's ``StorageMetrics`` of the pages prefetched (read from kvtier) and backed up (units
        whose KV part was stored) since the last call, GB/s per call, for ``--enable-storage-metrics``."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        with self._metrics_lock:
            m.prefetch_pgs.extend(self._prefetch_pages)
            m.backup_pgs.extend(self._backup_pages)
            m.prefetch_bandwidth.extend(self._prefetch_bw)
            m.backup_bandwidth.extend(self._backup_bw)
            for x in (self._prefetch_pages, self._backup_pages, self._prefetch_bw, self._backup_bw):
                x.clear()
        return m

    def close(self) -> None:
        self._guard("close", None, self.transport.close)


def _scope(cfg: HiCacheStorageConfig) -> str:
    """The shard a unit key names: "" for MLA (every tp rank reads the one writer's unit); the tp rank
    for rank-sharded KV; the attention context-parallel rank where each holds a slice of every page."""
    parts = []
    if not cfg.is_mla_model:
        parts.append(f"tp{cfg.tp_rank}/{cfg.tp_size}")
    if cfg.attn_cp_size > 1:
        parts.append(f"cp{cfg.attn_cp_rank}/{cfg.attn_cp_size}")
    if getattr(cfg, "dcp_size", 1) > 1:
        parts.append(f"dcp{cfg.dcp_rank}/{cfg.dcp_size}")
    return ",".join(parts)
