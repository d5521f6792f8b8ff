"""Skip-aware DSA pool: shapes and sizes, byte layout of writes, buffer infos.

Expected bytes come from :mod:`pool_reference` (DESIGN.md's layout applied by hand in numpy).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import DSATokenToKVPool, MLATokenToKVPool, create_pool, resolve_device
from kvtier.server.pool_configurator import plan_pool
from pool_reference import SMALL_LIVE, RefPool, assert_same_bytes, latent_view, randomize, small_pool, snapshot

PS = 64
GLM52_LIVE = [0, 1, 2] + list(range(6, 75, 4))


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


@pytest.mark.parametrize("order", ["whole pages", "pages reversed", "tokens"])
def test_multi_layer_index_writes_and_reads_land_at_page_offset_bytes(order):
    """set_index_k_scale_layers puts each layer's keys and scales at DESIGN.md's bytes (the hand-made
    reference), whole pages (a block a page) or single tokens alike, touches nothing else, and
    get_index_k_scale_layers gathers them back per layer; a skip layer anywhere fails with the pool
    unchanged."""
    pool = small_pool()
    randomize(pool, 9)
    before = RefPool(pool)
    slots = torch.arange(64 * 2, 64 * 5)
    if order == "pages reversed":
        slots = slots.view(-1, 64).flip(0).reshape(-1)
    elif order == "tokens":
        slots = torch.tensor([64 * 3 + 5, 64 * 3 + 63, 64 * 7, 1])
    n = slots.numel()
    layers = list(SMALL_LIVE)
    g = torch.Generator().manual_seed(2)
    keys = [torch.randint(0, 256, (n, 128), dtype=torch.uint8, generator=g) for _ in layers]
    scales = [torch.rand(n, generator=g) * 10 for _ in layers]
    skip = next(x for x in range(pool.layer_num) if x not in SMALL_LIVE)
    untouched = snapshot(pool)
    with pytest.raises(ValueError):
        pool.set_index_k_scale_layers([layers[0], skip], slots, keys[:2], scales[:2])
    assert_same_bytes(untouched, snapshot(pool))
    pool.set_index_k_scale_layers(layers, slots, keys, scales)
    for x, k, sc in zip(layers, keys, scales):
        for i, loc in enumerate(slots.tolist()):
            before.key(x, loc)[:] = k[i].numpy()
            before.scale(x, loc)[:] = np.frombuffer(sc[i].numpy().tobytes(), dtype=np.uint8)
    assert_same_bytes(before.buffers(), snapshot(pool))
    got = pool.get_index_k_scale_layers(layers[::-1], slots)
    for (k, sc), x in zip(got, layers[::-1]):
        i = layers.index(x)
        assert torch.equal(k, keys[i]) and torch.equal(sc, scales[i])
    with pytest.raises(ValueError):
        pool.get_index_k_scale_layers([skip], slots)


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


@pytest.mark.parametrize("order", ["runs", "scattered"])
def test_multi_layer_writes_and_row_views_match_the_per_layer_calls(order):
    """set_kv_buffer_layers writes what set_kv_buffer writes layer by layer (runs of slots copied a
    run at a time, scattered slots row by row); latent_row_views are the rows get_kv_buffer_rows
    gathers, as views of the pool, one a run (None for scattered slots or too many runs)."""
    a = DSATokenToKVPool(512, 64, 512, 64, 3, "cpu", "fp8")
    b = DSATokenToKVPool(512, 64, 512, 64, 3, "cpu", "fp8")
    slots = torch.cat([torch.arange(128, 192), torch.arange(64, 128), torch.arange(300, 310)])
    if order == "scattered":
        slots = slots[torch.randperm(slots.numel(), generator=torch.Generator().manual_seed(0))]
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 256, (slots.numel(), a.row_bytes), dtype=torch.uint8, generator=g) for _ in range(3)]
    a.set_kv_buffer_layers([0, 1, 2], slots, rows)
    for layer, r in enumerate(rows):
        b.set_kv_buffer(layer, slots, r)
    assert all(torch.equal(x, y) for x, y in zip(a.kv_buffer, b.kv_buffer))
    for layer, r in enumerate(rows):  # and each row is where its slot says, worked out here
        assert torch.equal(a.kv_buffer[layer].reshape(a.kv_buffer[layer].shape[0], -1).view(torch.uint8)[slots], r)
    with pytest.raises(ValueError):
        a.set_kv_buffer_layers([0, 5], slots, rows[:2])  # a bad layer: nothing written
    assert torch.equal(a.kv_buffer[0], b.kv_buffer[0])
    found = a.latent_row_views([1, 2], slots, max_runs=4)
    if order == "scattered":
        assert found is None
    else:
        for layer, views in zip([1, 2], found):
            assert [v.numel() for v in views] == [64 * a.row_bytes, 64 * a.row_bytes, 10 * a.row_bytes]  # page 2, page 1, 10 slots
            assert torch.equal(torch.cat(views), rows[layer].reshape(-1))
            assert views[0].data_ptr() == a.kv_buffer[layer][128].data_ptr()
        assert a.latent_row_views([1], slots, max_runs=2) is None
    with pytest.raises(ValueError):
        a.latent_row_views([1, 7], slots, max_runs=4)
