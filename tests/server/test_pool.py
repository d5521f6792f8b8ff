"""Skip-aware DSA pool: shapes, byte layout, host copies, moves, buffer infos, bad input.

Expected bytes come from :mod:`pool_reference` (DESIGN.md's layout applied by hand in numpy).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import (
    INDEX_CHUNK_PAGES, KV_CHUNK_SLOTS, DSATokenToKVPool, MLATokenToKVPool, create_pool, resolve_device,
)
from kvtier.server.pool_configurator import plan_pool
from pool_reference import RefPool, assert_same_bytes, latent_view, randomize, snapshot

PS = 64
GLM52_LIVE = [0, 1, 2] + list(range(6, 75, 4))
SMALL_LIVE = [0, 1, 2, 6]  # GLM-5.2's rules on its first 8 layers


def small_pool(dtype: str = "fp8", size: int = 1024, seed: int = 0, role: str = "target") -> DSATokenToKVPool:
    model = DSAModelConfig.from_preset("glm-5.2", num_layers=8, kv_cache_dtype=dtype)
    pool = create_pool(model, size, role=role, device="cpu")
    randomize(pool, seed)
    return pool


def verify_tokens_equal(ref_before: RefPool, pool: DSATokenToKVPool, tgt, src) -> None:
    """Slots ``tgt`` of the pool now hold what slots ``src`` held in ``ref_before``, on every layer."""
    now = RefPool(pool)
    for t, s in zip(tgt, src):
        assert now.token(t) == ref_before.token(s), f"slot {t} differs from source slot {s}"


# ----- shapes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("size, index_buf_size, num_pages", [(1024, None, 17), (1000, None, 16), (1024, 500, 8), (63, None, 2)])
def test_shapes_fp8(size, index_buf_size, num_pages):
    mask = [False, True, False]
    pool = DSATokenToKVPool(size, PS, 512, 64, 3, "cpu", "fp8", index_buf_size=index_buf_size, skip_topk_layers=mask)
    assert num_pages == ((index_buf_size or size) + PS + 1) // PS
    for layer in range(3):
        kv = pool.kv_buffer[layer]
        assert tuple(kv.shape) == (size + PS, 1, 656) and kv.dtype == torch.uint8
        idx = pool.index_k_with_scale_buffer[layer]
        assert idx.dtype == torch.uint8
        if mask[layer]:
            assert tuple(idx.shape) == (0, 8448) and idx.nbytes == 0
        else:
            assert tuple(idx.shape) == (num_pages, 8448) and idx.nbytes == num_pages * 8448
    assert pool.get_kv_size_bytes() == 3 * (size + PS) * 656 + 2 * num_pages * 8448


def test_shapes_bf16():
    pool = DSATokenToKVPool(1024, PS, 512, 64, 2, "cpu", "bf16")
    assert [tuple(b.shape) for b in pool.kv_buffer] == [(1088, 1, 576)] * 2
    assert all(b.dtype == torch.bfloat16 for b in pool.kv_buffer)
    assert [tuple(b.shape) for b in pool.index_k_with_scale_buffer] == [(17, 8448)] * 2
    assert pool.get_kv_size_bytes() == 2 * 1088 * 1152 + 2 * 17 * 8448


def test_mla_pool_shapes():
    pool = MLATokenToKVPool(100, PS, 512, 64, 3, "cpu", "bf16")
    assert [tuple(b.shape) for b in pool.kv_buffer] == [(164, 1, 576)] * 3
    assert pool.get_kv_size_bytes() == 3 * 164 * 1152


def test_skip_topk_layers_none_means_no_skip_and_mask_is_checked():
    pool = DSATokenToKVPool(128, PS, 512, 64, 3, "cpu", "fp8")
    assert [tuple(b.shape) for b in pool.index_k_with_scale_buffer] == [(3, 8448)] * 3
    with pytest.raises(ValueError, match="skip_topk_layers"):
        DSATokenToKVPool(128, PS, 512, 64, 3, "cpu", "fp8", skip_topk_layers=[False, True])
    with pytest.raises(ValueError, match="layer 0"):
        DSATokenToKVPool(128, PS, 512, 64, 3, "cpu", "fp8", skip_topk_layers=[True, False, False])
    with pytest.raises(ValueError, match="size"):
        DSATokenToKVPool(0, PS, 512, 64, 3, "cpu", "fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        DSATokenToKVPool(128, PS, 512, 64, 3, "cpu", "fp16")


def test_glm52_target_indexer_bytes_are_21_78ths_of_a_draft_pool():
    model = DSAModelConfig.from_preset("glm-5.2")
    target = create_pool(model, 1024, role="target", device="cpu")
    draft = create_pool(model, 1024, role="draft", device="cpu")
    hisparse = create_pool(model, 1024, role="hisparse", device="cpu")
    t = sum(b.nbytes for b in target.index_k_with_scale_buffer)
    d = sum(b.nbytes for b in draft.index_k_with_scale_buffer)
    assert d == 78 * 17 * 8448 and t == 21 * 17 * 8448 and t * 78 == d * 21
    assert sum(b.nbytes for b in hisparse.index_k_with_scale_buffer) == d
    assert [i for i, b in enumerate(target.index_k_with_scale_buffer) if b.nbytes] == GLM52_LIVE
    assert all(tuple(target.index_k_with_scale_buffer[i].shape) == (0, 8448) for i in range(78) if i not in GLM52_LIVE)
    assert draft.get_kv_size_bytes() - target.get_kv_size_bytes() == 57 * 17 * 8448
    with pytest.raises(ValueError, match="role"):
        create_pool(model, 1024, role="decode", device="cpu")


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_pool_of_the_planned_size_has_exactly_the_planned_bytes(dtype):
    model = DSAModelConfig.from_preset("glm-5.2", kv_cache_dtype=dtype)
    budget = 150_000_000
    plan = plan_pool(model, budget, accounting="exact")
    row = 656 if dtype == "fp8" else 1152
    for tokens, role, live, planned in ((plan.skip_aware_tokens, "target", 21, plan.skip_aware_pool_bytes),
                                        (plan.naive_tokens, "draft", 78, plan.naive_pool_bytes)):
        assert tokens % PS == 0 and tokens > 0
        by_hand = 78 * (tokens + PS) * row + live * ((tokens + PS + 1) // PS) * 8448
        pool = create_pool(model, tokens, role=role, device="cpu")
        assert pool.get_kv_size_bytes() == planned == by_hand <= budget
        bigger = tokens + PS
        assert 78 * (bigger + PS) * row + live * ((bigger + PS + 1) // PS) * 8448 > budget
        del pool


def test_auto_device_is_cpu_without_cuda():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")


# ----- byte layout --------------------------------------------------------------------------------
def test_index_k_scale_lands_at_page_offset_bytes():
    pool = small_pool()
    slots = torch.tensor([64 * 3 + 5, 64 * 3 + 63, 64 * 7, 1])
    g = torch.Generator().manual_seed(1)
    keys = torch.randint(0, 256, (4, 128), dtype=torch.uint8, generator=g)
    scales = torch.rand(4, generator=g) * 10
    for layer in SMALL_LIVE:
        pool.set_index_k_scale_buffer(layer, slots, keys, scales)
    scale_bytes = scales.numpy().view(np.uint8).reshape(4, 4)
    for layer in SMALL_LIVE:
        raw = pool.index_k_with_scale_buffer[layer].numpy()
        for i, loc in enumerate(slots.tolist()):
            page, t = loc // 64, loc % 64
            assert np.array_equal(raw[page, t * 128:(t + 1) * 128], keys[i].numpy())
            assert np.array_equal(raw[page, 64 * 128 + 4 * t: 64 * 128 + 4 * t + 4], scale_bytes[i])
        k, s = pool.get_index_k_scale(layer, slots)
        assert torch.equal(k, keys) and torch.equal(s, scales)


def test_index_write_touches_only_the_written_tokens():
    pool = small_pool()
    before = RefPool(pool)
    slots = torch.tensor([130, 200])
    keys = torch.full((2, 128), 7, dtype=torch.uint8)
    scales = torch.tensor([1.5, -2.0])
    pool.set_index_k_scale_buffer(6, slots, keys.view(torch.float8_e4m3fn), scales)
    for s, sc in zip(slots.tolist(), scales):
        before.key(6, s)[:] = 7
        before.scale(6, s)[:] = np.frombuffer(sc.numpy().tobytes(), dtype=np.uint8)
    assert_same_bytes(before.buffers(), snapshot(pool))


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_set_kv_buffer_writes_rows_by_slot(dtype):
    pool = small_pool(dtype)
    before = RefPool(pool)
    slots = torch.tensor([3, 900, 64])
    row_bytes = 656 if dtype == "fp8" else 1152
    raw = torch.randint(0, 256, (3, row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    rows = raw if dtype == "fp8" else raw.view(torch.bfloat16)
    pool.set_kv_buffer(2, slots, rows)
    for i, s in enumerate(slots.tolist()):
        before.lat[2][s] = raw[i].numpy()
    assert_same_bytes(before.buffers(), snapshot(pool))
    assert torch.equal(pool.get_kv_buffer_rows(2, slots).view(torch.uint8).reshape(3, -1), raw)
    pool.set_kv_buffer(3, slots, raw)  # raw bytes are accepted for either dtype
    assert torch.equal(latent_view(pool, 3)[slots], raw)


# ----- host copies --------------------------------------------------------------------------------
def scattered_slots(n: int, seed: int, limit: int, exclude=()) -> torch.Tensor:
    """``n`` distinct slots in ``[1, limit)``, in random (non-contiguous, non-aligned) order."""
    rng = np.random.default_rng(seed)
    pool = np.setdiff1d(np.arange(1, limit), np.asarray(list(exclude), dtype=np.int64))
    return torch.from_numpy(rng.choice(pool, size=n, replace=False).astype(np.int64))


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


# ----- buffer infos -------------------------------------------------------------------------------
def test_state_buf_infos_one_entry_per_layer_skip_layers_zero():
    model = DSAModelConfig.from_preset("glm-5.2")
    pool = create_pool(model, 1024, device="cpu")
    ptrs, lens, items = pool.get_state_buf_infos()
    assert len(ptrs) == len(lens) == len(items) == 78
    for layer in range(78):
        if layer in GLM52_LIVE:
            buf = pool.index_k_with_scale_buffer[layer]
            assert (ptrs[layer], lens[layer], items[layer]) == (buf.data_ptr(), 17 * 8448, 8448)
        else:
            assert (ptrs[layer], lens[layer], items[layer]) == (0, 0, 0)
    live = pool.get_live_state_buf_infos()
    assert [r.layer_id for r in live] == GLM52_LIVE
    assert all(r.data_len == 17 * 8448 and r.item_len == 8448 and r.component == "index_k" for r in live)
    assert all(r.data_ptr == pool.index_k_with_scale_buffer[r.layer_id].data_ptr() for r in live)
    spans = sorted((r.data_ptr, r.data_ptr + r.data_len) for r in live)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
    r = live[3]  # layer 6
    assert r.page_range(2) == (pool.index_k_with_scale_buffer[6][2].data_ptr(), 8448)
    with pytest.raises(ValueError, match="page"):
        r.page_range(17)


@pytest.mark.parametrize("dtype, row", [("fp8", 656), ("bf16", 1152)])
def test_contiguous_buf_infos_item_is_a_page_of_latent_rows(dtype, row):
    pool = small_pool(dtype)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert ptrs == [b.data_ptr() for b in pool.kv_buffer]
    assert lens == [1088 * row] * 8
    assert items == [row * 64] * 8
    assert [r.layer_id for r in pool.get_live_contiguous_buf_infos()] == list(range(8))


# ----- bad input: a clear error and the pool unchanged --------------------------------------------
def raises_unchanged(pool, exc, match, fn, *args, **kwargs):
    before = snapshot(pool)
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)
    assert_same_bytes(before, snapshot(pool))


def rows(n, dtype=torch.uint8, width=656):
    return torch.zeros(n, width, dtype=dtype)


@pytest.mark.parametrize(
    "slots, data, exc, match",
    [
        ([1088], rows(1), ValueError, "outside the pool"),
        ([5, -1], rows(2), ValueError, "negative"),
        (torch.tensor([1.0, 2.0]), rows(2), TypeError, "integer"),
        ([True, False], rows(2), TypeError, "integers"),
        (torch.tensor([[1, 2]]), rows(2), ValueError, "1-D"),
        ([1, 2], rows(3), ValueError, "3 rows but 2 slots"),
        ([1, 2], rows(2, torch.float32), TypeError, "float32"),
        ([1, 2], rows(2, width=655), ValueError, "656"),
        ([7, 8, 7], rows(3), ValueError, "duplicate"),
    ],
)
def test_set_kv_buffer_bad_input(slots, data, exc, match):
    pool = small_pool()
    raises_unchanged(pool, exc, match, pool.set_kv_buffer, 1, slots, data)


def test_bad_layer_ids():
    pool = small_pool()
    raises_unchanged(pool, ValueError, "layer_id", pool.set_kv_buffer, 8, [1], rows(1))
    raises_unchanged(pool, TypeError, "layer_id", pool.set_kv_buffer, 1.0, [1], rows(1))
    keys, scale = torch.zeros(1, 128, dtype=torch.uint8), torch.ones(1)
    raises_unchanged(pool, ValueError, "skips top-k", pool.set_index_k_scale_buffer, 3, [1], keys, scale)
    with pytest.raises(ValueError, match="skips top-k"):
        pool.get_index_k_scale(7, [1])


@pytest.mark.parametrize(
    "slots, keys, scale, exc, match",
    [
        ([1], torch.zeros(1, 128, dtype=torch.float32), torch.ones(1), TypeError, "index_k"),
        ([1], torch.zeros(1, 64, dtype=torch.uint8), torch.ones(1), ValueError, "index_k"),
        ([1, 2], torch.zeros(1, 128, dtype=torch.uint8), torch.ones(2), ValueError, "index_k"),
        ([1], torch.zeros(1, 128, dtype=torch.uint8), torch.ones(1, dtype=torch.float64), TypeError, "scale"),
        ([1], torch.zeros(1, 128, dtype=torch.uint8), torch.ones(2), ValueError, "scale"),
        ([1], torch.zeros(1, 128, dtype=torch.uint8), [1.0], TypeError, "Tensor"),
        ([1, 1], torch.zeros(2, 128, dtype=torch.uint8), torch.ones(2), ValueError, "duplicate"),
        ([2000], torch.zeros(1, 128, dtype=torch.uint8), torch.ones(1), ValueError, "outside"),
        ([-3], torch.zeros(1, 128, dtype=torch.uint8), torch.ones(1), ValueError, "negative"),
    ],
)
def test_set_index_k_scale_bad_input(slots, keys, scale, exc, match):
    pool = small_pool()
    raises_unchanged(pool, exc, match, pool.set_index_k_scale_buffer, 0, slots, keys, scale)


def test_index_slot_past_a_smaller_indexer_buffer_is_refused():
    pool = DSATokenToKVPool(1024, PS, 512, 64, 2, "cpu", "fp8", index_buf_size=200)  # 4 index pages
    randomize(pool, 0)
    keys, scale = torch.zeros(1, 128, dtype=torch.uint8), torch.ones(1)
    raises_unchanged(pool, ValueError, "indexer buffer", pool.set_index_k_scale_buffer, 0, [256], keys, scale)
    raises_unchanged(pool, ValueError, "indexer buffer", pool.move_kv_cache, [5], [300])
    raises_unchanged(pool, ValueError, "indexer buffer", pool.get_cpu_copy, [300])


@pytest.mark.parametrize(
    "tgt, src, match",
    [
        ([1, 2], [3], "2 slots but src_loc has 1"),
        ([1, 1], [3, 4], "duplicate"),
        ([1088], [3], "outside"),
        ([3], [1088], "outside"),
        ([-1], [3], "negative"),
    ],
)
def test_move_bad_input(tgt, src, match):
    pool = small_pool()
    raises_unchanged(pool, ValueError, match, pool.move_kv_cache, tgt, src)


def test_get_cpu_copy_bad_out_buffer():
    pool = small_pool()
    a = torch.arange(1, 11)
    with pytest.raises(ValueError, match="bytes"):
        pool.get_cpu_copy(a, out=torch.empty(pool.cpu_copy_nbytes(a) - 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        pool.get_cpu_copy(a, out=torch.empty(pool.cpu_copy_nbytes(a), dtype=torch.float32))


def copy_of(pool_dtype="fp8", role="target", n=70, seed=0):
    src_pool = small_pool(pool_dtype, role=role, seed=seed)
    return src_pool.get_cpu_copy(torch.arange(100, 100 + n))


def test_load_cpu_copy_with_wrong_layer_count():
    pool = small_pool()
    other = create_pool(DSAModelConfig.from_preset("glm-5.2", num_layers=7), 1024, device="cpu")
    copy = other.get_cpu_copy(torch.arange(1, 71))
    raises_unchanged(pool, ValueError, "8 layers", pool.load_cpu_copy, copy, torch.arange(500, 570))


def test_load_cpu_copy_with_other_skip_mask():
    pool = small_pool()
    raises_unchanged(pool, ValueError, "skip masks differ", pool.load_cpu_copy, copy_of(role="draft"), torch.arange(500, 570))
    draft = small_pool(role="draft")
    raises_unchanged(draft, ValueError, "skip masks differ", draft.load_cpu_copy, copy_of(), torch.arange(500, 570))


def test_load_cpu_copy_with_other_row_bytes():
    pool = small_pool()
    raises_unchanged(pool, (ValueError, TypeError), "656|uint8", pool.load_cpu_copy, copy_of("bf16"), torch.arange(500, 570))


def test_load_cpu_copy_with_wrong_chunk_lengths():
    pool = small_pool()
    copy = copy_of()
    copy["kv"][5] = [copy["kv"][5][0][:30], copy["kv"][5][0][30:]]
    raises_unchanged(pool, ValueError, "chunk lengths", pool.load_cpu_copy, copy, torch.arange(500, 570))
    copy = copy_of()
    copy["index_k"][6] = [copy["index_k"][6][0][:1]]  # one of two pages
    raises_unchanged(pool, ValueError, "chunk lengths", pool.load_cpu_copy, copy, torch.arange(500, 570))
    copy = copy_of()
    copy["index_k"][6] = [copy["index_k"][6][0][:, :8000]]
    raises_unchanged(pool, ValueError, "8448", pool.load_cpu_copy, copy, torch.arange(500, 570))


def test_load_cpu_copy_with_wrong_target_count_or_slots():
    pool = small_pool()
    copy = copy_of()
    raises_unchanged(pool, ValueError, "70 rows but 69", pool.load_cpu_copy, copy, torch.arange(500, 569))
    raises_unchanged(pool, ValueError, "duplicate", pool.load_cpu_copy, copy, torch.tensor([500] * 70))
    raises_unchanged(pool, ValueError, "outside", pool.load_cpu_copy, copy, torch.arange(1030, 1100))
    raises_unchanged(pool, ValueError, "mapping", pool.load_cpu_copy, [copy["kv"]], torch.arange(500, 570))
    bad = dict(copy, src_loc=torch.arange(70, dtype=torch.int64) - 5)
    raises_unchanged(pool, ValueError, "src_loc", pool.load_cpu_copy, bad, torch.arange(500, 570))
    bad = dict(copy, src_loc=torch.arange(60))
    raises_unchanged(pool, ValueError, "src_loc", pool.load_cpu_copy, bad, torch.arange(500, 570))


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


def test_writes_of_zero_tokens_are_no_ops():
    """Regression: set_index_k_scale_buffer with zero slots (an empty batch), and set_kv_buffer with
    zero ``(0, 1, kv_cache_dim)`` rows, raised RuntimeError ("cannot reshape tensor of 0 elements")
    instead of doing nothing."""
    pool = small_pool()
    before = snapshot(pool)
    pool.set_index_k_scale_buffer(0, [], torch.empty(0, 128, dtype=torch.uint8), torch.empty(0))
    pool.set_kv_buffer(0, [], torch.empty(0, 656, dtype=torch.uint8))
    pool.set_kv_buffer(0, [], torch.empty(0, 1, 656, dtype=torch.uint8))  # was RuntimeError too
    assert_same_bytes(before, snapshot(pool))


def test_mla_pool_round_trip_and_move():
    pool = MLATokenToKVPool(256, PS, 512, 64, 3, "cpu", "bf16")
    for layer in range(3):
        lat = pool.kv_buffer[layer].view(torch.uint8).reshape(320, -1)
        lat.copy_(torch.randint(0, 256, (320, 1152), dtype=torch.uint8, generator=torch.Generator().manual_seed(layer)))
    before = [pool.kv_buffer[layer].view(torch.uint8).reshape(320, -1).clone() for layer in range(3)]
    a, b = [5, 70, 71, 300], [200, 9, 64, 1]
    copy = pool.get_cpu_copy(a)
    assert set(copy) == {"kv", "src_loc"} and [c.shape for c in copy["kv"][0]] == [(4, 1, 576)]
    pool.load_cpu_copy(copy, b)
    pool.move_kv_cache([10, 11], [11, 10])
    for layer in range(3):
        want = before[layer].clone()
        want[b] = before[layer][a]
        want[[10, 11]] = want[[11, 10]]
        assert torch.equal(pool.kv_buffer[layer].view(torch.uint8).reshape(320, -1), want)
    with pytest.raises(ValueError, match="3 layers"):
        pool.load_cpu_copy({"kv": copy["kv"][:2]}, b)


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
