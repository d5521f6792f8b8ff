"""The daemon's metric rows, built at scrape time from what the tiers, caches and pools already count.

Every read here is a plain integer (``TierIndex.used``, ``PagedTokenAllocator.free_pages``, a prefix
cache's counter dict, whose keys never change) or takes a leaf lock only (a tier's counters via
:meth:`~kvtier.server.tiers.base.Tier.counter_snapshot`, the stack's moves via
:meth:`~kvtier.server.tiers.stack.TierStack.moves_snapshot`). Nothing waits for a pool, prefix cache,
offload store or tier index lock, so a scrape can never stop the data path, and the data path pays
nothing for the metrics.

Labels are built in :func:`tier_labels`, :func:`pool_labels`, :func:`move_labels` and
:func:`tenant_labels` only: a label every row of one kind gets is one line there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.server.observe.metrics import Rows, Snapshot
from kvtier.server.tiers.prefix import DEVICE, PrefixCache
from kvtier.server.tiers.stack import TierStack


def tier_labels(tier: str) -> dict[str, str]:
    """Labels of a per-tier row."""
    return {"tier": tier}


def pool_labels(pool_id: str, tenant: str) -> dict[str, str]:
    """Labels of a per-pool row (pool ids are per tenant: two tenants may both have a pool ``p``)."""
    return tenant_labels({"pool": pool_id}, tenant)


def tenant_labels(labels: dict[str, str], tenant: str) -> dict[str, str]:
    """``labels`` of a row that belongs to one tenant, with its ``tenant``."""
    return {**labels, "tenant": tenant}


def move_labels(src: str, dst: str) -> dict[str, str]:
    """Labels of a move row (``dst`` ``gone``: dropped past the last tier; ``host(present)``: already there;
    ``mooncake(unhealthy)``: a publish to that shared tier skipped while it is unhealthy)."""
    return {"src": src, "dst": dst}


@dataclass(frozen=True)
class PoolView:
    """What the metrics read of one pool: its id, free and total pages, bytes of one page, its tenant."""

    pool_id: str
    free_pages: int
    total_pages: int
    page_bytes: int
    tenant: str = "default"


def pool_view(entry: Any) -> PoolView:
    """A :class:`PoolView` of a daemon pool entry (plain attribute reads; no lock)."""
    pool, alloc = entry.pool, entry.allocator
    page_bytes = pool.layer_num * pool.page_size * pool.row_bytes + len(pool.live_layers) * pool.index_page_bytes
    return PoolView(entry.pool_id, alloc.free_pages, alloc.num_pages, page_bytes, entry.tenant)


def daemon_snapshot(stack: TierStack, caches: Callable[[], Sequence[tuple[str, PrefixCache]]],
                    pools: Callable[[], Sequence[PoolView]]) -> Snapshot:
    """Rows of every metric in :data:`kvtier.server.observe.metrics.METRICS`.

    Rows of things that belong to one tenant carry a ``tenant`` label: pools (free pages) and the
    prefix caches' hits and misses (a cache is one pool's). Tier-wide rows (usage, capacity, health,
    moves, evictions, checksum failures) do not: a tier's records of every tenant share its budget.

    Args:
        stack: the daemon's tiers (host, disk, mooncake: as configured).
        caches: ``(tenant, prefix cache)`` of each pool that has one (device tier).
        pools: a view of each pool.
    """
    views = list(pools())
    owned = [(tenant, dict(c.counters)) for tenant, c in caches()]
    counters = [c for _, c in owned]
    tenants = sorted({tenant for tenant, _ in owned})
    snap: dict[str, Rows] = {name: [] for name in (
        "kvtier_tier_used_bytes", "kvtier_tier_capacity_bytes", "kvtier_tier_healthy", "kvtier_hit_pages",
        "kvtier_miss_pages", "kvtier_moves", "kvtier_moved_bytes", "kvtier_evictions", "kvtier_checksum_failures",
        "kvtier_pool_free_pages", "kvtier_tier_policy")}
    dev = tier_labels(DEVICE)
    snap["kvtier_tier_used_bytes"].append((dev, sum((v.total_pages - v.free_pages) * v.page_bytes for v in views)))
    snap["kvtier_tier_capacity_bytes"].append((dev, sum(v.total_pages * v.page_bytes for v in views)))
    snap["kvtier_tier_healthy"].append((dev, 1))
    snap["kvtier_evictions"].append((dev, sum(c.get("evicted_pages", 0) for c in counters)))
    for t in stack.tiers:
        lab = tier_labels(t.name)
        snap["kvtier_tier_policy"].append(({**lab, "policy": t.index.policy.name}, 1))
        counts = t.counter_snapshot()
        snap["kvtier_tier_used_bytes"].append((lab, t.index.used))
        snap["kvtier_tier_capacity_bytes"].append((lab, t.index.capacity))
        snap["kvtier_tier_healthy"].append((lab, 1 if t.health.healthy else 0))
        snap["kvtier_evictions"].append((lab, counts.evictions))
        snap["kvtier_checksum_failures"].append((lab, counts.damaged))
    for tenant in tenants:
        mine = [c for t, c in owned if t == tenant]
        for name in [DEVICE, *stack.names]:
            snap["kvtier_hit_pages"].append((tenant_labels(tier_labels(name), tenant),
                                             sum(c.get(f"hit_pages_{name}", 0) for c in mine)))
        snap["kvtier_miss_pages"].append((tenant_labels({}, tenant), sum(c.get("miss_pages", 0) for c in mine)))
    for key, m in sorted(stack.moves_snapshot().items()):
        src, _, dst = key.partition("->")
        snap["kvtier_moves"].append((move_labels(src, dst), m["count"]))
        snap["kvtier_moved_bytes"].append((move_labels(src, dst), m["bytes"]))
    for v in views:
        snap["kvtier_pool_free_pages"].append((pool_labels(v.pool_id, v.tenant), v.free_pages))
    return snap
