"""The daemon serves the standard health and reflection services, naming every kvtier service."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvtier.server.service.registry import SERVICES


def test_health_serving_for_daemon_and_each_service(daemon):
    with grpc.insecure_channel(daemon.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ["", "kvtier.v1.PoolService", *[s.name for s in SERVICES]]:
            assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_services_and_describes_messages(daemon):
    with grpc.insecure_channel(daemon.address) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        names = set(db.get_services())
        assert {"kvtier.v1.PoolService", "grpc.health.v1.Health"} <= names
        assert {s.name for s in SERVICES} <= names
        fields = {f.name for f in db.FindFileContainingSymbol("kvtier.v1.PoolLayout").message_type if f.name == "PoolLayout"}
        assert fields == {"PoolLayout"}
