"""ReadKV's hand-written wire bytes equal protobuf's own serialization, and the raw registration
leaves every other method's handler as generated."""

from __future__ import annotations

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.server.service.kv_wire import encode_read_chunk, packed_pieces, read_responses, with_raw_responses
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


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=8), st.integers(1, 1024), st.randoms(use_true_random=False))
def test_packed_pieces_are_full_chunks_of_the_segments_back_to_back(sizes, chunk, rnd):
    """Packed ReadKV: each message but the last carries exactly chunk bytes, at its offset in the
    concatenation of the segments, and together they are that concatenation."""
    segs = [bytes(rnd.getrandbits(8) for _ in range(n)) for n in sizes]
    whole = b"".join(segs)
    pieces = list(packed_pieces([memoryview(s) for s in segs], chunk))
    assert [off for off, _ in pieces] == list(range(0, len(whole), chunk))
    assert all(sum(len(p) for p in parts) == chunk for _, parts in pieces[:-1])
    assert b"".join(bytes(p) for _, parts in pieces for p in parts) == whole
    wire = list(read_responses([(1, 1, memoryview(s)) for s in segs], chunk, packed=True))
    for (off, parts), raw in zip(pieces, wire):
        want = pool_pb2.ReadKVResponse(offset=off, data=b"".join(bytes(p) for p in parts)).SerializeToString()
        assert raw == want


def test_unpacked_responses_are_one_message_sequence_a_segment():
    segs = [(3, 1, memoryview(b"a" * 5)), (3, 2, memoryview(b"b" * 3))]
    got = [pool_pb2.ReadKVResponse.FromString(r) for r in read_responses(segs, 2, packed=False)]
    assert [(m.layer_id, m.component, m.offset, m.data) for m in got] == [
        (3, 1, 0, b"aa"), (3, 1, 2, b"aa"), (3, 1, 4, b"a"), (3, 2, 0, b"bb"), (3, 2, 2, b"b")]
