"""The daemon's tier settings (``[tiers]`` in the TOML config, ``--disk-*`` flags of ``kvtier serve``).

The host tier's budget is the daemon's ``host_memory_bytes``; these fields configure the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.server.daemon.config_keys import check_known_keys

GiB = 1 << 30


@dataclass(frozen=True)
class TierSettings:
    """Tier settings of a daemon.

    Attributes:
        disk_path: directory of the LMDB disk tier; empty: no disk tier (host only).
        disk_bytes: the ``--disk-size`` budget: LMDB ``map_size`` in bytes.
        disk_max_readers: LMDB reader slots (concurrent read transactions).
        disk_sync: fsync every disk commit (durable across power loss; slower).
        disk_reserve_fraction: part of the map kept free for LMDB's own pages (see DiskTierConfig).
        write_through: host tier writes every record to disk on entry (else write-back on eviction).
        host_pin_memory: page-locked host records: True, False, or None = when the daemon device is CUDA.
        lease_ttl_seconds: a prefix lease (LoadPrefix) not released this long is released by the
            daemon, so a client that vanished mid-request cannot pin pages forever (0: never).
    """

    disk_path: str = ""
    disk_bytes: int = 4 * GiB
    disk_max_readers: int = 126
    disk_sync: bool = False
    disk_reserve_fraction: float = 0.25
    write_through: bool = False
    host_pin_memory: bool | None = None
    lease_ttl_seconds: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.disk_bytes, int) or self.disk_bytes <= 0:
            raise ValueError(f"tiers.disk_bytes must be a positive byte count, got {self.disk_bytes!r}")
        if not isinstance(self.disk_max_readers, int) or self.disk_max_readers <= 0:
            raise ValueError(f"tiers.disk_max_readers must be a positive integer, got {self.disk_max_readers!r}")
        if not isinstance(self.lease_ttl_seconds, (int, float)) or self.lease_ttl_seconds < 0:
            raise ValueError(f"tiers.lease_ttl_seconds must be >= 0, got {self.lease_ttl_seconds!r}")
        if not 0.0 < float(self.disk_reserve_fraction) < 1.0:
            raise ValueError(f"tiers.disk_reserve_fraction must lie in (0, 1), got {self.disk_reserve_fraction!r}")

    @classmethod
    def coerce(cls, value: TierSettings | Mapping[str, Any] | None) -> TierSettings:
        """A TierSettings from itself, a ``[tiers]`` table (byte sizes may be ``"8GiB"``) or None.

        Raises:
            ValueError: unknown keys or bad values (the message names them).
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"[tiers] must be a table, got {type(value).__name__}")
        check_known_keys(cls, value, "[tiers]")
        data = dict(value)
        if "disk_bytes" in data:
            from kvtier.server.daemon.config import parse_bytes  # config imports this module

            data["disk_bytes"] = parse_bytes(data["disk_bytes"], "tiers.disk_bytes")
        return cls(**data)
