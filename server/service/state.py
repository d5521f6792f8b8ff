"""What a running daemon holds: config, pools, the store of offloaded copies, counters.

One :class:`DaemonState` is built per daemon and handed to every servicer factory (see
``kvtier.server.service.registry``). Other components keep their state here too: give
:class:`DaemonState` a field (or pass a ``copy_store``), and register cleanup with
:meth:`DaemonState.add_shutdown_hook` so it runs after the server stopped (e.g. closing an LMDB env).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier import __version__
from kvtier.server.pool import resolve_device
from kvtier.server.service.config import DaemonConfig
from kvtier.server.service.offload_store import CopyStore, OffloadStore
from kvtier.server.service.pools import PoolRegistry, PoolRequest
from kvtier.server.service.tier_runtime import TierRuntime

log = logging.getLogger("kvtier.service")


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
    """Bytes a tier holds (``tier``: ``device``, ``host``, ``disk``) and its health (``reason``: why
    it is unhealthy; ``next_probe_in_s``: when it is probed next)."""

    tier: str
    used_bytes: int
    budget_bytes: int
    entries: int
    healthy: bool = True
    reason: str = ""
    next_probe_in_s: float = 0.0


class DaemonState:
    """Everything the servicers share.

    Args:
        config: the daemon's configuration.
        copy_store: where offloaded copies go; default an :class:`OffloadStore` of
            ``config.host_memory_bytes``. A store with a ``tier_usage() -> list[TierUsage]`` method
            reports its own tiers in stats.
    """

    def __init__(self, config: DaemonConfig | None = None, *, copy_store: CopyStore | None = None) -> None:
        self.config = config or DaemonConfig()
        self.device = str(resolve_device(self.config.device))
        self.pools = PoolRegistry(self.config.device, self.config.pool_memory_bytes)
        self.copy_store: CopyStore = copy_store if copy_store is not None else OffloadStore(self.config.host_memory_bytes)
        self.counters = Counters()
        self.version = __version__
        self._started = time.monotonic()
        self._shutdown_hooks: list[Callable[[], None]] = []
        self.metrics: Any = None  # DaemonMetrics when metrics are on (set by create_server)
        self.metrics_address = ""  # http://HOST:PORT/metrics once served
        self.tiers = TierRuntime(self, replace_copy_store=copy_store is None)  # host/disk tiers, prefix caches

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
        """Usage of the device pools and of the copy store's tier(s)."""
        pools = self.pools.list()
        device = TierUsage("device", sum(e.pool.get_kv_size_bytes() for e in pools),
                           self.config.pool_memory_bytes, len(pools))
        reporter = getattr(self.copy_store, "tier_usage", None)
        if callable(reporter):
            return [device, *reporter()]
        store = self.copy_store
        return [device, TierUsage("host", store.usage_bytes(), store.budget_bytes(), len(store))]

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
