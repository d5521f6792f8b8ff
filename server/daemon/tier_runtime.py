"""The daemon's tiers: one stack (host, disk, mooncake: as configured) shared by the offload store and
one prefix cache per pool, and the monitor thread that probes unhealthy tiers.

Built once per daemon from :class:`~kvtier.server.daemon.config.DaemonConfig` (host budget
``host_memory_bytes``, the rest from its ``tiers`` settings) and kept as ``Daemon.tiers``.
Everything here is domain glue: it holds each pool's lock exclusive while its prefix cache moves
pages (prefix operations on one pool run one at a time; other pools are not blocked) and turns tier
errors into the daemon's typed errors (TierFullError -> ResourceExhausted, LeaseError -> NotFound,
bad keys -> InvalidArgument), which the one mapping in ``kvtier.server.service.errors`` turns into
status codes.

Tenants: a pool's prefix namespace is ``tenant_key(tenant, b"p:" + layout digest)``: pools of one
tenant with the same layout share pages; equal prompts of two tenants never share or probe each
other's pages. The tiers account each tenant's bytes (``TierIndex.set_groups``) for its quotas. The
shared Mooncake Store tier keeps the prefix pages of every tenant (its key filter looks past the
tenant, :func:`~kvtier.server.daemon.tenants.key_body`), and has no per-tenant quota (see
``kvtier.server.tiers.mooncake_store``).

Attach sessions (README "Local attach"): a lease taken in a session belongs to it (it never expires
by the lease TTL; the session's end releases it).

Monitoring (:meth:`TierRuntime.stats`) takes no pool, cache or index lock.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from kvtier.server.daemon.errors import Cancelled, InvalidArgument, NotFound, ResourceExhausted, Unavailable, always, still_wanted
from kvtier.server.daemon.pools import PoolEntry
from kvtier.server.daemon.quotas import Quotas
from kvtier.server.daemon.tenants import Caller, key_body, tenant_key, tenant_of_key
from kvtier.server.daemon.tier_settings import TierSettings
from kvtier.server.tiers import (
    DiskTierConfig, HostTier, HostTierConfig, LeaseError, PrefixCache, PrefixLoad, PrefixLookup, RecordCodec,
    TierFullError, TierStack, TierUnavailableError,
)
from kvtier.server.tiers.disk_faults import fault_file_from_env, slow_file_from_env
from kvtier.server.tiers.disk_lock import check_directory_free
from kvtier.server.tiers.monitor import TierMonitor

if TYPE_CHECKING:
    from kvtier.server.daemon.core import Daemon

log = logging.getLogger("kvtier.daemon")


class EntryAllocator:
    """A pool entry's page allocator as the prefix cache sees it: pages it takes are marked
    allocated (so ReadKV/WriteKV accept their slots) and cache-owned (so FreeSlots and Offload
    refuse to free them) in the entry, and unmarked when the cache frees them."""

    def __init__(self, entry: PoolEntry) -> None:
        self.entry = entry
        self.page_size = entry.allocator.page_size
        self.num_pages = entry.allocator.num_pages

    @property
    def free_pages(self) -> int:
        return self.entry.allocator.free_pages

    def pages_for(self, n_tokens: int) -> int:
        return self.entry.allocator.pages_for(n_tokens)

    def alloc_pages(self, n_pages: int) -> torch.Tensor | None:
        pages = self.entry.allocator.alloc_pages(n_pages)
        if pages is not None and pages.numel():
            ids = pages.numpy()
            self.entry.page_allocated.numpy()[ids] = True  # numpy views: one page at a time costs ~1 us, not ~10
            self.entry.cache_owned.numpy()[ids] = True
            self.entry.changed(ids, allocated=True)
        return pages

    def free_pages_by_id(self, pages: list[int]) -> int:
        n = self.entry.allocator.free_pages_by_id(pages)
        if pages:
            self.entry.page_allocated.numpy()[pages] = False
            self.entry.cache_owned.numpy()[pages] = False
            self.entry.changed(pages)
        return n


@contextmanager
def tier_errors() -> Iterator[None]:
    """Turn tier-domain errors into the daemon's typed errors."""
    try:
        yield
    except TierFullError as e:
        raise ResourceExhausted(str(e)) from None
    except TierUnavailableError as e:
        raise Unavailable(str(e)) from None
    except LeaseError as e:
        raise NotFound(str(e)) from None
    except ValueError as e:  # bad or repeated page keys, slots that are not the lease's fresh pages
        raise InvalidArgument(str(e)) from None


