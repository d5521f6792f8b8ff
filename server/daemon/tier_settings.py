"""The daemon's tier settings (``[tiers]`` in the TOML config, ``--tiers``, ``--disk-*`` and
``--mooncake-*`` flags of ``kvtier serve``).

The host tier's budget is the daemon's ``host_memory_bytes``; these fields configure the rest. Which
tiers the stack has, fastest first, is ``stack`` (``--tiers host,disk,mooncake``); the Mooncake Store
tier's settings are a ``[tiers.mooncake]`` table holding the fields of
:class:`~kvtier.server.tiers.mooncake_config.MooncakeStoreTierConfig` (byte sizes may be ``"1GiB"``)::

    [tiers]
    stack = ["host", "disk", "mooncake"]
    disk_path = "/var/lib/kvtier/disk"

    [tiers.mooncake]
    master = "10.0.0.5:50051"
    metadata = "http://10.0.0.5:8080/metadata"
    global_segment_bytes = "8GiB"
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.server.daemon.config_keys import check_field_types, check_known_keys, settings_from_table
from kvtier.server.tiers.mooncake_config import MooncakeStoreTierConfig
from kvtier.server.tiers.policies import resolve_policy

GiB = 1 << 30
TIER_NAMES = ("host", "disk", "mooncake")
MIN_READERS, MAX_READERS = 16, 4096
"""Bounds of ``disk_max_readers``: at least a read transaction for each of the default 16 workers (a
read waits for no slot: one it cannot get is a miss), at most what a lock.mdb of a few MiB holds."""
MOONCAKE_BYTE_FIELDS = ("capacity_bytes", "global_segment_bytes", "local_buffer_bytes", "staging_bytes",
                        "max_object_bytes")


@dataclass(frozen=True)
class TierSettings:
    """Tier settings of a daemon.

    Attributes:
        disk_path: directory of the LMDB disk tier; empty: no disk tier (host only).
        disk_bytes: the ``--disk-size`` budget: LMDB ``map_size`` in bytes.
        disk_max_readers: LMDB reader slots (concurrent read transactions).
        disk_sync: fsync every disk commit (durable across power loss; slower).
        disk_write_behind: the disk tier's LMDB transactions run on a writer thread (a spill's
            decisions are made in the call; its records are read from memory until they commit):
            see :mod:`kvtier.server.tiers.disk_writer`. False: every disk write commits in the call.
        disk_reserve_fraction: part of the map kept free for LMDB's own pages (see DiskTierConfig).
        write_through: host tier writes every record to disk on entry (else write-back on eviction).
        host_pin_memory: page-locked host records: True, False, or None = when the daemon device is CUDA.
        lease_ttl_seconds: a prefix lease (LoadPrefix) not released this long is released by the
            daemon, so a client that vanished mid-request cannot pin pages forever (0: never).
        disk_probe_backoff_max_seconds: an unhealthy disk tier (ENOSPC, EIO) is probed 1 s after the
            failure, then at doubling intervals up to this many seconds.
        stack: tier names fastest first, from ``host``, ``disk``, ``mooncake``; empty: ``host``, plus
            ``disk`` when ``disk_path`` is set.
        mooncake: settings of the Mooncake Store tier (used when ``stack`` names it).
        policy: eviction policy name of the device, host and disk tiers (each its own instance;
            :func:`~kvtier.server.tiers.policies.make_policy`); ``default`` is kvtier's own.
    """

    disk_path: str = ""
    disk_bytes: int = 4 * GiB
    disk_max_readers: int = 126
    disk_sync: bool = False
    disk_write_behind: bool = True
    disk_reserve_fraction: float = 0.25
    write_through: bool = False
    host_pin_memory: bool | None = None
    lease_ttl_seconds: float = 600.0
    disk_probe_backoff_max_seconds: float = 30.0
    stack: tuple[str, ...] = ()
    mooncake: MooncakeStoreTierConfig = field(default_factory=MooncakeStoreTierConfig)
    policy: str = "default"

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str):
            raise ValueError(f"tiers.policy must be a policy name, got {self.policy!r}")
        try:
            resolve_policy(self.policy)
        except ValueError as e:
            raise ValueError(f"tiers.policy: {e}") from None
        # finite and at most a day (NaN compared false and passed: a NaN lease TTL never expired; attack pass 5, A5-8)
        if isinstance(self.disk_probe_backoff_max_seconds, bool) or not isinstance(self.disk_probe_backoff_max_seconds, (int, float)) \
                or not 0 < self.disk_probe_backoff_max_seconds <= 86400:
            raise ValueError(f"tiers.disk_probe_backoff_max_seconds must be > 0 and at most 86400, got "
                             f"{self.disk_probe_backoff_max_seconds!r}")
        if not isinstance(self.disk_bytes, int) or self.disk_bytes <= 0:
            raise ValueError(f"tiers.disk_bytes must be a positive byte count, got {self.disk_bytes!r}")
        if isinstance(self.disk_max_readers, bool) or not isinstance(self.disk_max_readers, int) \
                or not MIN_READERS <= self.disk_max_readers <= MAX_READERS:
            # fewer slots than the daemon's reading threads turned reader contention into an outage, and
            # LMDB sizes lock.mdb by the slots (attack pass 4, A4-4, A4-15)
            raise ValueError(f"tiers.disk_max_readers must be {MIN_READERS}..{MAX_READERS}, got {self.disk_max_readers!r}")
        if isinstance(self.lease_ttl_seconds, bool) or not isinstance(self.lease_ttl_seconds, (int, float)) \
                or not 0 <= self.lease_ttl_seconds <= 86400:
            raise ValueError(f"tiers.lease_ttl_seconds must be 0..86400, got {self.lease_ttl_seconds!r}")
        if isinstance(self.disk_reserve_fraction, bool) or not isinstance(self.disk_reserve_fraction, (int, float)) \
                or not 0.0 < self.disk_reserve_fraction < 1.0:  # a string made a traceback (attack pass 6, A6-7)
            raise ValueError(f"tiers.disk_reserve_fraction must be a number in (0, 1), got {self.disk_reserve_fraction!r}")
        if not isinstance(self.disk_path, str):
            raise ValueError(f"tiers.disk_path must be a directory path (a string), got {self.disk_path!r}")
        for name in ("write_through", "disk_sync", "disk_write_behind"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"tiers.{name} must be true or false, got {getattr(self, name)!r}")
        if self.host_pin_memory is not None and not isinstance(self.host_pin_memory, bool):
            raise ValueError(f"tiers.host_pin_memory must be true or false, got {self.host_pin_memory!r}")
        check_field_types(self, "tiers.", skip=("stack",))  # the rest (stack: a list or "host,disk", parse_stack)
        object.__setattr__(self, "stack", parse_stack(self.stack))
        if "disk" in self.stack and not self.disk_path:
            raise ValueError("tiers.stack names the disk tier but no disk_path (--disk-path) is set")
        if self.stack and "disk" not in self.stack and self.disk_path:  # was silently no disk (attack pass 6, A6-7)
            raise ValueError(f"tiers.disk_path ({self.disk_path}) is set but tiers.stack {','.join(self.stack)} has no "
                             f"disk tier: add disk to the stack (--tiers), or leave the path out")
        if "mooncake" in self.stack:
            self.mooncake.validate()

    @property
    def tier_names(self) -> tuple[str, ...]:
        """The stack's tiers, fastest first (``stack``, or the default: host, and disk with a path)."""
        return self.stack or (("host", "disk") if self.disk_path else ("host",))

    @classmethod
    def coerce(cls, value: TierSettings | Mapping[str, Any] | None) -> TierSettings:
        """A TierSettings from itself, a ``[tiers]`` table (byte sizes may be ``"8GiB"``) or None.

        Raises:
            ValueError: unknown keys or bad values (the message names them).
        """
        return settings_from_table(cls, value, "[tiers]", byte_keys=("disk_bytes",), convert={"mooncake": mooncake_config})


