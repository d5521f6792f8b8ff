"""Settings of the Mooncake Store tier: :class:`MooncakeStoreTierConfig` (``[tiers.mooncake]``,
``--mooncake-*`` flags of ``kvtier serve``). Facts behind the limits: :mod:`mooncake_client`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvtier.server.tiers.base import TierConfig
from kvtier.server.tiers.mooncake_client import MAX_BATCH_KEYS, ClientSettings, metadata_endpoint, split_host_port
from kvtier.server.tiers.staging import aligned

GiB = 1 << 30
MiB = 1 << 20
PROTOCOLS = ("tcp", "rdma")
MIN_SEGMENT_BYTES = 16 * MiB  # a smaller segment fails setup ("Total size must be at least 16777216")


@dataclass
class MooncakeStoreTierConfig(TierConfig):
    """Settings of the Mooncake Store tier (``[tiers.mooncake]``, ``--mooncake-*`` flags).

    Attributes:
        capacity_bytes: bound of the ledger of objects this daemon put (stats ``used_bytes``); not a
            limit on the store, whose size is the sum of the segments its clients mount and which
            evicts on its own. Also the budget of the tier's size-only twin in ``--simulate``.
        master: the ``mooncake_master`` RPC address, ``HOST:PORT``.
        metadata: the transfer metadata service: the master's own HTTP metadata server
            (``http://HOST:PORT/metadata``, master flags ``--enable_http_metadata_server=true
            --http_metadata_server_port=PORT``) or ``P2PHANDSHAKE``; every client of a store must use
            the same.
        protocol: transfer protocol, ``tcp`` or ``rdma``.
        rdma_devices: RDMA devices for ``rdma`` (e.g. ``mlx5_0,mlx5_1``); empty for ``tcp``.
        local_hostname: address this daemon's store client publishes to its peers.
        global_segment_bytes: host memory this daemon lends to the shared store (mapped lazily; at
            least 16 MiB); objects may land in any client's segment, and leave with it. 0: lend none.
        local_buffer_bytes: the client's own transfer buffer (kvtier moves bytes through its
            registered staging region instead, so this can stay small).
        replicas: copies of each object (in distinct segments; more than the store has fails the put).
        soft_pin: soft-pin the objects this daemon puts (evicted after unpinned ones).
        soft_pin_ttl_ms: soft pin lifetime; 0: the master's ``default_kv_soft_pin_ttl`` (30 min).
            Only with ``soft_pin``.
        key_prefix: store keys are ``key_prefix + tier_key.hex()``; daemons that share prefixes use
            the same prefix (a different prefix is a separate key space in the same store).
        namespaces: tier key namespaces kept in the store (``p:``: prefix pages); keys of other
            namespaces (``o:``: offloaded copies, named per daemon) never go there.
        staging_bytes: the registered host region every batch is staged in.
        max_object_bytes: largest record the tier stores (larger ones: TierFullError); also the
            extent a read reserves for an object of unknown size before it has seen one.
        max_batch_keys: keys per store call (at most 1,000: larger batches meet the transfer
            engine's queue limit).
        connect_timeout_s: how long the reachability check before ``setup`` waits for the master.
        verify_reads: ``read_into`` checks each record's checksum (a failed check is a miss);
            ``borrow`` lends unchecked bytes to callers that check them (see ``MooncakeStoreTier.borrow``).
    """

    kind: ClassVar[str] = "mooncake"
    capacity_bytes: int = 16 * GiB
    master: str = "127.0.0.1:50051"
    metadata: str = "http://127.0.0.1:8080/metadata"
    protocol: str = "tcp"
    rdma_devices: str = ""
    local_hostname: str = "127.0.0.1"
    global_segment_bytes: int = 1 * GiB
    local_buffer_bytes: int = 16 * MiB
    replicas: int = 1
    soft_pin: bool = False
    soft_pin_ttl_ms: int = 0
    key_prefix: str = "kvtier/"
    namespaces: tuple[str, ...] = ("p:",)
    staging_bytes: int = 64 * MiB
    max_object_bytes: int = 4 * MiB
    max_batch_keys: int = 256
    connect_timeout_s: float = 2.0
    verify_reads: bool = True

    def validate(self) -> None:
        super().validate()
        split_host_port(self.master, "mooncake master")
        metadata_endpoint(self.metadata)
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"mooncake protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        for name in ("global_segment_bytes", "local_buffer_bytes", "staging_bytes", "max_object_bytes",
                     "replicas", "max_batch_keys", "soft_pin_ttl_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"mooncake {name} must be a non-negative integer, got {v!r}")
        if self.global_segment_bytes and self.global_segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"mooncake global_segment_bytes must be 0 or at least {MIN_SEGMENT_BYTES} (16 MiB: "
                             f"the store client's minimum segment), got {self.global_segment_bytes}")
        if self.local_buffer_bytes < 1024:
            raise ValueError("mooncake local_buffer_bytes must be at least 1024")
        if self.replicas < 1:
            raise ValueError("mooncake replicas must be at least 1")
        if not 1 <= self.max_batch_keys <= MAX_BATCH_KEYS:
            raise ValueError(f"mooncake max_batch_keys must lie in 1..{MAX_BATCH_KEYS}, got {self.max_batch_keys}")
        if self.max_object_bytes < 64 or self.staging_bytes < aligned(self.max_object_bytes) or self.staging_bytes % 64:
            raise ValueError("mooncake staging_bytes must be a multiple of 64 holding at least one max_object_bytes object")
        if self.soft_pin_ttl_ms and not self.soft_pin:
            raise ValueError("mooncake soft_pin_ttl_ms needs soft_pin")
        if not self.key_prefix or not self.key_prefix.isascii():
            raise ValueError("mooncake key_prefix must be a non-empty ASCII string")
        if not self.namespaces or any(not n or not n.isascii() for n in self.namespaces):
            raise ValueError("mooncake namespaces must be non-empty ASCII strings")
        if self.connect_timeout_s <= 0:
            raise ValueError("mooncake connect_timeout_s must be positive")

    def client_settings(self) -> ClientSettings:
        """What the store client's ``setup`` gets."""
        return ClientSettings(self.local_hostname, self.metadata, self.global_segment_bytes, self.local_buffer_bytes,
                              self.protocol, self.rdma_devices, self.master, self.connect_timeout_s)
