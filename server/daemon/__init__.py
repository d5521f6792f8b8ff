"""The daemon's domain, without grpc: what ``kvtier serve`` holds and does, callable in-process.

Modules: ``config`` (DaemonConfig, PoolSpec, parse_bytes), ``tier_settings``, ``config_keys``,
``errors`` (typed domain errors), ``locks`` (readers-writer lock), ``pools`` (pool registry),
``kv_ops`` (KV operations), ``offload_store`` (the one store of offloaded copies, on the tiers),
``tier_runtime`` (tier stack and the pools' prefix caches), ``transfer`` (PD transfer, domain half),
``core`` (:class:`Daemon`, the root). The gRPC servicers in ``kvtier.server.service`` only translate
to these calls; never import grpc or ``kvtier.v1`` here.
"""

from kvtier.server.daemon.config import DaemonConfig, PoolSpec, parse_bytes
from kvtier.server.daemon.core import Daemon
from kvtier.server.daemon.errors import (
    AlreadyExists, FailedPrecondition, InvalidArgument, KVTierError, NotFound, ResourceExhausted, Unauthenticated,
)
from kvtier.server.daemon.offload_store import HostCopy, OffloadStore

__all__ = [
    "AlreadyExists", "Daemon", "DaemonConfig", "FailedPrecondition", "HostCopy", "InvalidArgument", "KVTierError",
    "NotFound", "OffloadStore", "PoolSpec", "ResourceExhausted", "Unauthenticated", "parse_bytes",
]
