"""The daemon's tiers: one stack (host, disk, mooncake: as configured) shared by the offload store and
one prefix cache per pool, and the monitor that probes unhealthy tiers and reports their health.

Built once per daemon from :class:`~kvtier.server.service.config.DaemonConfig` (host budget
``host_memory_bytes``, the rest from its ``tiers`` settings) and kept as ``DaemonState.tiers``.
Everything here is domain glue: it holds each pool's lock exclusive while its prefix cache moves
pages (prefix operations on one pool run one at a time; other pools are not blocked) and turns tier
errors into the daemon's typed errors (TierFullError -> ResourceExhausted, LeaseError -> NotFound,
bad keys -> InvalidArgument), which the one mapping in ``errors`` turns into status codes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from kvtier.server.service.errors import InvalidArgument, NotFound, ResourceExhausted
from kvtier.server.service.pools import PoolEntry
from kvtier.server.service.tier_settings import TierSettings
from kvtier.server.service.tier_store import TieredCopyStore
from kvtier.server.tiers import (
    DiskTierConfig, HostTierConfig, LeaseError, PrefixCache, PrefixLoad, PrefixLookup, RecordCodec, TierFullError,
    TierStack,
)
from kvtier.server.tiers.monitor import TierMonitor

if TYPE_CHECKING:
    from kvtier.server.service.state import DaemonState

log = logging.getLogger("kvtier.service")


class EntryAllocator:
    """A pool entry's page allocator as the prefix cache sees it: pages it takes are marked
    allocated (so ReadKV/WriteKV accept their slots) and cache-owned (so FreeSlots, Offload and
    PullKV refuse to free them) in the entry, and unmarked when the cache frees them."""

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
            self.entry.page_allocated[pages] = True
            self.entry.cache_owned[pages] = True
        return pages

    def free_pages_by_id(self, pages: list[int]) -> int:
        n = self.entry.allocator.free_pages_by_id(pages)
        if pages:
            ids = torch.tensor(pages, dtype=torch.int64)
            self.entry.page_allocated[ids] = False
            self.entry.cache_owned[ids] = False
        return n


@contextmanager
def tier_errors() -> Iterator[None]:
    """Turn tier-domain errors into the daemon's typed errors."""
    try:
        yield
    except TierFullError as e:
        raise ResourceExhausted(str(e)) from None
    except LeaseError as e:
        raise NotFound(str(e)) from None


def build_stack(host_bytes: int, settings: TierSettings, device: str = "cpu") -> TierStack:
    """The stack ``settings.tier_names`` names, fastest first, each tier from its typed config: the
    host tier (``host_bytes``; page-locked when ``device`` is CUDA unless the settings say), the LMDB
    disk tier (``disk_*``), the Mooncake Store tier (``settings.mooncake``)."""
    pin = settings.host_pin_memory if settings.host_pin_memory is not None else device.startswith("cuda")
    configs: dict[str, Any] = {
        "host": lambda: HostTierConfig(capacity_bytes=host_bytes, write_back=not settings.write_through, pin_memory=pin),
        "disk": lambda: DiskTierConfig(path=settings.disk_path, capacity_bytes=settings.disk_bytes,
                                       max_readers=settings.disk_max_readers, sync=settings.disk_sync,
                                       reserve_fraction=settings.disk_reserve_fraction),
        "mooncake": lambda: settings.mooncake,
    }
    return TierStack.from_configs([configs[name]() for name in settings.tier_names])


