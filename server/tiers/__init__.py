"""Tiers below the device pool: records, the host, LMDB disk and Mooncake Store tiers, the stack and
the prefix cache.

Modules: ``errors`` (typed errors), ``record`` (the self-checking record format), ``policy``
(eviction strategy and the byte-budget index), ``base`` (the tier interface and config base),
``host``, ``disk`` (LMDB), ``mooncake_store`` (the shared Mooncake Store tier; ``mooncake_config``,
``mooncake_client``, ``staging``), ``sim`` (size-only tier for simulation), ``stack`` (the cascade
and publishing to shared tiers), ``prefix`` (chained-key prefix cache with its device-tier index),
``health`` (healthy/unhealthy with backoff), ``disk_faults`` (unusable paths, storage faults,
injected faults), ``disk_lock`` (one daemon a disk directory), ``monitor`` (the thread that probes
unhealthy tiers). No grpc here.
"""

from kvtier.server.tiers.base import Tier, TierConfig, TierStats
from kvtier.server.tiers.disk import DiskTier, DiskTierConfig, disk_charge
from kvtier.server.tiers.errors import (
    DiskPathError, DiskPathInUseError, EnvironmentInUseError, LeaseError, RecordError, TierError, TierFullError,
    TierUnavailableError,
)
from kvtier.server.tiers.host import HostTier, HostTierConfig
from kvtier.server.tiers.mooncake_config import MooncakeStoreTierConfig
from kvtier.server.tiers.mooncake_store import MooncakeStoreTier
from kvtier.server.tiers.policy import CachePolicy, LRUPolicy, TierIndex
from kvtier.server.tiers.prefix import PrefixCache, PrefixLoad, PrefixLookup
from kvtier.server.tiers.record import RecordCodec, verify_record
from kvtier.server.tiers.sim import SimTier, SimTierConfig
from kvtier.server.tiers.stack import TierStack, build_tier

__all__ = [
    "CachePolicy", "DiskPathError", "DiskPathInUseError", "DiskTier", "DiskTierConfig", "EnvironmentInUseError",
    "HostTier", "HostTierConfig",
    "LRUPolicy", "LeaseError", "MooncakeStoreTier", "MooncakeStoreTierConfig", "PrefixCache", "PrefixLoad",
    "PrefixLookup", "RecordCodec", "RecordError",
    "SimTier", "SimTierConfig", "Tier", "TierConfig", "TierError", "TierFullError", "TierIndex", "TierStack",
    "TierStats", "TierUnavailableError", "build_tier", "disk_charge", "verify_record",
]
