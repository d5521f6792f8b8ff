"""The client's ReadKV decoder reads whatever protobuf serializes (fields in any order, unknown
fields, defaults left out) and refuses truncated messages."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.client.wire import ReceiveBuffers, decode_read_chunk
from kvtier.v1 import pool_pb2


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 3), st.integers(0, 2**64 - 1), st.binary(max_size=600))
def test_decodes_protobufs_serialization(layer, comp, offset, data):
    raw = pool_pb2.ReadKVResponse(layer_id=layer, component=comp, offset=offset, data=data).SerializeToString()
    got_layer, got_comp, got_offset, got_data = decode_read_chunk(raw)
    assert (got_layer, got_comp, got_offset, bytes(got_data)) == (layer, comp, offset, data)


def test_fields_in_another_order_and_unknown_fields_are_read_as_protobuf_reads_them():
    # data first, an unknown varint field 9, an unknown fixed64 field 10, then offset and layer
    raw = b"\x22\x03abc" + b"\x48\x05" + b"\x51" + bytes(8) + b"\x18\x80\x01" + b"\x08\x07"
    assert pool_pb2.ReadKVResponse.FromString(raw).offset == 128
    layer, comp, offset, data = decode_read_chunk(raw)
    assert (layer, comp, offset, bytes(data)) == (7, 0, 128, b"abc")


@pytest.mark.parametrize("raw", [b"\x22\x05abc", b"\x18", b"\x18\x80", b"\x51\x00\x00", b"\x0b"])
def test_truncated_or_malformed_messages_are_refused(raw):
    with pytest.raises(ValueError):
        decode_read_chunk(raw)


def test_receive_buffers_are_reused_only_once_every_view_is_gone():
    """A result's buffer comes back for the next read of its size once nothing views it; while any
    view lives (a torch slice, a numpy view of it) it is not handed out; at most `keep` freed
    buffers stay."""
    bufs = ReceiveBuffers(keep=2)
    a = bufs.take(1000)
    first = a.data_ptr()
    kept, kept_np = a[10:20], a.numpy()[30:40]
    del a
    assert len(bufs._free) == 0  # the slices still view it
    del kept
    assert len(bufs._free) == 0  # the numpy view still does
    del kept_np
    assert len(bufs._free) == 1
    c = bufs.take(1000)
    assert c.data_ptr() == first and c.numel() == 1000 and len(bufs._free) == 0
    more = [bufs.take(1000) for _ in range(3)]
    assert first not in [m.data_ptr() for m in more]  # c is alive: never handed out twice
    del c, more
    assert len(bufs._free) == 2  # keep=2: the others were let go
    assert bufs.take(500).numel() == 500  # another size: new memory
