"""The daemon's gRPC service: config, state, domain errors, servicers and the server.

Modules: ``config`` (DaemonConfig, PoolSpec), ``errors`` (domain errors -> status codes, the one
mapping), ``locks`` (readers-writer lock), ``pools`` (pool registry), ``offload_store`` (host copies),
``kv_ops`` (KV operations), ``state`` (DaemonState), ``messages`` (domain -> proto),
``pool_servicer`` (PoolService), ``registry`` (the list of services), ``server`` (create_server, serve).
"""

from kvtier.server.service.config import DaemonConfig, PoolSpec
from kvtier.server.service.errors import (
    AlreadyExists, FailedPrecondition, InvalidArgument, KVTierError, NotFound, ResourceExhausted,
)
from kvtier.server.service.offload_store import CopyStore, HostCopy, OffloadStore
from kvtier.server.service.registry import SERVICES, ServiceEntry
from kvtier.server.service.server import create_server, serve
from kvtier.server.service.state import DaemonState

__all__ = [
    "AlreadyExists", "CopyStore", "DaemonConfig", "DaemonState", "FailedPrecondition", "HostCopy",
    "InvalidArgument", "KVTierError", "NotFound", "OffloadStore", "PoolSpec", "ResourceExhausted",
    "SERVICES", "ServiceEntry", "create_server", "serve",
]
