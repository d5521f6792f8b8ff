"""Client methods of ``kvtier.v1.TierService``: the prefix cache over the device, host and disk tiers.

Page keys come from :func:`kvtier.page_keys.page_keys` (chained xxh3_128 of the token ids). A
request: :meth:`TierMixin.lookup_prefix` -> :meth:`TierMixin.load_prefix` (a lease) -> write the
new KV into the fresh slots (``write_kv``) -> :meth:`TierMixin.store_prefix` ->
:meth:`TierMixin.release_prefix`. :meth:`TierMixin.where_is` says which tier holds each key, so a
test can assert an eviction order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtier.client.base import BaseClient
from kvtier.client.pool import Slots, slot_list
from kvtier.v1 import tier_pb2, tier_pb2_grpc


@dataclass(frozen=True)
class PrefixLookup:
    """``per_tier``: tier -> longest prefix wholly there (pages); ``tiers``: the fastest tier of each
    page of the longest prefix present in some tier."""

    per_tier: dict[str, int]
    tiers: list[str]


@dataclass(frozen=True, repr=False)
class PrefixLease:
    """A loaded prefix: ``slots`` ``(total_tokens,)`` int64 (loaded pages first, then fresh ones),
    ``tiers`` the tier each loaded page came from. Release it with :meth:`TierMixin.release_prefix`."""

    pool_id: str
    lease_id: str
    """32 hex characters (128 random bits): the lease's name; keep it to yourself."""
    slots: torch.Tensor
    tiers: list[str]

    @property
    def loaded_pages(self) -> int:
        """Pages of the prefix that were loaded."""
        return len(self.tiers)

    def __repr__(self) -> str:
        return f"PrefixLease(pool_id={self.pool_id!r}, slots={self.slots.numel()}, tiers={self.tiers})"


@dataclass
class TierReport:
    """What :meth:`TierMixin.tier_stats` returns.

    Attributes:
        tiers: tier -> counters (``capacity_bytes``, ``used_bytes``, ``entries``, ``pinned``, ``hits``,
            ``misses``, ``damaged``, ``writes``, ``bytes_written``, ``bytes_read``, ``evictions``, ...;
            daemon-wide) and the caller's tenant's ``tenant_used_bytes`` and ``tenant_quota_bytes``
            (None: no quota).
        moves: ``"src->dst"`` -> ``{"count": records, "bytes": bytes}``.
        prefix_counters: the pool's prefix-cache counters (with a pool id).
        device: the pool's device-tier use: ``pages``, ``pinned_pages``, ``free_pages``, ``open_leases``.
    """

    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    moves: dict[str, dict[str, int]] = field(default_factory=dict)
    prefix_counters: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)


class TierMixin(BaseClient):
    """TierService methods; lookups, where-is and stats retry on UNAVAILABLE, the rest never do."""

    @property
    def _tiers(self) -> tier_pb2_grpc.TierServiceStub:
        return self.stub(tier_pb2_grpc.TierServiceStub)

    def lookup_prefix(self, pool_id: str, page_keys: Sequence[bytes], *, timeout: float | None = None) -> PrefixLookup:
        """Per tier, the longest prefix of ``page_keys`` present. Pins nothing. Raises NotFoundError."""
        r = self.unary(self._tiers.LookupPrefix, tier_pb2.LookupPrefixRequest(pool_id=pool_id, page_keys=list(page_keys)),
                       idempotent=True, timeout=timeout)
        return PrefixLookup(dict(r.prefix_pages), list(r.page_tiers))

    def load_prefix(self, pool_id: str, page_keys: Sequence[bytes], total_tokens: int | None = None, *,
                    timeout: float | None = None) -> PrefixLease:
        """Load the present prefix of ``page_keys`` into device slots, allocate slots for the rest.

        Raises:
            ResourceExhaustedError: the pool cannot make room (too much is pinned); nothing changed.
            NotFoundError, InvalidArgumentError.
        """
        req = tier_pb2.LoadPrefixRequest(pool_id=pool_id, page_keys=list(page_keys))
        if total_tokens is not None:
            req.total_tokens = total_tokens
        r = self.unary(self._tiers.LoadPrefix, req, idempotent=False, timeout=timeout)
        return PrefixLease(pool_id, r.lease_id, torch.tensor(list(r.slots), dtype=torch.int64), list(r.page_tiers))

    def store_prefix(self, lease: PrefixLease, page_keys: Sequence[bytes], slots: Slots, *, release: bool = False,
                     timeout: float | None = None) -> int:
        """Hand the lease's fresh pages at ``slots`` (whole pages, in key order) to the cache; returns
        the pages adopted. ``release``: then end the lease in the same call (no ReleasePrefix needed;
        if the store fails the lease stays open). Raises InvalidArgumentError (not the lease's fresh
        pages), NotFoundError."""
        req = tier_pb2.StorePrefixRequest(pool_id=lease.pool_id, lease_id=lease.lease_id, page_keys=list(page_keys),
                                          slots=slot_list(slots), release=release)
        return self.unary(self._tiers.StorePrefix, req, idempotent=False, timeout=timeout).stored_pages

    def release_prefix(self, lease: PrefixLease, *, timeout: float | None = None) -> None:
        """Unpin the lease's pages and free its fresh pages that were not stored. Raises NotFoundError."""
        req = tier_pb2.ReleasePrefixRequest(pool_id=lease.pool_id, lease_id=lease.lease_id)
        self.unary(self._tiers.ReleasePrefix, req, idempotent=False, timeout=timeout)

    def where_is(self, pool_id: str, page_keys: Sequence[bytes], *, timeout: float | None = None) -> list[list[str]]:
        """For each key, the tiers holding its page (``device``, ``host``, ``disk``; fastest first)."""
        r = self.unary(self._tiers.WhereIs, tier_pb2.WhereIsRequest(pool_id=pool_id, page_keys=list(page_keys)),
                       idempotent=True, timeout=timeout)
        return [list(loc.tiers) for loc in r.locations]

    def tier_stats(self, pool_id: str = "", *, timeout: float | None = None) -> TierReport:
        """Tier counters and moves; with ``pool_id`` also that pool's prefix-cache counters."""
        r = self.unary(self._tiers.GetTierStats, tier_pb2.TierStatsRequest(pool_id=pool_id), idempotent=True, timeout=timeout)
        rep = TierReport()
        for t in r.tiers:
            rep.tiers[t.tier] = {f.name: getattr(t, f.name) for f in t.DESCRIPTOR.fields if f.name != "tier"}
            if not t.HasField("tenant_quota_bytes"):
                rep.tiers[t.tier]["tenant_quota_bytes"] = None
        for m in r.moves:
            rep.moves[f"{m.source}->{m.destination}"] = {"count": m.count, "bytes": m.bytes}
        rep.prefix_counters = dict(r.prefix_counters)
        if r.HasField("device"):
            rep.device = {f.name: getattr(r.device, f.name) for f in r.device.DESCRIPTOR.fields}
        return rep
