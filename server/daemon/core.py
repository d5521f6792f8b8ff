"""The daemon's domain root: config, tenants, pools, tiers and prefix caches, the offload store, transfer, counters.

One :class:`Daemon` is built per daemon process. The gRPC servicers (``kvtier.server.service``) call
into it and only translate; an in-process user (tests, replay, an adapter's local mode) calls the
same objects directly, passing a :class:`~kvtier.server.daemon.tenants.Caller`::

    d = Daemon(DaemonConfig(device="cpu", host_memory_bytes=64 << 20))
    me = Caller.default()
    entry = d.pools.create(me, PoolRequest(pool_id="p", preset="glm-5.2", num_layers=4, size_tokens=4096))
    with d.pools.locked(me, "p", exclusive=True) as e:
        slots = e.alloc(128)
    kv_ops.offload(d.pools, d.offload_store, me, "p", "req-1", slots, free_slots=True)
    d.close()

Components keep their state here: give :class:`Daemon` a field and register cleanup with
:meth:`Daemon.add_shutdown_hook` so it runs after the server stopped (e.g. closing an LMDB
environment). Nothing here imports grpc or ``kvtier.v1``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from kvtier import __version__
from kvtier.server.daemon.attach import AttachService
from kvtier.server.daemon.config import MAX_ATTACH_SESSIONS, DaemonConfig
from kvtier.server.daemon.errors import always
from kvtier.server.daemon.offload_store import OffloadStore
from kvtier.server.daemon.pools import PoolEntry, PoolRegistry, PoolRequest
from kvtier.server.daemon.sessions import AttachSession, SessionRegistry
from kvtier.server.daemon.private_files import read_token_file
from kvtier.server.daemon.tenants import MIN_TOKEN_CHARS, Caller, TokenTable
from kvtier.server.daemon.tier_runtime import TierRuntime
from kvtier.server.daemon.transfer import TransferState
from kvtier.server.daemon.unit_settings import UnitSettings
from kvtier.server.daemon.unit_store import UnitStore
from kvtier.server.model_config import load_hf_config_text
from kvtier.server.pool import resolve_device, slots_of_pages
from kvtier.server.tiers.policies import resolve_policy

log = logging.getLogger("kvtier.daemon")


class Counters:
    """Thread-safe named event and byte counters of each tenant (``kv_writes``, ``kv_bytes_written``, ...).

    Leaf lock: nothing is taken or called while it is held.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[str, int]] = {}

    def add(self, caller: Caller, name: str, value: int = 1) -> None:
        """Add ``value`` to ``caller``'s tenant's counter ``name``."""
        with self._lock:
            mine = self._values.setdefault(caller.tenant, {})
            mine[name] = mine.get(name, 0) + value

    def snapshot(self, caller: Caller) -> dict[str, int]:
        """A copy of ``caller``'s tenant's counters."""
        with self._lock:
            return dict(self._values.get(caller.tenant, {}))


@dataclass(frozen=True)
class TierUsage:
    """Bytes a tier holds (``tier``: ``device``, ``host``, ``disk``): daemon-wide, and the caller's
    tenant's; and the tier's health (``reason``: why it is unhealthy; ``next_probe_in_s``: when it is
    probed next; ``policy``: the name of its eviction policy, e.g. ``lru``)."""

    tier: str
    used_bytes: int
    budget_bytes: int
    entries: int
    tenant_used_bytes: int = 0
    tenant_quota_bytes: int | None = None
    healthy: bool = True
    reason: str = ""
    next_probe_in_s: float = 0.0
    policy: str = ""


@dataclass(frozen=True)
class DaemonStats:
    """What GetStats answers: the caller's pools and counters, every tier's use (daemon-wide and the
    tenant's) and health, the metrics endpoint's URL ("" when off), the attach channel's socket ("" on
    a TCP daemon) and the tenant's live attach sessions."""

    tenant: str
    version: str
    uptime_seconds: float
    device: str
    pools: list[PoolEntry]
    tiers: list[TierUsage]
    counters: dict[str, int] = field(default_factory=dict)
    metrics_address: str = ""
    attach_socket: str = ""
    attach_sessions: int = 0


