"""Payloads at the 4 MiB gRPC message limit, both ways, against a real daemon.

KV payloads of any size travel chunked; single messages of exactly 4 MiB pass and 4 MiB + 1 byte
are refused with RESOURCE_EXHAUSTED by whichever end receives them (the limit is set on both ends).
The test pool has 1024-byte latent rows (bf16, kv_lora_rank 448 + rope 64), so 4096 tokens of one
layer are exactly 4 MiB.
"""

from __future__ import annotations

import uuid

import grpc
import pytest
import torch

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess
from kvtier.v1 import pool_pb2, pool_pb2_grpc

MIB4 = 4 * 1024 * 1024
ROW = (448 + 64) * 2  # 1024 bytes
ROW1K_MODEL = {"model_type": "row1k", "num_hidden_layers": 2, "kv_lora_rank": 448, "qk_rope_head_dim": 64,
               "index_head_dim": 128}


@pytest.fixture()
def big_pool(client):
    pool_id = f"limits-{uuid.uuid4().hex[:8]}"
    info = client.create_pool(ROW1K_MODEL, kv_cache_dtype="bf16", size_tokens=8192, pool_id=pool_id)
    assert info.layout.latent_row_bytes == ROW
    yield pool_id
    client.delete_pool(pool_id, force=True)


def _rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, ROW), dtype=torch.uint8, generator=g)


def _sized(make, size: int):
    """The message ``make(k)`` whose serialized size is exactly ``size`` bytes."""
    k = size - make(0).ByteSize()
    while make(k).ByteSize() > size:
        k -= 1
    msg = make(k)
    assert msg.ByteSize() == size
    return msg, k


def test_kv_payload_of_exactly_4mib_round_trips(client, big_pool):
    """4096 rows x 1024 bytes = 4 MiB written and read back byte-identical through 1 MiB chunks."""
    slots = client.allocate_slots(big_pool, 4096)
    rows = _rows(4096, 1)
    assert rows.numel() == MIB4
    assert client.write_kv(big_pool, slots, latent={0: rows}) == MIB4
    back = client.read_kv(big_pool, slots, latent_layers=[0], index_layers=[])
    assert torch.equal(back.latent[0].view(torch.uint8), rows)


def test_kv_payload_above_4mib_round_trips(client, big_pool):
    """4 MiB + one row (the next size a layout allows) on one layer, plus both layers' indexer data."""
    slots = client.allocate_slots(big_pool, 4097)
    rows = _rows(4097, 2)
    keys = torch.randint(0, 256, (4097, 128), dtype=torch.uint8)
    scales = torch.rand(4097)
    n = client.write_kv(big_pool, slots, latent={1: rows}, index={0: (keys, scales), 1: (keys.flip(0), scales.flip(0))})
    assert n == MIB4 + ROW + 2 * 4097 * 132
    back = client.read_kv(big_pool, slots, latent_layers=[1], index_layers=[0, 1])
    assert torch.equal(back.latent[1].view(torch.uint8), rows)
    assert torch.equal(back.index_k[1], keys.flip(0)) and torch.equal(back.index_scale[0], scales)


def _chunk_request(offset: int):
    return lambda k: pool_pb2.WriteKVRequest(
        layer_id=0, component=pool_pb2.COMPONENT_LATENT, offset=offset, data=b"\x5a" * k)


