"""Capacity planner: SGLang's accounting reproduces its figures; the exact one matches real pools."""

from __future__ import annotations

import pytest

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import create_pool
from kvtier.server.pool_configurator import cell_size_bytes, exact_pool_bytes, max_total_num_tokens, plan_pool

GLM52_LIVE = [0, 1, 2] + list(range(6, 75, 4))
BUDGET = 134_227_000_000


def test_glm52_sglang_accounting_right_values():
    plan = plan_pool(DSAModelConfig.from_preset("glm-5.2"), BUDGET, accounting="sglang")
    assert plan.naive_cell_bytes == 78 * (576 + 132) == 55_224
    assert plan.skip_aware_cell_bytes == 78 * 576 + 21 * 132 == 47_700
    assert plan.naive_tokens == 2_430_528
    assert plan.skip_aware_tokens == 2_813_952
    assert plan.saved_bytes_per_token == 57 * 132 == 7_524
    assert plan.saved_bytes == 18_287_292_672 == 2_430_528 * 7_524
    assert plan.live_indexer_layers == GLM52_LIVE
    assert plan.gain_ratio == pytest.approx(2_813_952 / 2_430_528)
    assert round((plan.gain_ratio - 1) * 100, 1) == 15.8


def exact_reference(budget: int, layers: int, live: int, row: int) -> int:
    """Closed form for page_size 64: a pool of N = 64k tokens holds k + 1 latent pages per layer
    ((N + 64) rows) and (N + 65) // 64 = k + 1 indexer pages per live layer."""
    per_page = layers * 64 * row + live * 8448
    return 64 * (budget // per_page - 1)


@pytest.mark.parametrize("dtype, row", [("fp8", 656), ("bf16", 1152)])
@pytest.mark.parametrize("budget", [BUDGET, 150_000_000, 3_452_160 * 7, 3_452_160 * 7 - 1])
def test_glm52_exact_accounting(dtype, row, budget):
    model = DSAModelConfig.from_preset("glm-5.2", kv_cache_dtype=dtype)
    plan = plan_pool(model, budget, accounting="exact")
    assert plan.skip_aware_tokens == exact_reference(budget, 78, 21, row)
    assert plan.naive_tokens == exact_reference(budget, 78, 78, row)
    assert plan.skip_aware_pool_bytes == exact_pool_bytes(model, plan.skip_aware_tokens) <= budget
    assert plan.naive_pool_bytes <= budget
    assert plan.naive_cell_bytes == 78 * (row + 132) and plan.skip_aware_cell_bytes == 78 * row + 21 * 132


def test_exact_pool_bytes_equals_a_real_small_pool():
    model = DSAModelConfig.from_preset("glm-5.2", num_layers=8)
    for size in (64, 100, 640):
        pool = create_pool(model, size, device="cpu")
        assert exact_pool_bytes(model, size) == pool.get_kv_size_bytes()
        draft = create_pool(model, size, role="draft", device="cpu")
        assert exact_pool_bytes(model, size, role="draft") == exact_pool_bytes(model, size, skip_aware=False) == draft.get_kv_size_bytes()


def test_deepseek_v32_gains_nothing():
    plan = plan_pool(DSAModelConfig.from_preset("deepseek-v3.2"), BUDGET, accounting="sglang")
    assert plan.naive_tokens == plan.skip_aware_tokens == BUDGET // (61 * 708) // 64 * 64
    assert plan.saved_bytes == 0 and plan.gain_ratio == 1.0 and plan.live_indexer_layers == list(range(61))


def test_draft_role_keeps_every_indexer():
    model = DSAModelConfig.from_preset("glm-5.2")
    plan = plan_pool(model, BUDGET, accounting="sglang", role="draft")
    assert plan.naive_tokens == plan.skip_aware_tokens == 2_430_528 and plan.saved_bytes == 0
    assert cell_size_bytes(model, skip_aware=True, accounting="sglang", role="hisparse") == 55_224
    assert cell_size_bytes(model, skip_aware=True, role="hisparse") == 78 * (656 + 132)


def test_bad_arguments():
    model = DSAModelConfig.from_preset("glm-5.2")
    with pytest.raises(ValueError, match="accounting"):
        plan_pool(model, BUDGET, accounting="vllm")
    with pytest.raises(ValueError, match="available_bytes"):
        max_total_num_tokens(model, -1, skip_aware=True)
    with pytest.raises(ValueError, match="role"):
        plan_pool(model, BUDGET, role="decode")
    assert max_total_num_tokens(model, 1000, skip_aware=True) == 0


def test_glm52_sglang_accounting_bf16():
    plan = plan_pool(DSAModelConfig.from_preset("glm-5.2", kv_cache_dtype="bf16"), BUDGET, accounting="sglang")
    assert plan.naive_cell_bytes == 78 * (1152 + 132) == 100_152
    assert plan.skip_aware_cell_bytes == 78 * 1152 + 21 * 132 == 92_628
    assert plan.naive_tokens == BUDGET // 100_152 // 64 * 64 == 1_340_224
    assert plan.skip_aware_tokens == BUDGET // 92_628 // 64 * 64 == 1_449_088
