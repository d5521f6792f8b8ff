"""Bad input: a clear ValueError/TypeError naming the problem, and the pool byte-identical."""

from __future__ import annotations

import pytest
import torch

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import DSATokenToKVPool, create_pool
from pool_reference import assert_same_bytes, randomize, small_pool, snapshot

PS = 64


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