class TierRuntime:
    """The daemon's tier stack, its tiered offload store and the prefix caches of its pools.

    Args:
        state: the daemon state (its config, pool registry and shutdown hooks).
        replace_copy_store: make the tiered store ``state.copy_store`` (False when a store was
            passed to ``DaemonState`` explicitly).

    Raises:
        ValueError: bad ``[tiers]`` settings.
    """

    def __init__(self, state: DaemonState, *, replace_copy_store: bool = True) -> None:
        self.settings = TierSettings.coerce(getattr(state.config, "tiers", None))
        self.pools = state.pools
        self.stack = build_stack(state.config.host_memory_bytes, self.settings, state.device)
        self.copy_store = TieredCopyStore(self.stack) if self.stack.tiers else None
        if replace_copy_store and self.copy_store is not None:  # no tier at all: the plain store refuses
            state.copy_store = self.copy_store
        self._caches: dict[str, tuple[PoolEntry, PrefixCache]] = {}
        self._lock = threading.Lock()
        for t in self.stack.tiers:
            if hasattr(t, "open"):
                t.open()  # the daemon never forks after this; the startup scrub runs now
        self.monitor = TierMonitor(self.stack)
        self.monitor.start()
        state.add_shutdown_hook(self.close)

    def watch_health(self, on_change: Callable[[str, bool], None]) -> None:
        """Report each tier's health (``kvtier.tier.<name>``, healthy) now and on every change."""
        self.monitor.watch(on_change)

    def _cache(self, entry: PoolEntry) -> PrefixCache:
        with self._lock:
            held = self._caches.get(entry.pool_id)
            if held is None or held[0] is not entry:  # new pool, or one re-created under the same id
                namespace = b"p:" + bytes.fromhex(entry.model.fingerprint_digest())
                cache = PrefixCache(self.stack, EntryAllocator(entry), RecordCodec(entry.model),  # type: ignore[arg-type]
                                    pool=entry.pool, namespace=namespace,
                                    lease_ttl_seconds=self.settings.lease_ttl_seconds or None)
                self._caches[entry.pool_id] = (entry, cache)
                return cache
            return held[1]

    @contextmanager
    def cache(self, pool_id: str) -> Iterator[PrefixCache]:
        """The prefix cache of ``pool_id`` with the pool's lock held exclusive. Raises NotFound."""
        with self.pools.locked(pool_id, exclusive=True) as entry, tier_errors():
            yield self._cache(entry)

    @staticmethod
    def check_keys(keys: Sequence[bytes]) -> list[bytes]:
        """Raise InvalidArgument unless every key is 1..64 bytes."""
        keys = list(keys)
        if any(not 1 <= len(k) <= 64 for k in keys):
            raise InvalidArgument("page keys must be 1..64 bytes each")
        return keys

    def lookup(self, pool_id: str, keys: Sequence[bytes]) -> PrefixLookup:
        """Per tier, the longest prefix of ``keys`` present (pins nothing)."""
        keys = self.check_keys(keys)
        with self.cache(pool_id) as c:
            return c.lookup(keys)

    def load(self, pool_id: str, keys: Sequence[bytes], total_tokens: int | None) -> PrefixLoad:
        """Load the present prefix into device slots and allocate the rest (see :meth:`PrefixCache.load`)."""
        keys = self.check_keys(keys)
        with self.cache(pool_id) as c:
            return c.load(keys, total_tokens)

    def store(self, pool_id: str, lease: int, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        """Hand the lease's fresh pages at ``slots`` to the prefix cache under ``keys``."""
        keys = self.check_keys(keys)
        with self.cache(pool_id) as c:
            return c.store(lease, keys, torch.tensor(list(slots), dtype=torch.int64))

    def release(self, pool_id: str, lease: int) -> None:
        """End a lease: unpin its pages, free the fresh pages it did not store."""
        with self.cache(pool_id) as c:
            c.release(lease)

    def where_is(self, pool_id: str, keys: Sequence[bytes]) -> list[list[str]]:
        """Tiers holding each key's page, fastest first."""
        keys = self.check_keys(keys)
        with self.cache(pool_id) as c:
            return c.where_is(keys)

    def stats(self, pool_id: str | None = None) -> dict[str, Any]:
        """Tier stats and moves; with ``pool_id`` also that pool's prefix-cache counters and device use."""
        if not pool_id:
            return self.stack.stats()
        with self.cache(pool_id) as c:
            return c.stats()

    def close(self) -> None:
        """At shutdown (no calls in flight): move unpinned device-tier pages and the host tier's
        records down to the disk tier (so a restart finds them there), then close the tiers (flush
        and close the LMDB environment). Without a disk tier nothing is moved."""
        self.monitor.stop()
        try:
            if len(self.stack.cascade) > 1:
                with self._lock:
                    caches = [c for _, c in self._caches.values()]
                for cache in caches:
                    cache.drop_all()
                moved = self.stack.spill_down()
                log.info("tiers: %d records moved down to the disk tier at shutdown", moved)
        finally:
            self.stack.close()
