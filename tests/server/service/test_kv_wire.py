"""ReadKV's hand-written wire bytes equal protobuf's own serialization, WriteKV's requests are parsed
as protobuf parses them (and the client writes them as protobuf does), and the raw registration
leaves every other method's handler as generated."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.client.wire import encode_write_chunk
from kvtier.server.service.kv_wire import decode_write_request, encode_read_chunk, with_raw_messages
from kvtier.v1 import pool_pb2, pool_pb2_grpc


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 3), st.integers(0, 2**64 - 1), st.binary(max_size=600))
def test_encoding_is_protobufs_serialization(layer, comp, offset, data):
    want = pool_pb2.ReadKVResponse(layer_id=layer, component=comp, offset=offset, data=data).SerializeToString()
    got = encode_read_chunk(layer, comp, offset, memoryview(data))
    assert got == want
    back = pool_pb2.ReadKVResponse.FromString(got)
    assert (back.layer_id, back.component, back.offset, back.data) == (layer, comp, offset, data)


def test_only_the_named_methods_lose_their_serializers():
    class Recorder:
        def __init__(self):
            self.registered = {}

        def add_generic_rpc_handlers(self, handlers):
            self.generic = handlers

        def add_registered_method_handlers(self, service, handlers):
            self.service, self.registered = service, handlers

    server = Recorder()
    with_raw_messages(pool_pb2_grpc.add_PoolServiceServicer_to_server, ["ReadKV"], {"WriteKV": decode_write_request})(
        pool_pb2_grpc.PoolServiceServicer(), server)
    assert server.service == "kvtier.v1.PoolService"
    assert server.registered["ReadKV"].response_serializer is None
    assert server.registered["ReadKV"].request_deserializer == pool_pb2.ReadKVRequest.FromString
    assert server.registered["WriteKV"].response_serializer == pool_pb2.WriteKVResponse.SerializeToString
    assert server.registered["WriteKV"].request_deserializer is decode_write_request
    assert server.registered["MoveKV"].request_deserializer == pool_pb2.MoveKVRequest.FromString
    assert isinstance(server.generic[0], grpc.GenericRpcHandler)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.builds(pool_pb2.KVHeader, pool_id=st.text(max_size=8), slots=st.lists(st.integers(0, 2**40), max_size=5),
                                      latent_layers=st.lists(st.integers(0, 90), max_size=4))),
       st.integers(0, 2**32 - 1), st.integers(0, 3), st.integers(0, 2**64 - 1), st.binary(max_size=600), st.booleans(),
       st.integers(0, 2**64 - 1))
def test_write_requests_are_parsed_as_protobuf_parses_them(header, layer, comp, offset, data, packed, allocate):
    msg = pool_pb2.WriteKVRequest(layer_id=layer, component=comp, offset=offset, data=data, packed=packed,
                                  allocate_tokens=allocate)
    if header is not None:
        msg.header.CopyFrom(header)
    got = decode_write_request(msg.SerializeToString())
    assert (got.layer_id, got.component, got.offset, bytes(got.data), got.packed, got.allocate_tokens) == \
        (layer, comp, offset, data, packed, allocate)
    assert got.header == (header if header is not None else None)
    assert encode_write_chunk(layer, comp, offset, [memoryview(data)], packed=packed, allocate_tokens=allocate,
                              header=header.SerializeToString() if header is not None else None) == msg.SerializeToString()


def test_write_request_fields_in_any_order_unknown_fields_and_repeats_read_as_protobuf_reads_them():
    # data, an unknown varint 9, offset twice (the last wins), a fixed32 unknown 11, the header in two parts (merged)
    h1 = pool_pb2.KVHeader(pool_id="p", slots=[1, 2]).SerializeToString()
    h2 = pool_pb2.KVHeader(slots=[3], latent_layers=[4]).SerializeToString()
    raw = (b"\x2a\x02ab" + b"\x48\x05" + b"\x20\x07" + b"\x20\x80\x01" + b"\x5d" + bytes(4)
           + b"\x0a" + bytes([len(h1)]) + h1 + b"\x0a" + bytes([len(h2)]) + h2 + b"\x18\x02")
    want = pool_pb2.WriteKVRequest.FromString(raw)
    got = decode_write_request(raw)
    assert (got.offset, got.component, bytes(got.data)) == (want.offset, want.component, want.data) == (128, 2, b"ab")
    assert got.header == want.header and list(got.header.slots) == [1, 2, 3]


@pytest.mark.parametrize("raw", [b"\x2a\x05abc", b"\x20", b"\x20\x80", b"\x5d\x00\x00", b"\x0b", b"\x0a\x03\x0a"])
def test_malformed_write_requests_are_refused(raw):
    with pytest.raises(Exception):
        pool_pb2.WriteKVRequest.FromString(raw)  # protobuf refuses them too
    with pytest.raises(ValueError):
        decode_write_request(raw)
