"""Per-tenant byte quotas: on pools, and on the host and disk tiers (``[quotas.<tenant>]`` in the config).

A quota is a cap, not a reservation:

* ``pool_bytes``: the tenant's pools together; a CreatePool past it is RESOURCE_EXHAUSTED naming it.
* ``host_bytes`` / ``disk_bytes``: the tenant's records (prefix pages and offloaded copies together) in
  that tier. When one of its records would pass the quota, the tenant's *own* least recently used
  records in that tier make room, moving down the stack like any eviction (host -> disk -> gone);
  another tenant's records are never evicted for it. The tiers' shared budgets still evict LRU across
  all tenants. A prefix page is a cache entry: one that fits no tier within the quotas is dropped
  (counted ``<tier>->gone``), never an error. An offloaded copy is the caller's request: one that fits
  no tier within the tenant's quotas is refused with RESOURCE_EXHAUSTED naming them.

A missing key means no cap; ``[quotas."*"]`` applies to every tenant without a table of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.server.daemon.config_keys import check_known_keys
from kvtier.server.daemon.tenants import check_tenant_name

ANY_TENANT = "*"
TIER_FIELDS = {"host": "host_bytes", "disk": "disk_bytes"}


@dataclass(frozen=True)
class Quota:
    """One tenant's caps in bytes; None: no cap.

    Attributes:
        pool_bytes: all of the tenant's pools together.
        host_bytes: the tenant's records in the host tier.
        disk_bytes: the tenant's records in the disk tier (charged as the disk tier charges them:
            whole LMDB pages).
    """

    pool_bytes: int | None = None
    host_bytes: int | None = None
    disk_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("pool_bytes", "host_bytes", "disk_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"quota {name} must be a byte count >= 0, got {v!r}")

    def tier_bytes(self, tier: str) -> int | None:
        """The cap for tier ``tier`` (``host``, ``disk``; other tiers have none)."""
        name = TIER_FIELDS.get(tier)
        return getattr(self, name) if name else None


NO_QUOTA = Quota()


class Quotas:
    """Quotas by tenant, with ``"*"`` as the fallback for tenants without their own.

    Args:
        by_tenant: ``{tenant or "*": Quota}``.

    Raises:
        ValueError: a bad tenant name.
    """

    def __init__(self, by_tenant: Mapping[str, Quota] | None = None) -> None:
        self._by_tenant = dict(by_tenant or {})
        for tenant in self._by_tenant:
            if tenant != ANY_TENANT:
                check_tenant_name(tenant)

    def of(self, tenant: str) -> Quota:
        """``tenant``'s quota (its own, else ``"*"``'s, else none)."""
        return self._by_tenant.get(tenant) or self._by_tenant.get(ANY_TENANT) or NO_QUOTA

    def tier_bytes(self, tenant: str, tier: str) -> int | None:
        """``tenant``'s cap in tier ``tier`` (None: none)."""
        return self.of(tenant).tier_bytes(tier)

    def __bool__(self) -> bool:
        return bool(self._by_tenant)

    @classmethod
    def from_mapping(cls, tables: Mapping[str, Any], parse_bytes: Any) -> Quotas:
        """From the config's ``[quotas.<tenant>]`` tables (byte sizes may be ``"8GiB"``).

        Raises:
            ValueError: unknown keys or bad values (the message names the table).
        """
        if not isinstance(tables, Mapping):
            raise ValueError("[quotas] must hold one table per tenant, e.g. [quotas.team-a]")
        out = {}
        for tenant, table in tables.items():
            where = f"[quotas.{tenant}]"
            if isinstance(table, Quota):
                out[tenant] = table
                continue
            if not isinstance(table, Mapping):
                raise ValueError(f"{where} must be a table with pool_bytes, host_bytes, disk_bytes")
            check_known_keys(Quota, table, where)
            out[tenant] = Quota(**{k: parse_bytes(v, f"{where} {k}") for k, v in table.items()})
        return cls(out)