def _check_lease_owner(entry: PoolEntry, lease: str, session: Any) -> None:
    """Raise LeaseError (NotFound, as for an unknown lease) if ``lease`` was taken in an attach session other
    than ``session`` (None: the caller is in none): a session's leases are its own. Pool lock held."""
    owner = entry.lease_owner.get(lease)
    if owner is not None and owner != (session.number if session is not None else 0):
        raise LeaseError("the lease is unknown or released")  # the prefix cache's words for an absent lease


def _forget_lease(entry: PoolEntry, lease: str, session: Any) -> None:
    """The lease ended: no session holds it any more. Pool lock held."""
    entry.lease_owner.pop(lease, None)
    if session is not None:
        session.leases.discard(lease)


def build_stack(host_bytes: int, settings: TierSettings, device: str = "cpu") -> TierStack:
    """The stack ``settings.tier_names`` names, fastest first, each tier from its typed config: the
    host tier (``host_bytes``; page-locked when ``device`` is CUDA unless the settings say), the LMDB
    disk tier (``disk_*``), the Mooncake Store tier (``settings.mooncake``)."""
    pin = settings.host_pin_memory if settings.host_pin_memory is not None else device.startswith("cuda")
    if pin and not torch.cuda.is_available():  # a traceback from torch before (attack pass 6, A6-7)
        raise ValueError("tiers.host_pin_memory needs CUDA (page-locked memory), and this machine has none: "
                         "leave it out, or set it false")
    configs: dict[str, Any] = {
        "host": lambda: HostTierConfig(capacity_bytes=host_bytes, write_back=not settings.write_through, pin_memory=pin,
                                       policy=settings.policy),
        "disk": lambda: DiskTierConfig(path=settings.disk_path, capacity_bytes=settings.disk_bytes,
                                       max_readers=settings.disk_max_readers, sync=settings.disk_sync,
                                       write_behind=settings.disk_write_behind,
                                       reserve_fraction=settings.disk_reserve_fraction,
                                       probe_backoff_max_s=settings.disk_probe_backoff_max_seconds,
                                       probe_backoff_initial_s=min(1.0, settings.disk_probe_backoff_max_seconds),
                                       fault_file=fault_file_from_env(), slow_file=slow_file_from_env(),
                                       policy=settings.policy),
        "mooncake": lambda: settings.mooncake,
    }
    return TierStack.from_configs([configs[name]() for name in settings.tier_names])


def check_disk_path_free(config: Any) -> None:
    """Raise :class:`~kvtier.server.tiers.errors.DiskPathInUseError` when another daemon holds the disk
    directory of ``config`` (a :class:`~kvtier.server.daemon.config.DaemonConfig`) now: ``serve`` asks
    before it allocates anything. The disk tier's own lock still decides when it opens."""
    settings = TierSettings.coerce(getattr(config, "tiers", None))
    if "disk" in settings.tier_names:
        check_directory_free(os.path.realpath(settings.disk_path))  # where open_environment locks it


