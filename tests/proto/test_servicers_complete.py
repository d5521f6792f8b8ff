"""Every RPC of the wire contract has a real implementation: no servicer method is left as the
generated base class's ``NotImplementedError`` stub."""

from __future__ import annotations

import pytest

from kvtier.server.service.pool_servicer import PoolServicer
from kvtier.server.service.storage_servicer import StorageServicer
from kvtier.server.service.tier_servicer import TierServicer
from kvtier.server.service.transfer_servicer import TransferServicer
from kvtier.v1 import (
    pool_pb2, pool_pb2_grpc, storage_pb2, storage_pb2_grpc, tier_pb2, tier_pb2_grpc, transfer_pb2, transfer_pb2_grpc,
)


@pytest.mark.parametrize("module, stubs, service, impl", [
    (pool_pb2, pool_pb2_grpc, "PoolService", PoolServicer),
    (tier_pb2, tier_pb2_grpc, "TierService", TierServicer),
    (transfer_pb2, transfer_pb2_grpc, "TransferService", TransferServicer),
    (storage_pb2, storage_pb2_grpc, "StorageService", StorageServicer),
])
def test_every_rpc_is_implemented(module, stubs, service, impl):
    base = getattr(stubs, f"{service}Servicer")
    rpcs = [m.name for m in module.DESCRIPTOR.services_by_name[service].methods]
    assert rpcs, service
    missing = [name for name in rpcs if getattr(impl, name) is getattr(base, name)]
    assert missing == [], f"{service} RPCs left as generated stubs: {missing}"
