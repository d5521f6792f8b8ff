"""The daemon's domain root: config, pools, tiers and prefix caches, the offload store, counters.

One :class:`Daemon` is built per daemon process. The gRPC servicers (``kvtier.server.service``) call
into it and only translate; an in-process user (tests, replay, an adapter's local mode) calls the
same objects directly. Components keep their state here: give :class:`Daemon` a field and register
cleanup with :meth:`Daemon.add_shutdown_hook` so it runs after the server stopped (e.g. closing an
LMDB environment). Nothing here imports grpc or ``kvtier.v1``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier import __version__
from kvtier.server.pool import resolve_device
from kvtier.server.daemon.config import DaemonConfig
from kvtier.server.daemon.offload_store import OffloadStore
from kvtier.server.daemon.pools import PoolRegistry, PoolRequest
from kvtier.server.daemon.tier_runtime import TierRuntime
from kvtier.server.daemon.transfer import TransferState

log = logging.getLogger("kvtier.daemon")


class Counters:
    """Thread-safe named event and byte counters (``writes``, ``bytes_written``, ...)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {}

    def add(self, name: str, value: int = 1) -> None:
        """Add ``value`` to counter ``name``."""
        with self._lock:
            self._values[name] = self._values.get(name, 0) + value

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter."""
        with self._lock:
            return dict(self._values)


@dataclass(frozen=True)
class TierUsage:
    """Bytes a tier holds (``tier``: ``device``, ``host``, ``disk``)."""

    tier: str
    used_bytes: int
    budget_bytes: int
    entries: int


class Daemon:
    """Everything a daemon holds; the servicers and in-process users share it.

    Args:
        config: the daemon's configuration.

    Attributes:
        pools: the pool registry. tiers: the host/disk stack and the pools' prefix caches.
        offload_store: the one store of offloaded copies, in ``tiers.stack``.
        transfer: PD transfer (layouts, pulls, page streams).

    Raises:
        ValueError: bad config values (device, ``[tiers]``).
        TransferEngineUnavailable: ``transfer_engine = "mooncake"`` but the engine cannot start.
    """

    def __init__(self, config: DaemonConfig | None = None) -> None:
        self.config = config or DaemonConfig()
        self.device = str(resolve_device(self.config.device))
        self.pools = PoolRegistry(self.config.device, self.config.pool_memory_bytes)
        self.counters = Counters()
        self.version = __version__
        self._started = time.monotonic()
        self._shutdown_hooks: list[Callable[[], None]] = []
        self.tiers = TierRuntime(self)  # host/disk tiers, prefix caches
        self.offload_store = OffloadStore(self.tiers.stack)
        self.transfer = TransferState(self)  # PD transfer: the engine (if configured) and its registrations
        self.add_shutdown_hook(self.transfer.close)

    @property
    def uptime_seconds(self) -> float:
        return time.monotonic() - self._started

    def create_configured_pools(self) -> None:
        """Create the pools of ``config.pools`` (a preset name or a path to an HF config.json each)."""
        import json
        from pathlib import Path

        for spec in self.config.pools:
            path = Path(spec.model)
            hf = json.loads(path.read_text()) if path.is_file() else None
            req = PoolRequest(pool_id=spec.pool_id, preset="" if hf is not None else spec.model, hf_config=hf,
                              model_name=path.stem if hf is not None else "", num_layers=spec.num_layers,
                              kv_cache_dtype=spec.kv_cache_dtype, page_size=spec.page_size, role=spec.role,
                              size_tokens=spec.tokens, memory_budget_bytes=spec.memory_bytes)
            entry = self.pools.create(req)
            log.info("pool %r: %s %s, %d tokens, %d bytes on %s", entry.pool_id, entry.model.name, entry.role,
                     entry.allocator.size, entry.pool.get_kv_size_bytes(), entry.pool.device)

    def tier_usage(self) -> list[TierUsage]:
        """Usage of the device pools and of each tier below (prefix pages and copies together).
        Reads plain integers only: takes no pool, cache, store or index lock."""
        pools = self.pools.list()
        device = TierUsage("device", sum(e.pool.get_kv_size_bytes() for e in pools),
                           self.config.pool_memory_bytes, len(pools))
        return [device, *(TierUsage(t.name, t.index.used, t.index.capacity, len(t.index)) for t in self.tiers.stack.tiers)]

    def add_shutdown_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` in :meth:`close` (hooks run last-added first; errors are logged, not raised)."""
        self._shutdown_hooks.append(hook)

    def close(self) -> None:
        """Run the shutdown hooks once (after the server stopped taking calls)."""
        hooks, self._shutdown_hooks = self._shutdown_hooks[::-1], []
        for hook in hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - shutdown goes on; the error is logged
                log.exception("shutdown hook %r failed", hook)