class TierRuntime:
    """The daemon's tier stack and the prefix caches of its pools.

    Args:
        state: the daemon (its config, pool registry and shutdown hooks).

    Raises:
        ValueError: bad ``[tiers]`` settings.
    """

    def __init__(self, state: Daemon) -> None:
        self.settings = TierSettings.coerce(getattr(state.config, "tiers", None))
        self.pools = state.pools
        self.quotas: Quotas = state.config.quotas
        self.stack = build_stack(state.config.host_memory_bytes, self.settings, state.device)
        host = self.stack.tier("host")
        if isinstance(host, HostTier):
            # one host arena for the daemon: host-tier records and pools' host copies, faulted in by a
            # background thread from the start; its one range is host.registration_range()
            try:
                self.pools.host_arena = host.arena
            except (MemoryError, OSError) as e:
                if isinstance(e, OSError) and e.errno != errno.ENOMEM:
                    raise
                # a one-line start error, as for a pool too large (attack pass 5, A5-5: a traceback)
                raise ResourceExhausted(f"--host-memory {state.config.host_memory_bytes:,} bytes cannot be mapped "
                                        f"(out of memory); give a host tier this machine can hold (`free -b`)") from None
        self._lock = threading.Lock()  # short: creating a pool's cache object only
        for t in self.stack.tiers:
            t.index.set_groups(tenant_of_key, lambda tenant, tier=t.name: self.quotas.tier_bytes(tenant, tier))
            if hasattr(t, "set_key_body"):
                t.set_key_body(key_body)  # a shared tier's namespaces lie past the tenant
            if hasattr(t, "open"):
                t.open()  # the daemon never forks after this; the startup scrub runs now
        self.monitor = TierMonitor(self.stack.tiers)  # probes unhealthy tiers; started by start_monitor()
        state.add_shutdown_hook(self.close)

    def start_monitor(self) -> None:
        """Start the thread that probes unhealthy tiers (the daemon does, once serving)."""
        self.monitor.start()

    def caches(self) -> list[tuple[str, PrefixCache]]:
        """``(tenant, prefix cache)`` of each pool whose cache was made (for monitoring: the registry's
        short lock only, no pool or cache lock)."""
        return [(e.tenant, e.prefix_cache) for e in self.pools.list() if e.prefix_cache is not None]

    def cache_of(self, entry: PoolEntry) -> PrefixCache:
        """``entry``'s prefix cache, made on first use (takes no pool lock)."""
        cache = entry.prefix_cache
        if cache is None:
            with self._lock:
                cache = entry.prefix_cache
                if cache is None:
                    namespace = tenant_key(entry.tenant, b"p:" + bytes.fromhex(entry.model.fingerprint_digest()))
                    cache = PrefixCache(self.stack, EntryAllocator(entry), RecordCodec(entry.model),  # type: ignore[arg-type]
                                        pool=entry.pool, namespace=namespace,
                                        lease_ttl_seconds=self.settings.lease_ttl_seconds or None,
                                        policy=self.settings.policy)
                    entry.prefix_cache = cache
        return cache

    @contextmanager
    def cache(self, caller: Caller, pool_id: str) -> Iterator[PrefixCache]:
        """The prefix cache of ``caller``'s pool ``pool_id`` with the pool's lock held exclusive. Raises NotFound."""
        with self.pools.locked(caller, pool_id, exclusive=True) as entry, tier_errors():
            yield self.cache_of(entry)

    @staticmethod
    def check_keys(keys: Sequence[bytes]) -> list[bytes]:
        """Raise InvalidArgument unless every key is 1..64 bytes."""
        keys = list(keys)
        if any(not 1 <= len(k) <= 64 for k in keys):
            raise InvalidArgument("page keys must be 1..64 bytes each")
        return keys

    def lookup(self, caller: Caller, pool_id: str, keys: Sequence[bytes]) -> PrefixLookup:
        """Per tier, the longest prefix of ``keys`` present (pins nothing)."""
        keys = self.check_keys(keys)
        with self.cache(caller, pool_id) as c:
            return c.lookup(keys)

    @contextmanager
    def _session_cache(self, caller: Caller, pool_id: str) -> Iterator[tuple[PoolEntry, PrefixCache, Any]]:
        """Like :meth:`cache`, also yielding the entry and the caller's attach session on this pool
        (None if not in one)."""
        with self.pools.locked(caller, pool_id, exclusive=True) as entry, tier_errors():
            session = caller.session if entry.owner_of(caller) else None
            yield entry, self.cache_of(entry), session

    def load(self, caller: Caller, pool_id: str, keys: Sequence[bytes], total_tokens: int | None,
             wanted: Callable[[], bool] = always) -> PrefixLoad:
        """Load the present prefix into device slots and allocate the rest (see :meth:`PrefixCache.load`);
        in an attach session the lease is the session's (no TTL; released when the session ends).

        Raises:
            Cancelled: ``wanted()`` was false once the pool's lock was held, or once the load was
                done (its pages written down to a slow disk to make room): the lease is released
                again, so a caller that gave up leaves no lease behind (attack pass 8, A8-6)."""
        keys = self.check_keys(keys)
        with self._session_cache(caller, pool_id) as (entry, c, session):
            still_wanted(wanted, "LoadPrefix")
            ld = c.load(keys, total_tokens, expires=session is None)
            if not wanted():  # gone while it made room: nobody would ever release the lease
                c.release(ld.lease)
                raise Cancelled("the LoadPrefix was cancelled or ran past its deadline while it loaded; its lease "
                                "was released again; nothing was changed")
            if session is not None:
                session.leases.add(ld.lease)
                entry.lease_owner[ld.lease] = session.number
            return ld

    def store(self, caller: Caller, pool_id: str, lease: str, keys: Sequence[bytes], slots: Sequence[int], *,
              release: bool = False, wanted: Callable[[], bool] = always) -> int:
        """Hand the lease's fresh pages at ``slots`` to the prefix cache under ``keys``; with ``release``
        then end the lease in the same call (one call per request instead of two; not if the store fails).

        Raises:
            Cancelled: ``wanted()`` was false once the pool's lock was held (the caller is gone):
                nothing is stored or released."""
        keys = self.check_keys(keys)
        with self._session_cache(caller, pool_id) as (entry, c, session):
            still_wanted(wanted, "StorePrefix")
            _check_lease_owner(entry, lease, session)
            n = c.store(lease, keys, torch.tensor(list(slots), dtype=torch.int64))
            if release:
                c.release(lease)
                _forget_lease(entry, lease, session)
            return n

    def release(self, caller: Caller, pool_id: str, lease: str, wanted: Callable[[], bool] = always) -> None:
        """End a lease: unpin its pages, free the fresh pages it did not store.

        Raises:
            Cancelled: ``wanted()`` was false once the pool's lock was held: the lease stays (its
                TTL, or a later release, ends it)."""
        with self._session_cache(caller, pool_id) as (entry, c, session):
            still_wanted(wanted, "ReleasePrefix")
            _check_lease_owner(entry, lease, session)
            c.release(lease)
            _forget_lease(entry, lease, session)

    def release_session_leases(self, entry: PoolEntry, session: Any) -> int:
        """Release every lease ``session`` still holds on ``entry`` (caller holds the pool's lock
        exclusive); returns how many were open. Leases released meanwhile by their id are skipped."""
        cache = entry.prefix_cache
        released = 0
        for lease in sorted(session.leases):
            if cache is None:
                break
            try:
                cache.release(lease)
                released += 1
            except LeaseError:
                pass
            entry.lease_owner.pop(lease, None)
        session.leases.clear()
        return released

    def where_is(self, caller: Caller, pool_id: str, keys: Sequence[bytes]) -> list[list[str]]:
        """Tiers holding each key's page, fastest first."""
        keys = self.check_keys(keys)
        with self.cache(caller, pool_id) as c:
            return c.where_is(keys)

    def stats(self, caller: Caller, pool_id: str | None = None) -> dict[str, Any]:
        """Tier stats and moves (daemon-wide), each tier's bytes and quota of ``caller``'s tenant
        (``tenant_used_bytes``, ``tenant_quota_bytes``), and with ``pool_id`` that pool's prefix-cache
        counters and device use. Monitoring: takes no pool, cache or index lock."""
        if pool_id:
            out = self.cache_of(self.pools.get(caller, pool_id)).snapshot()
        else:
            out = self.stack.stats()
        for t in self.stack.tiers:
            row = out["tiers"][t.name]
            row["tenant_used_bytes"] = t.index.group_used(caller.tenant)
            row["tenant_quota_bytes"] = self.quotas.tier_bytes(caller.tenant, t.name)
        return out

    def close(self) -> None:
        """At shutdown (no calls in flight): move unpinned device-tier pages and the host tier's
        records down to the disk tier (so a restart finds them there), then close the tiers (flush
        and close the LMDB environment). Without a disk tier nothing is moved."""
        self.monitor.stop()
        try:
            if len(self.stack.cascade) > 1:
                pages = sum(entry.prefix_cache.drop_all() for entry in self.pools.list() if entry.prefix_cache is not None)
                moved = self.stack.spill_down()
                log.info("tiers: at shutdown %d unpinned device pages went down the stack and %d records moved "
                         "down to the disk tier", pages, moved)
        finally:
            self.stack.close()
