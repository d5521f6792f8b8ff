"""KV through a real daemon subprocess (unix socket and 127.0.0.1): write/read, move, offload/restore."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import INDEX_PAGE_BYTES, LIVE_LAYERS, NUM_LAYERS, PAGE_SIZE, ROW_BYTES, random_kv, verify_kv


def test_pool_layout_is_skip_aware(client, pool):
    """DescribePool reports GLM-5.2's first 8 layers with indexer buffers on 0, 1, 2, 6 only."""
    info = client.describe_pool(pool)
    assert info.layout.skip_mask == "".join("F" if l in LIVE_LAYERS else "S" for l in range(NUM_LAYERS))
    assert list(info.live_layers) == list(LIVE_LAYERS)
    assert info.layout.latent_row_bytes == ROW_BYTES and info.layout.index_page_bytes == INDEX_PAGE_BYTES
    assert info.size_tokens == 1024 and info.total_pages == 16 and info.free_pages == 16
    # SGLang's shapes: latent (size + page) rows a layer; indexer (size + page + 1) // page pages a live layer.
    latent = NUM_LAYERS * (1024 + 64) * ROW_BYTES
    index = len(LIVE_LAYERS) * ((1024 + 64 + 1) // 64) * INDEX_PAGE_BYTES
    assert info.kv_size_bytes == latent + index
    assert [l.index_bytes for l in info.layers] == [index // len(LIVE_LAYERS) if l in LIVE_LAYERS else 0 for l in range(NUM_LAYERS)]


def test_write_read_round_trip(client, pool):
    """Random latent rows on every layer and indexer keys+scales on live layers come back byte-identical."""
    slots = client.allocate_slots(pool, 150)
    assert slots.tolist() == list(range(64, 64 + 150))  # page 0 is padding: pages 1.. in order
    latent, index = random_kv(150, seed=1)
    written = client.write_kv(pool, slots, latent=latent, index=index)
    assert written == 150 * (NUM_LAYERS * ROW_BYTES + len(LIVE_LAYERS) * 132)
    verify_kv(client.read_kv(pool, slots), latent, index)


def test_partial_layers_and_permuted_slots(client, pool):
    """A write of some layers on permuted slots changes only those; a read of a subset returns that subset."""
    slots = client.allocate_slots(pool, 64)
    base_latent, base_index = random_kv(64, seed=2)
    client.write_kv(pool, slots, latent=base_latent, index=base_index)
    perm = slots[torch.randperm(64, generator=torch.Generator().manual_seed(0))]
    new_latent, new_index = random_kv(64, seed=3, layers=[5], live=[6])
    client.write_kv(pool, perm, latent=new_latent, index=new_index)
    kv = client.read_kv(pool, perm, latent_layers=[5, 0], index_layers=[6])
    assert torch.equal(kv.latent[5], new_latent[5])
    order = (perm - slots[0]).tolist()
    assert torch.equal(kv.latent[0], base_latent[0][order])
    assert torch.equal(kv.index_k[6], new_index[6][0]) and torch.equal(kv.index_scale[6], new_index[6][1])
    other = client.read_kv(pool, slots, latent_layers=[], index_layers=[0])
    assert other.latent == {} and torch.equal(other.index_k[0], base_index[0][0])


def test_numpy_arrays_are_accepted(client, pool):
    """write_kv takes numpy arrays as well as tensors; slots may be a numpy array or a list."""
    slots = client.allocate_slots(pool, 5).numpy()
    latent, index = random_kv(5, seed=9, layers=[1], live=[2])
    client.write_kv(pool, slots, latent={1: latent[1].numpy()}, index={2: (index[2][0].numpy(), index[2][1].numpy())})
    verify_kv(client.read_kv(pool, slots.tolist(), latent_layers=[1], index_layers=[2]), latent, index)


def test_move_is_token_granular(client, pool):
    """MoveKV copies 10 tokens onto another page; that page's other tokens keep their bytes."""
    a = client.allocate_slots(pool, 64)
    b = client.allocate_slots(pool, 64)
    la, ia = random_kv(64, seed=4)
    lb, ib = random_kv(64, seed=5)
    client.write_kv(pool, a, latent=la, index=ia)
    client.write_kv(pool, b, latent=lb, index=ib)
    assert client.move_kv(pool, b[20:30], a[:10]) == 10
    expect_l = {l: torch.cat([lb[l][:20], la[l][:10], lb[l][30:]]) for l in la}
    expect_i = {l: (torch.cat([ib[l][0][:20], ia[l][0][:10], ib[l][0][30:]]),
                    torch.cat([ib[l][1][:20], ia[l][1][:10], ib[l][1][30:]])) for l in ia}
    verify_kv(client.read_kv(pool, b), expect_l, expect_i)
    verify_kv(client.read_kv(pool, a), la, ia)


def test_offload_free_restore_into_other_slots(client, pool):
    """Offload frees the pages; restore into different slots brings back latent and live indexer bytes."""
    slots = client.allocate_slots(pool, 100)  # pages 1, 2
    latent, index = random_kv(100, seed=6)
    client.write_kv(pool, slots, latent=latent, index=index)
    r = client.offload(pool, "req-a", slots, free_slots=True)
    # host bytes: latent rows of every layer + whole indexer page rows of live layers only
    assert r.nbytes == NUM_LAYERS * 100 * ROW_BYTES + len(LIVE_LAYERS) * 2 * INDEX_PAGE_BYTES
    assert (r.num_tokens, r.freed_pages) == (100, 2)
    assert client.describe_pool(pool).free_pages == 16
    filler = client.allocate_slots(pool, 128)  # takes pages 1, 2 so the restore lands elsewhere
    other = client.allocate_slots(pool, 100)
    assert set((other // PAGE_SIZE).tolist()) == {3, 4}
    back = client.restore(pool, "req-a", other)
    assert torch.equal(back, other)
    verify_kv(client.read_kv(pool, other), latent, index)
    fresh = client.restore(pool, "req-a", drop=True)  # into newly allocated slots, then dropped
    assert set((fresh // PAGE_SIZE).tolist()) == {5, 6}
    verify_kv(client.read_kv(pool, fresh), latent, index)
    assert client.drop("req-a") is False
    client.free_slots(pool, filler)


def test_buffer_infos_have_layer_ids_and_skip_mask(client, pool):
    """State buffer infos: live layers one 8448-byte item a page, skip layers (0, 0, 0); latent on every layer."""
    infos = client.buffer_infos(pool)
    assert list(infos.skip_topk_layers) == [l not in LIVE_LAYERS for l in range(NUM_LAYERS)]
    num_pages = (1024 + 64 + 1) // 64
    for e in infos.state:
        if e.layer_id in LIVE_LAYERS:
            assert (e.item_len, e.data_len) == (INDEX_PAGE_BYTES, num_pages * INDEX_PAGE_BYTES) and e.data_ptr
        else:
            assert (e.data_ptr, e.data_len, e.item_len) == (0, 0, 0)
    assert [e.layer_id for e in infos.contiguous] == list(range(NUM_LAYERS))
    assert all(e.item_len == ROW_BYTES * 64 and e.data_len == (1024 + 64) * ROW_BYTES for e in infos.contiguous)
    assert infos.layout.fingerprint_digest == client.describe_pool(pool).layout.fingerprint_digest


def test_stats_count_bytes(client, pool):
    """Stats report the pool's used tokens and the host tier's bytes."""
    slots = client.allocate_slots(pool, 10)
    latent, index = random_kv(10, seed=7)
    client.write_kv(pool, slots, latent=latent, index=index)
    client.offload(pool, "stats-key", slots)
    s = client.stats()
    mine = [p for p in s.pools if p.pool_id == pool][0]
    assert (mine.used_tokens, mine.free_tokens) == (64, 1024 - 64)
    host = [t for t in s.tiers if t.tier == "host"][0]
    assert host.used_bytes >= NUM_LAYERS * 10 * ROW_BYTES + len(LIVE_LAYERS) * INDEX_PAGE_BYTES
    assert host.budget_bytes == 4 << 20
    assert s.counters["kv_writes"] >= 1
    client.drop("stats-key")


def test_reads_follow_a_recreated_pool(daemon, client):
    """A pool re-created under the same id with another layout: a write naming the old layout is refused
    (FAILED_PRECONDITION, nothing written); a read refreshes the client's cached layout."""
    from kvtier.client import FailedPreconditionError, KVTierClient

    client.create_pool("glm-5.2", num_layers=8, size_tokens=256, pool_id="recreated")
    with KVTierClient(daemon.address) as other:
        slots = other.allocate_slots("recreated", 10)
        other.read_kv("recreated", slots)  # caches the 8-layer layout
        client.delete_pool("recreated", force=True)
        client.create_pool("glm-5.2", num_layers=4, size_tokens=256, pool_id="recreated")
        assert client.allocate_slots("recreated", 10).tolist() == slots.tolist()
        with pytest.raises(FailedPreconditionError, match="re-created"):
            other.write_kv("recreated", slots, latent={0: torch.ones(10, ROW_BYTES, dtype=torch.uint8)})
        kv = other.read_kv("recreated", slots)
        assert sorted(kv.latent) == [0, 1, 2, 3] and bool((kv.latent[0] == 0).all())
    client.delete_pool("recreated", force=True)


def test_reads_are_packed_into_full_messages_and_the_client_reads_either_form(client, pool, monkeypatch):
    """The client asks for packed reads: the 14 segments of 150 tokens run together in
    ceil(total / 8 KiB) full messages instead of one message sequence a segment. It reads the older
    form too (a daemon that predates `packed` sends one message sequence a segment)."""
    from kvtier.client import pool as client_pool
    from kvtier.v1 import pool_pb2

    slots = client.allocate_slots(pool, 150)
    latent, index = random_kv(150, seed=21)
    total = client.write_kv(pool, slots, latent=latent, index=index)
    lay = client.layout(pool)
    header = pool_pb2.KVHeader(pool_id=pool, slots=slots.tolist(), latent_layers=list(range(NUM_LAYERS)),
                               index_layers=list(LIVE_LAYERS), layout_digest=lay.fingerprint_digest)
    chunk = 8192
    packed = list(client._read_kv_raw(pool_pb2.ReadKVRequest(header=header, chunk_bytes=chunk, packed=True), timeout=30))
    unpacked = list(client._read_kv_raw(pool_pb2.ReadKVRequest(header=header, chunk_bytes=chunk), timeout=30))
    assert len(packed) == -(-total // chunk)
    assert len(unpacked) == NUM_LAYERS * -(-150 * ROW_BYTES // chunk) + len(LIVE_LAYERS) * (-(-150 * 128 // chunk) + 1) > len(packed)
    verify_kv(client.read_kv(pool, slots), latent, index)
    real = pool_pb2.ReadKVRequest
    monkeypatch.setattr(client_pool.pool_pb2, "ReadKVRequest", lambda **kw: real(**{**kw, "packed": False}))
    verify_kv(client.read_kv(pool, slots), latent, index)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("n, order", [(150, "in order"), (64, "permuted"), (257, "pages reversed")])
def test_writes_in_either_form_round_trip_byte_for_byte(daemon, pool, packed, n, order):
    """Every layer kind (latent on all 8 layers, keys+scales on the live ones, none on skip layers)
    written in 4 KiB messages, packed across segment boundaries (what a daemon saying
    PoolInfo.packed_writes gets) or one sequence a segment (an older daemon), on slots in page order
    (views of the pool on read), permuted (gathered) and pages out of order, reads back exactly."""
    from kvtier.client import KVTierClient

    with KVTierClient(daemon.address, timeout=30.0, chunk_bytes=4096) as c:
        assert c.describe_pool(pool).packed_writes
        slots = c.allocate_slots(pool, n)
        if order == "permuted":
            slots = slots[torch.randperm(n, generator=torch.Generator().manual_seed(5))]
        elif order == "pages reversed":
            slots = torch.cat([slots[i:i + 64] for i in range(0, n, 64)][::-1])
        c.layout(pool)
        c._packed_writes[pool] = packed
        latent, index = random_kv(n, seed=31)
        assert c.write_kv(pool, slots, latent=latent, index=index) == n * (NUM_LAYERS * ROW_BYTES + len(LIVE_LAYERS) * 132)
        verify_kv(c.read_kv(pool, slots), latent, index)
        verify_kv(c.read_kv(pool, slots, latent_layers=[3], index_layers=[6]), {3: latent[3]}, {6: index[6]})


def test_malformed_or_oversized_write_streams_are_invalid_and_change_nothing(client, pool):
    """Raw WriteKV streams that break the contract -- a packed message naming a component, a gap, more
    bytes than the header selects, a second header, bytes that are no message -- are INVALID_ARGUMENT
    and leave the pool as it was."""
    import grpc

    from kvtier.client.wire import encode_write_chunk
    from kvtier.v1 import pool_pb2

    slots = client.allocate_slots(pool, 64)
    latent, index = random_kv(64, seed=41, layers=[0], live=[0])
    client.write_kv(pool, slots, latent=latent, index=index)
    total = 64 * (ROW_BYTES + 132)
    header = pool_pb2.KVHeader(pool_id=pool, slots=slots.tolist(), latent_layers=[0], index_layers=[0]).SerializeToString()
    data = memoryview(bytes(range(256)) * (total // 256 + 1))

    def packed(*msgs):
        return [encode_write_chunk(0, 0, 0, [], header=header, packed=True), *msgs]

    streams = {
        "names a component": packed(encode_write_chunk(0, 1, 0, [data[:total]])),
        "a gap": packed(encode_write_chunk(0, 0, 0, [data[:8192]]), encode_write_chunk(0, 0, 9000, [data[:8192]])),
        "too many bytes": packed(encode_write_chunk(0, 0, 0, [data[:total]]), encode_write_chunk(0, 0, total, [data[:4096]])),
        "two headers": packed(encode_write_chunk(0, 0, 0, [data[:4096]], header=header)),
        "segment piece in a packed stream": packed(encode_write_chunk(0, pool_pb2.COMPONENT_LATENT, 0, [data[:4096]])),
        "no message": [encode_write_chunk(0, 0, 0, [], header=header), b"\x2a\x7f"],
        "short": packed(encode_write_chunk(0, 0, 0, [data[:total - 1]])),
    }
    for why, msgs in streams.items():
        with pytest.raises(grpc.RpcError) as err:
            client._write_kv_raw(iter(msgs), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, why
    verify_kv(client.read_kv(pool, slots, latent_layers=[0], index_layers=[0]), latent, index)


def test_write_kv_arguments_of_the_wrong_kind_are_one_clear_type_error(client, pool):
    """A placeholder (``latent=...``), a list for the dict, or an index entry that is not a
    (keys, scales) pair fails in the client with a TypeError naming the expected form; nothing is sent."""
    slots = client.allocate_slots(pool, 64)
    before = client.stats().counters.get("kv_writes", 0)
    with pytest.raises(TypeError, match=r"latent must be a dict \{layer id"):
        client.write_kv(pool, slots, latent=...)
    with pytest.raises(TypeError, match=r"index must be a dict"):
        client.write_kv(pool, slots, index=[torch.zeros(64, 128, dtype=torch.uint8)])
    with pytest.raises(TypeError, match=r"index\[0\] must be a \(keys, scales\) pair"):
        client.write_kv(pool, slots, index={0: torch.zeros(64, 128, dtype=torch.uint8)})
    assert client.stats().counters.get("kv_writes", 0) == before


def test_no_daemon_is_unavailable_saying_what_to_do(tmp_path):
    """A client whose address nobody serves gets UnavailableError that starts with what is wrong and
    what to do (start a daemon, or pass its address), gRPC's own reason kept after it."""
    from kvtier.client import KVTierClient, UnavailableError

    with KVTierClient(f"unix://{tmp_path}/nobody.sock", timeout=2) as c:
        with pytest.raises(UnavailableError) as e:
            c.list_pools()
    msg = str(e.value)
    assert msg.startswith(f"UNAVAILABLE: no kvtier daemon answers at unix://{tmp_path}/nobody.sock (start one with `kvtier serve`")
    assert "gRPC: failed to connect" in msg


ODD_ROW_MODEL = {"model_type": "odd-rows", "num_hidden_layers": 2, "kv_lora_rank": 447, "qk_rope_head_dim": 64,
                 "index_head_dim": 128}  # bf16: (447 + 64) * 2 = 1,022-byte latent rows, 2 mod 4


def test_a_pool_whose_rows_are_not_whole_words_is_refused_at_create(client):
    """A model whose bf16 latent rows are 1,022 bytes (kv_lora_rank 447): the daemon's host copies,
    records and transfers lay components out back to back in int64 words, so such a pool failed
    later (INTERNAL "view Byte as Long" at Offload, a partial WriteKV before that was fixed). It is
    refused at CreatePool, INVALID_ARGUMENT naming the row size, and no pool is left behind."""
    from kvtier.client import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"latent rows are 1022 bytes, not whole 8-byte words"):
        client.create_pool(ODD_ROW_MODEL, kv_cache_dtype="bf16", size_tokens=256, pool_id="odd-rows")
    assert "odd-rows" not in [p.pool_id for p in client.list_pools()]


def test_a_restore_that_drops_its_copy_reads_it_once(client, pool):
    """Offload 2 pages, Restore with drop: the host tier counts one hit and the record's bytes read
    once (the drop knows the copy's size from the restore; it read and checksummed it again before),
    and the copy is gone."""
    slots = client.allocate_slots(pool, 128)
    latent, index = random_kv(128, seed=21)
    client.write_kv(pool, slots, latent=latent, index=index)
    key = f"once-{slots[0].item()}-{id(client)}"
    used = client.tier_stats().tiers["host"]["used_bytes"]
    client.offload(pool, key, slots, free_slots=True)
    before = client.tier_stats().tiers["host"]
    written = before["used_bytes"] - used  # the record's bytes on the host tier
    back = client.restore(pool, key, drop=True)
    after = client.tier_stats().tiers["host"]
    assert after["used_bytes"] == used
    assert after["hits"] - before["hits"] == 1
    assert after["bytes_read"] - before["bytes_read"] == written
    verify_kv(client.read_kv(pool, back), latent, index)
    with pytest.raises(Exception, match="no offloaded copy"):
        client.restore(pool, key)
    client.free_slots(pool, back)
