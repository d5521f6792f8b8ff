"""The services a daemon serves. Adding a service is one line in :data:`SERVICES`.

Each entry names the service (its full proto name, for the health and reflection services), the
generated ``add_XServicer_to_server`` function, and a factory that builds the servicer from the
daemon's :class:`~kvtier.server.daemon.core.Daemon` and the server's stream guard
(:class:`~kvtier.server.service.streams.StreamGuard`)::

    ServiceEntry.of(tier_pb2, "TierService", tier_pb2_grpc.add_TierServiceServicer_to_server, TierServicer),
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc

from kvtier.server.daemon.core import Daemon
from kvtier.server.service.kv_wire import decode_write_request, with_raw_messages
from kvtier.server.service.pool_servicer import PoolServicer
from kvtier.server.service.storage_servicer import StorageServicer
from kvtier.server.service.streams import StreamGuard
from kvtier.server.service.tier_servicer import TierServicer
from kvtier.server.service.transfer_servicer import TransferServicer
from kvtier.v1 import (
    pool_pb2, pool_pb2_grpc, storage_pb2, storage_pb2_grpc, tier_pb2, tier_pb2_grpc, transfer_pb2, transfer_pb2_grpc,
)


@dataclass(frozen=True)
class ServiceEntry:
    """One gRPC service of the daemon.

    Attributes:
        name: full service name, e.g. ``kvtier.v1.PoolService`` (health and reflection use it).
        add_to_server: the generated ``add_<Name>Servicer_to_server(servicer, server)``.
        factory: builds the servicer from the daemon and the stream guard.
    """

    name: str
    add_to_server: Callable[[Any, grpc.Server], None]
    factory: Callable[[Daemon, StreamGuard], Any]

    @classmethod
    def of(cls, pb2: ModuleType, service: str, add_to_server: Callable[[Any, grpc.Server], None],
           factory: Callable[[Daemon, StreamGuard], Any]) -> ServiceEntry:
        """An entry whose name is looked up in the generated ``pb2`` module (so it cannot be misspelt)."""
        return cls(pb2.DESCRIPTOR.services_by_name[service].full_name, add_to_server, factory)


SERVICES: list[ServiceEntry] = [
    # ReadKV yields wire bytes it serialized itself, WriteKV parses its requests itself (kv_wire)
    ServiceEntry.of(pool_pb2, "PoolService", with_raw_messages(pool_pb2_grpc.add_PoolServiceServicer_to_server, ["ReadKV"],
                                                               {"WriteKV": decode_write_request}),
                    PoolServicer),
    ServiceEntry.of(tier_pb2, "TierService", tier_pb2_grpc.add_TierServiceServicer_to_server, TierServicer),
    ServiceEntry.of(transfer_pb2, "TransferService", transfer_pb2_grpc.add_TransferServiceServicer_to_server, TransferServicer),
    ServiceEntry.of(storage_pb2, "StorageService", storage_pb2_grpc.add_StorageServiceServicer_to_server, StorageServicer),
]