def parse_stack(value: Any) -> tuple[str, ...]:
    """``"host,disk,mooncake"`` or a list of names -> a tuple of known, distinct tier names.

    Raises:
        ValueError: an unknown or repeated name, or names not fastest first (host, disk, mooncake).
    """
    if not isinstance(value, (str, list, tuple)):  # 5 was a traceback (attack pass 7, A7-1)
        raise ValueError(f"tiers.stack must be a list of tier names (or \"host,disk\"), got {value!r}")
    names = tuple(n.strip() for n in value.split(",") if n.strip()) if isinstance(value, str) else tuple(value)
    unknown = [n for n in names if n not in TIER_NAMES]
    if unknown:
        raise ValueError(f"unknown tiers {unknown}; known: {list(TIER_NAMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"tiers repeat in {list(names)}")
    fastest_first = sorted(names, key=TIER_NAMES.index)
    if list(names) != fastest_first:  # attack pass 6, A6-3: a disk tier above the host one lost durable copies
        raise ValueError(f"tiers go fastest first: {','.join(fastest_first)}, not {','.join(names)}")
    return names


def mooncake_config(value: MooncakeStoreTierConfig | Mapping[str, Any], **changes: Any) -> MooncakeStoreTierConfig:
    """A :class:`MooncakeStoreTierConfig` from itself or a ``[tiers.mooncake]`` table, with ``changes``
    over it (flags). Byte sizes may be ``"1GiB"``; ``namespaces`` may be a list.

    Raises:
        ValueError: unknown keys or bad values.
    """
    from kvtier.server.daemon.config import parse_bytes  # config imports this module

    if isinstance(value, MooncakeStoreTierConfig):
        data = dataclasses.asdict(value)
    elif isinstance(value, Mapping):
        check_known_keys(MooncakeStoreTierConfig, value, "[tiers.mooncake]")
        data = dict(value)
    else:
        raise ValueError(f"[tiers.mooncake] must be a table, got {type(value).__name__}")
    data.update(changes)
    for key in MOONCAKE_BYTE_FIELDS:
        if key in data:
            data[key] = parse_bytes(data[key], f"tiers.mooncake.{key}")
    if isinstance(data.get("namespaces"), list):
        data["namespaces"] = tuple(data["namespaces"])
    try:
        cfg = MooncakeStoreTierConfig(**data)
    except TypeError as e:
        raise ValueError(f"[tiers.mooncake]: {e}") from None
    # every value is checked whether or not the stack names mooncake: namespaces = 5 was a traceback,
    # key_prefix = 5 and replicas = -1 were taken unread (attack pass 7, A7-1)
    check_field_types(cfg, "tiers.mooncake.")
    if changes or not isinstance(value, MooncakeStoreTierConfig):
        try:
            cfg.validate()
        except ValueError as e:
            raise ValueError(f"[tiers.mooncake]: {e}") from None
    return cfg