class Daemon:
    """Everything a daemon holds; the servicers and in-process users share it.

    Args:
        config: the daemon's configuration.

    Attributes:
        tokens: the bearer-token table (None without ``auth_tokens``: one tenant, ``default``).
        pools: the pool registry. tiers: the host/disk stack, the pools' prefix caches and the tier monitor.
        offload_store: the one store of offloaded copies, in ``tiers.stack``.
        units: the unit store (an engine's pages, KV + indexer as one record each), in ``tiers.stack``.
        transfer: PD transfer (layouts, pulls, page streams).
        sessions: live attach sessions; attach: attach handshakes and staging buffers
            (README "Local attach"). attach_socket: the attach channel's socket path once it
            listens ("" without one: a TCP daemon).
        metrics: the Prometheus metrics (``DaemonMetrics``) when ``metrics_port`` is set, else None;
            ``metrics_address`` is their URL once served ("" before or without); ``metrics_token``
            the bearer token scrapes must send (from ``metrics_token_file``; None: none).

    Raises:
        ValueError: bad config values (device, ``[tiers]``); AuthConfigError (a ValueError) for an
            unusable tokens file or metrics token file.
        TransferEngineUnavailable: ``transfer_engine = "mooncake"`` but the engine cannot start.
    """

    def __init__(self, config: DaemonConfig | None = None) -> None:
        self.config = config or DaemonConfig()
        self.tokens: TokenTable | None = TokenTable.from_file(self.config.auth_tokens) if self.config.auth_tokens else None
        self.metrics_token: str | None = (read_token_file(self.config.metrics_token_file, "--metrics-token-file",
                                                          MIN_TOKEN_CHARS) if self.config.metrics_token_file else None)
        self.device = str(resolve_device(self.config.device))
        self.pools = PoolRegistry(self.config.device, self.config.pool_memory_bytes, self.config.quotas)
        self.counters = Counters()
        self.version = __version__
        self._started = time.monotonic()
        self._shutdown_hooks: list[Callable[[], None]] = []
        self.failed_shutdown_hooks = 0  # hooks of close() that raised (serve exits 1 then)
        self.metrics: Any = None  # DaemonMetrics when metrics are on (set by the server)
        self.metrics_address = ""  # http://HOST:PORT/metrics once served
        self.tiers = TierRuntime(self)  # host/disk tiers, prefix caches
        self.offload_store = OffloadStore(self.tiers.stack, self.config.quotas)
        self.units = UnitStore(self.tiers.stack, UnitSettings.coerce(getattr(self.config, "units", None)),
                               self.config.quotas)
        self.transfer = TransferState(self)  # PD transfer: the engine (if configured) and its registrations
        self.add_shutdown_hook(self.transfer.close)
        self.sessions = SessionRegistry(MAX_ATTACH_SESSIONS, self.config.attach_sessions_per_tenant)
        self.attach = AttachService(self)
        self.attach_socket = ""  # set by the attach channel once it listens

    @property
    def uptime_seconds(self) -> float:
        return time.monotonic() - self._started

    def create_configured_pools(self) -> None:
        """Create the pools of ``config.pools`` (a preset name or a path to an HF config.json each),
        each for its spec's tenant."""
        for spec in self.config.pools:
            path = Path(spec.model)
            hf = load_hf_config_text(path.read_bytes(), f"[[pools]] model {spec.model}") if path.is_file() else None
            req = PoolRequest(pool_id=spec.pool_id, preset="" if hf is not None else spec.model, hf_config=hf,
                              model_name=path.stem if hf is not None else "", num_layers=spec.num_layers,
                              start_layer=spec.start_layer, end_layer=spec.end_layer,
                              kv_cache_dtype=spec.kv_cache_dtype, page_size=spec.page_size, role=spec.role,
                              size_tokens=spec.tokens, memory_budget_bytes=spec.memory_bytes)
            entry = self.pools.create(Caller(spec.tenant), req)
            log.info("pool %r of tenant %r: %s %s, %d tokens, %d bytes on %s", entry.pool_id, entry.tenant,
                     entry.model.name, entry.role, entry.allocator.size, entry.pool.get_kv_size_bytes(), entry.pool.device)

    def end_session(self, session: AttachSession, reason: str) -> bool:
        """End an attach session (its connection closed, or its pool was deleted): free the slots it
        owns and release its leases, under its pool's exclusive lock (so no call in the session is
        half-way); close its staging buffers. Counted and logged. Returns False if it had ended already."""
        if not self.sessions.remove(session):
            return False
        entry, freed, released = session.entry, 0, 0
        if entry is None:  # a storage session: staging buffers only
            session.ended = True
        else:
            with entry.lock.exclusive():
                session.ended = True  # a call in the session that takes the lock after this fails NOT_FOUND
                if not entry.deleted:
                    # pages a WriteKV of the session is writing in place stay: that write frees them when it ends
                    pages = entry.session_pages(session.number)
                    pages = pages[~entry.page_claimed[pages]] if entry.claimed_pages else pages
                    if pages.numel():
                        slots = slots_of_pages(pages, entry.page_size)
                        freed = entry.free(slots, session.number)
                    released = self.tiers.release_session_leases(entry, session)
        for shm in session.staging:
            shm.close_fd()
        self.sessions.release_staging(session.tenant, session.staging_bytes)
        session.staging.clear()
        caller = Caller(session.tenant)
        self.counters.add(caller, "attach_sessions_ended")
        self.counters.add(caller, "attach_pages_freed", freed)
        self.counters.add(caller, "attach_leases_released", released)
        log.info("attach session %d of %s ended (%s): %d pages freed, %d leases released", session.number,
                 f"pool {entry.pool_id!r}" if entry is not None else "the unit store", reason, freed, released)
        hook = getattr(session, "close_hook", None)
        if hook is not None:
            hook()  # the channel closes the connection (when the daemon ended the session)
        return True

    def delete_pool(self, caller: Caller, pool_id: str, *, force: bool = False,
                    wanted: Callable[[], bool] = always) -> int:
        """DeletePool: delete ``caller``'s pool (see :meth:`PoolRegistry.delete`; ``wanted``: whether
        the caller is still there once the pool's lock is held) and end the attach sessions on it
        (their workers' connections are closed). Returns the bytes freed."""
        entry = self.pools.get(caller, pool_id)
        freed = self.pools.delete(caller, pool_id, force=force, wanted=wanted)
        for session in self.sessions.of_entry(entry):
            self.end_session(session, "its pool was deleted")
        return freed

    def tier_usage(self, caller: Caller) -> list[TierUsage]:
        """Usage of the device pools and of each tier below (prefix pages and copies together):
        daemon-wide and ``caller``'s tenant's, with each tier's health. Reads plain integers and the
        health's leaf lock only: takes no pool, cache, store or index lock."""
        pools = self.pools.list()
        q = self.config.quotas.of(caller.tenant)
        device = TierUsage("device", sum(e.pool.get_kv_size_bytes() for e in pools), self.config.pool_memory_bytes,
                           len(pools), sum(e.pool.get_kv_size_bytes() for e in pools if e.tenant == caller.tenant),
                           q.pool_bytes, policy=resolve_policy(self.tiers.settings.policy))
        out = [device]
        for t in self.tiers.stack.tiers:
            h = t.health.snapshot()
            out.append(TierUsage(t.name, t.index.used, t.index.capacity, len(t.index), t.index.group_used(caller.tenant),
                                 q.tier_bytes(t.name), h.healthy, h.reason, h.next_probe_in_s, t.index.policy.name))
        return out

    def stats(self, caller: Caller) -> DaemonStats:
        """GetStats: monitoring, so only the registry's short lock and the counters' leaf lock."""
        return DaemonStats(caller.tenant, self.version, self.uptime_seconds, self.device, self.pools.list(caller),
                           self.tier_usage(caller), self.counters.snapshot(caller), self.metrics_address,
                           self.attach_socket, sum(1 for s in self.sessions.all() if s.tenant == caller.tenant))

    def add_shutdown_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` in :meth:`close` (hooks run last-added first; errors are logged, not raised)."""
        self._shutdown_hooks.append(hook)

    def close(self) -> None:
        """Run the shutdown hooks once (after the server stopped taking calls). A hook that fails is
        logged and counted in :attr:`failed_shutdown_hooks` (the daemon then exits 1); the rest run."""
        hooks, self._shutdown_hooks = self._shutdown_hooks[::-1], []
        for hook in hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - shutdown goes on; the error is logged
                self.failed_shutdown_hooks += 1
                log.exception("shutdown hook %r failed", hook)