def test_client_to_daemon_message_of_4mib_passes_and_4mib_plus_1_is_refused(client, daemon, big_pool):
    """Raw WriteKV messages: exactly 4 MiB is accepted; 4 MiB + 1 byte is RESOURCE_EXHAUSTED, pool unchanged."""
    slots = client.allocate_slots(big_pool, 4096)
    header = pool_pb2.WriteKVRequest(header=pool_pb2.KVHeader(pool_id=big_pool, slots=slots.tolist(), latent_layers=[0]))
    opts = [("grpc.max_send_message_length", 2 * MIB4), ("grpc.max_receive_message_length", 2 * MIB4)]
    with grpc.insecure_channel(daemon.address, options=opts) as ch:
        stub = pool_pb2_grpc.PoolServiceStub(ch)
        first, k = _sized(_chunk_request(0), MIB4)
        rest = pool_pb2.WriteKVRequest(
            layer_id=0, component=pool_pb2.COMPONENT_LATENT, offset=k, data=b"\x5a" * (MIB4 - k))
        assert stub.WriteKV(iter([header, first, rest]), timeout=30).bytes_written == MIB4
        too_big, k1 = _sized(_chunk_request(0), MIB4 + 1)
        rest1 = pool_pb2.WriteKVRequest(
            layer_id=0, component=pool_pb2.COMPONENT_LATENT, offset=k1, data=b"\xa5" * (MIB4 - k1))
        with pytest.raises(grpc.RpcError) as err:
            stub.WriteKV(iter([header, too_big, rest1]), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    back = client.read_kv(big_pool, slots, latent_layers=[0], index_layers=[])
    assert bytes(back.latent[0].view(torch.uint8).reshape(-1).numpy()) == b"\x5a" * MIB4


def test_daemon_refuses_chunks_above_its_limit(client, big_pool):
    """A ReadKV asking for chunks that would not fit the daemon's 4 MiB messages is INVALID_ARGUMENT."""
    slots = client.allocate_slots(big_pool, 64)
    with grpc.insecure_channel(client.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(pool_pb2_grpc.PoolServiceStub(ch).ReadKV(pool_pb2.ReadKVRequest(
                header=pool_pb2.KVHeader(pool_id=big_pool, slots=slots.tolist(), latent_layers=[0]),
                chunk_bytes=MIB4), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chunk_bytes" in err.value.details()


@pytest.fixture(scope="module")
def daemon_8mib():
    """A daemon whose messages may be 8 MiB (to send a client messages at and past its 4 MiB limit)."""
    with DaemonProcess(extra_args=["--device", "cpu", "--max-message-bytes", "8MiB", "--log-level", "WARNING"]) as d:
        yield d


def test_daemon_to_client_message_of_4mib_passes_and_4mib_plus_1_is_refused(daemon_8mib):
    """A client with the default 4 MiB limit receives a 4 MiB ReadKV message, and refuses one of 4 MiB + 1."""
    with KVTierClient(daemon_8mib.address, max_message_bytes=8 * 1024 * 1024, chunk_bytes=6 * 1024 * 1024) as big:
        big.create_pool(ROW1K_MODEL, kv_cache_dtype="bf16", size_tokens=8192, pool_id="p")
        slots = big.allocate_slots("p", 4096 + 64)
        rows = _rows(4096 + 64, 3)
        big.write_kv("p", slots, latent={0: rows})  # one 5 MiB chunk: this client and daemon allow 8 MiB
        assert torch.equal(big.read_kv("p", slots, latent_layers=[0], index_layers=[]).latent[0].view(torch.uint8), rows)
    header = pool_pb2.KVHeader(pool_id="p", slots=slots.tolist(), latent_layers=[0])

    def response(k):
        return pool_pb2.ReadKVResponse(layer_id=0, component=pool_pb2.COMPONENT_LATENT, offset=0, data=b"x" * k)

    _, k = _sized(response, MIB4)
    with grpc.insecure_channel(daemon_8mib.address, options=[("grpc.max_receive_message_length", MIB4)]) as ch:
        stub = pool_pb2_grpc.PoolServiceStub(ch)
        got = list(stub.ReadKV(pool_pb2.ReadKVRequest(header=header, chunk_bytes=k), timeout=30))
        assert got[0].ByteSize() == MIB4
        assert b"".join(m.data for m in got) == bytes(rows.reshape(-1).numpy())
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ReadKV(pool_pb2.ReadKVRequest(header=header, chunk_bytes=k + 1), timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with KVTierClient(daemon_8mib.address) as small:  # default 4 MiB limit, 1 MiB chunks: fine
        assert torch.equal(small.read_kv("p", slots, latent_layers=[0], index_layers=[]).latent[0].view(torch.uint8), rows)
