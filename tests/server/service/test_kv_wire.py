"""ReadKV's hand-written wire bytes equal protobuf's own serialization, and the raw registration
leaves every other method's handler as generated."""

from __future__ import annotations

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.server.service.kv_wire import encode_read_chunk, with_raw_responses
from kvtier.v1 import pool_pb2, pool_pb2_grpc


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 3), st.integers(0, 2**64 - 1), st.binary(max_size=600))
def test_encoding_is_protobufs_serialization(layer, comp, offset, data):
    want = pool_pb2.ReadKVResponse(layer_id=layer, component=comp, offset=offset, data=data).SerializeToString()
    got = encode_read_chunk(layer, comp, offset, memoryview(data))
    assert got == want
    back = pool_pb2.ReadKVResponse.FromString(got)
    assert (back.layer_id, back.component, back.offset, back.data) == (layer, comp, offset, data)


def test_only_the_named_method_loses_its_serializer():
    class Recorder:
        def __init__(self):
            self.registered = {}

        def add_generic_rpc_handlers(self, handlers):
            self.generic = handlers

        def add_registered_method_handlers(self, service, handlers):
            self.service, self.registered = service, handlers

    server = Recorder()
    with_raw_responses(pool_pb2_grpc.add_PoolServiceServicer_to_server, ["ReadKV"])(pool_pb2_grpc.PoolServiceServicer(), server)
    assert server.service == "kvtier.v1.PoolService"
    assert server.registered["ReadKV"].response_serializer is None
    assert server.registered["ReadKV"].request_deserializer == pool_pb2.ReadKVRequest.FromString
    assert server.registered["WriteKV"].response_serializer == pool_pb2.WriteKVResponse.SerializeToString
    assert isinstance(server.generic[0], grpc.GenericRpcHandler)
