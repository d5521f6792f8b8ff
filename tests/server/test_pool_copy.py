"""Host copies (get_cpu_copy / load_cpu_copy) and in-place moves, checked byte for byte against
the numpy reference of :mod:`pool_reference`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import INDEX_CHUNK_PAGES, KV_CHUNK_SLOTS, DSATokenToKVPool, create_pool
from pool_reference import SMALL_LIVE, RefPool, assert_same_bytes, latent_view, randomize, scattered_slots, small_pool, snapshot


def verify_tokens_equal(ref_before: RefPool, pool: DSATokenToKVPool, tgt, src) -> None:
    """Slots ``tgt`` of the pool now hold what slots ``src`` held in ``ref_before``, on every layer."""
    now = RefPool(pool)
    for t, s in zip(tgt, src):
        assert now.token(t) == ref_before.token(s), f"slot {t} differs from source slot {s}"


# ----- host copies --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 129])
def test_round_trip_onto_other_scattered_slots(dtype, n):
    pool = small_pool(dtype, seed=n)
    a = scattered_slots(n, seed=n, limit=1088)
    b = scattered_slots(n, seed=n + 1000, limit=1088, exclude=a.tolist())
    expected = RefPool(pool)
    copy = pool.get_cpu_copy(a)
    expected.move(b.tolist(), a.tolist())
    pool.load_cpu_copy(copy, b)
    assert_same_bytes(expected.buffers(), snapshot(pool))  # targets right, every other byte as it was


@pytest.mark.parametrize("n", [1, 64, 129])
def test_round_trip_onto_overlapping_slots_and_with_reused_out_buffer(n):
    pool = small_pool(seed=7)
    a = torch.arange(40, 40 + n)  # not page-aligned
    b = torch.arange(40 + n // 2, 40 + n // 2 + n).flip(0)  # overlaps a, reversed
    out = torch.empty(pool.cpu_copy_nbytes(a) + 100, dtype=torch.uint8)
    expected = RefPool(pool)
    copy = pool.get_cpu_copy(a, out=out)
    plain = pool.get_cpu_copy(a)
    for key in ("kv", "index_k"):
        for x, y in zip(copy[key], plain[key]):
            assert len(x) == len(y) and all(torch.equal(cx, cy) for cx, cy in zip(x, y))
    expected.move(b.tolist(), a.tolist())
    pool.load_cpu_copy(copy, b)
    assert_same_bytes(expected.buffers(), snapshot(pool))


def test_partial_page_target_keeps_sentinels_around_the_tokens():
    pool = small_pool()
    page = 9
    for layer in SMALL_LIVE:
        pool.index_k_with_scale_buffer[layer][page].fill_(0xAB)
    a = torch.tensor([70, 71, 72, 500, 501, 3, 4, 5, 6, 7])
    b = torch.arange(page * 64 + 10, page * 64 + 20)  # tokens 10..19 of page 9
    want = RefPool(pool)
    pool.load_cpu_copy(pool.get_cpu_copy(a), b)
    for layer in SMALL_LIVE:
        row = pool.index_k_with_scale_buffer[layer][page].numpy()
        assert (row[: 10 * 128] == 0xAB).all() and (row[20 * 128: 64 * 128] == 0xAB).all()
        assert (row[8192: 8192 + 40] == 0xAB).all() and (row[8192 + 80:] == 0xAB).all()
        for i, s in enumerate(a.tolist()):
            t = 10 + i
            assert np.array_equal(row[t * 128:(t + 1) * 128], want.key(layer, s))
            assert np.array_equal(row[8192 + 4 * t: 8192 + 4 * t + 4], want.scale(layer, s))


def sglang_style_copy(pool: DSATokenToKVPool, pages: list[int], n: int) -> dict:
    """A page-aligned copy built straight from the raw buffers, without ``src_loc`` (as SGLang makes it):
    token ``i`` is token ``i % 64`` of ``pages[i // 64]``."""
    slots = [p * 64 + i % 64 for i, p in zip(range(n), [pages[i // 64] for i in range(n)])]
    kv = [[pool.kv_buffer[layer][torch.tensor(slots)].clone()] for layer in range(pool.layer_num)]
    index_k = [
        [pool.index_k_with_scale_buffer[layer][torch.tensor(pages)].clone()] if pool.index_k_with_scale_buffer[layer].numel() else []
        for layer in range(pool.layer_num)
    ]
    return {"kv": kv, "index_k": index_k}, slots


def test_copy_without_src_loc_is_read_page_aligned():
    pool = small_pool(seed=3)
    copy, src = sglang_style_copy(pool, [5, 2], 100)
    b = scattered_slots(100, seed=3, limit=1088, exclude=src)
    expected = RefPool(pool)
    expected.move(b.tolist(), src)
    pool.load_cpu_copy(copy, b)
    assert_same_bytes(expected.buffers(), snapshot(pool))


def test_get_cpu_copy_without_src_loc_of_page_aligned_slots_loads_the_same():
    pool = small_pool(seed=4)
    a = torch.cat([torch.arange(320, 384), torch.arange(128, 150)])  # pages 5 and 2, page-aligned
    copy = pool.get_cpu_copy(a)
    del copy["src_loc"]
    b = torch.arange(600, 686)
    expected = RefPool(pool)
    expected.move(b.tolist(), a.tolist())
    pool.load_cpu_copy(copy, b)
    assert_same_bytes(expected.buffers(), snapshot(pool))


def first_appearance(slots: list[int]) -> list[int]:
    seen: dict[int, None] = {}
    for s in slots:
        seen.setdefault(s // 64, None)
    return list(seen)


def test_get_cpu_copy_structure_across_chunk_limits():
    """8200 shuffled slots: two kv chunks (8192 + 8), index chunks of 128 pages in order of first appearance."""
    assert (KV_CHUNK_SLOTS, INDEX_CHUNK_PAGES) == (8192, 128)
    model = DSAModelConfig.from_preset("glm-5.2", num_layers=4)  # live 0, 1, 2; layer 3 skips
    pool = create_pool(model, 9984, device="cpu")
    randomize(pool, 11)
    a = scattered_slots(8200, seed=11, limit=10048)
    copy = pool.get_cpu_copy(a)
    assert set(copy) >= {"kv", "index_k"} and len(copy["kv"]) == len(copy["index_k"]) == 4
    pages = first_appearance(a.tolist())
    assert len(pages) > 128
    for layer in range(4):
        kv = copy["kv"][layer]
        assert [c.shape[0] for c in kv] == [8192, 8]
        assert all(tuple(c.shape[1:]) == (1, 656) and c.dtype == torch.uint8 for c in kv)
        assert torch.equal(torch.cat(kv).reshape(8200, 656), latent_view(pool, layer)[a])
        idx = copy["index_k"][layer]
        if layer == 3:
            assert idx == []
            continue
        want = [min(128, len(pages) - i) for i in range(0, len(pages), 128)]
        assert [c.shape[0] for c in idx] == want
        assert all(c.dtype == torch.uint8 and c.shape[1] == 8448 for c in idx)
        assert torch.equal(torch.cat(idx), pool.index_k_with_scale_buffer[layer][torch.tensor(pages)])
    b = scattered_slots(8200, seed=12, limit=10048)
    expected = RefPool(pool)
    expected.move(b.tolist(), a.tolist())
    pool.load_cpu_copy(copy, b)
    assert_same_bytes(expected.buffers(), snapshot(pool))


def test_empty_copy_round_trip_is_a_no_op():
    """Regression: get_cpu_copy of zero slots raised RuntimeError ("cannot reshape tensor of 0
    elements") instead of returning empty chunk lists."""
    pool = small_pool()
    before = snapshot(pool)
    copy = pool.get_cpu_copy(torch.empty(0, dtype=torch.int64))
    assert copy["kv"] == [[] for _ in range(8)] and copy["index_k"] == [[] for _ in range(8)]
    pool.load_cpu_copy(copy, [])
    assert_same_bytes(before, snapshot(pool))


# ----- moves --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_move_is_token_granular_and_leaves_neighbours(dtype):
    pool = small_pool(dtype)
    expected = RefPool(pool)
    tgt, src = [130, 131, 700], [70, 5, 1000]
    pool.move_kv_cache(torch.tensor(tgt), torch.tensor(src))
    expected.move(tgt, src)
    assert_same_bytes(expected.buffers(), snapshot(pool))
    assert all(pool.index_k_with_scale_buffer[i].shape == (0, 8448) for i in (3, 4, 5, 7))


def test_move_swap_reads_every_source_first():
    pool = small_pool()
    before = RefPool(pool)
    pool.move_kv_cache([70, 135], [135, 70])
    verify_tokens_equal(before, pool, [70, 135], [135, 70])


def test_move_shifted_overlapping_range():
    pool = small_pool()
    expected = RefPool(pool)
    src = list(range(60, 140))
    tgt = [s + 3 for s in src]
    pool.move_kv_cache(tgt, src)
    expected.move(tgt, src)
    assert_same_bytes(expected.buffers(), snapshot(pool))


def test_move_with_repeated_sources():
    pool = small_pool()
    expected = RefPool(pool)
    pool.move_kv_cache(np.array([200, 201, 202]), np.array([9, 9, 9]))
    expected.move([200, 201, 202], [9, 9, 9])
    assert_same_bytes(expected.buffers(), snapshot(pool))


def test_empty_move_is_a_no_op():
    pool = small_pool()
    before = snapshot(pool)
    pool.move_kv_cache(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    pool.move_kv_cache([], [])
    assert_same_bytes(before, snapshot(pool))


def at_odd_offsets(copy: dict, keys=("kv", "index_k")) -> dict:
    """The same copy with the chunks of ``keys`` moved into one byte buffer at odd offsets (as when
    chunks are parsed out of a wire payload or a disk record without realignment)."""
    chunks = [c for key in keys for layer in copy[key] for c in layer]
    blob = torch.empty(sum(c.nbytes for c in chunks) + 2 * len(chunks) + 1, dtype=torch.uint8)
    off = 1
    out = dict(copy)
    for key in keys:
        out[key] = []
        for layer in copy[key]:
            views = []
            for c in layer:
                v = blob[off: off + c.nbytes]
                v.copy_(c.reshape(-1).view(torch.uint8))
                views.append(v.view(c.shape) if c.dtype == torch.uint8 else v.view(c.shape[0], -1))
                off += c.nbytes + 2
            out[key].append(views)
        assert all(v.storage_offset() % 8 for layer in out[key] for v in layer)
    return out


@pytest.mark.parametrize("keys", [("index_k",), ("kv", "index_k")])
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_load_cpu_copy_from_chunks_at_odd_byte_offsets(dtype, keys):
    """Regression: a copy whose chunks sit at odd byte offsets of a shared buffer (a parsed wire
    payload) wrote every latent row, then failed with RuntimeError ("storage_offset must be divisible
    by 8") on the indexer: latent restored without its indexer. It must load completely."""
    pool = small_pool(dtype, seed=21)
    a = scattered_slots(100, seed=21, limit=1088)
    b = scattered_slots(100, seed=22, limit=1088, exclude=a.tolist())
    expected = RefPool(pool)
    copy = at_odd_offsets(pool.get_cpu_copy(a), keys)
    expected.move(b.tolist(), a.tolist())
    pool.load_cpu_copy(copy, b)
    assert_same_bytes(expected.buffers(), snapshot(pool))


def test_writes_from_tensors_at_odd_byte_offsets():
    """Regression: set_kv_buffer / set_index_k_scale_buffer raised RuntimeError for inputs that are
    views at odd byte offsets; they must write the same bytes as from fresh tensors."""
    pool = small_pool()
    blob = torch.randint(0, 256, (1 + 2 * 656 + 2 * 128,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    lat = blob[1: 1 + 2 * 656].view(2, 656)
    keys = blob[1 + 2 * 656:].view(2, 128)
    pool.set_kv_buffer(4, [300, 301], lat)
    pool.set_index_k_scale_buffer(6, [300, 301], keys, torch.tensor([0.5, 0.25]))
    assert torch.equal(latent_view(pool, 4)[[300, 301]], lat)
    k, s = pool.get_index_k_scale(6, [300, 301])
    assert torch.equal(k, keys) and s.tolist() == [0.5, 0.25]


def test_get_cpu_copy_into_misaligned_out_buffer_is_refused():
    """Regression: an ``out=`` buffer starting at an odd byte offset raised RuntimeError from a view."""
    pool = small_pool()
    a = torch.arange(1, 11)
    out = torch.empty(pool.cpu_copy_nbytes(a) + 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="aligned"):
        pool.get_cpu_copy(a, out=out[1:])


def test_copy_does_not_alias_the_callers_index_tensor():
    """Regression: get_cpu_copy(a)["src_loc"] was the caller's own tensor ``a``; a scheduler that
    reused ``a`` for the next request before load_cpu_copy made the indexer keys and scales come
    from the wrong (page, offset) while the latent rows were right (9,205 bytes wrong on one layer)."""
    pool = small_pool(seed=5)
    a = torch.arange(100, 170)
    expected = RefPool(pool)
    copy = pool.get_cpu_copy(a)
    a.add_(30)  # the caller reuses its index tensor
    b = torch.arange(600, 670)
    expected.move(b.tolist(), list(range(100, 170)))
    pool.load_cpu_copy(copy, b)
    assert_same_bytes(expected.buffers(), snapshot(pool))


def test_copy_loads_into_another_pool_of_the_same_model():
    """A host copy is pool-independent: restoring into a pool of another size (or a PD peer's) works."""
    src_pool = small_pool(seed=8)
    dst_pool = small_pool(size=2048, seed=9)
    a = scattered_slots(129, seed=8, limit=1088)
    b = scattered_slots(129, seed=9, limit=2112)
    source = RefPool(src_pool)
    expected = RefPool(dst_pool)
    dst_pool.load_cpu_copy(src_pool.get_cpu_copy(a), b)
    for t, s in zip(b.tolist(), a.tolist()):
        expected.put_token(t, source.token(s))
    assert_same_bytes(expected.buffers(), snapshot(dst_pool))


@pytest.mark.parametrize("n", [1, 3, 65])
def test_a_copy_whose_parts_do_not_start_on_a_word_round_trips(n):
    """A pool (library use) whose bf16 latent rows are 1,022 bytes: get_cpu_copy puts the indexer
    pages after ``2 * n * 1022`` bytes, not on an 8-byte word for odd ``n`` (it raised "view Byte as
    Long"). That part is gathered through uint8 views; load_cpu_copy onto other slots of another pool
    gives back every byte (compared as bytes: random bf16 rows hold NaNs)."""
    model = DSAModelConfig.from_hf_config({"model_type": "odd-rows", "num_hidden_layers": 2, "kv_lora_rank": 447,
                                           "qk_rope_head_dim": 64, "index_head_dim": 128}, kv_cache_dtype="bf16")
    src, dst = create_pool(model, 256, device="cpu"), create_pool(model, 256, device="cpu")
    assert src.row_bytes == 1022
    s, t = torch.arange(64, 64 + n), torch.arange(128, 128 + n)
    g = torch.Generator().manual_seed(n)
    for layer in range(2):
        src.set_kv_buffer(layer, s, torch.randint(0, 256, (n, 1022), dtype=torch.uint8, generator=g).view(torch.bfloat16).view(n, 1, -1))
    live = [x for x in range(2) if not src.skip_topk_layers[x]]
    assert live
    for layer in live:
        src.set_index_k_scale_buffer(layer, s, torch.randint(0, 256, (n, 128), dtype=torch.uint8, generator=g), torch.rand(n, generator=g))
    dst.load_cpu_copy(src.get_cpu_copy(s), t)
    as_bytes = lambda x: x.view(torch.uint8)  # noqa: E731
    for layer in range(2):
        assert torch.equal(as_bytes(src.get_kv_buffer_rows(layer, s)), as_bytes(dst.get_kv_buffer_rows(layer, t)))
    for layer in live:
        for a, b in zip(src.get_index_k_scale(layer, s), dst.get_index_k_scale(layer, t)):
            assert torch.equal(as_bytes(a), as_bytes(b))
