"""Pipeline-parallel stages: a pool, plan, record and transfer layout for model layers [start, end).

Expected values are worked out here from DESIGN.md's rules (GLM-5.2: index_topk_freq=4,
index_skip_topk_offset=3, so layer l skips iff max(l - 2, 0) % 4 != 0) and from SGLang's layer split
(``get_pp_indices``: even, the last ``layers % stages`` stages one layer more).
"""

from __future__ import annotations

import pytest
import torch

from kvtier.server.model_config import DSAModelConfig, layer_range, pp_layer_range
from kvtier.server.pool import create_pool
from kvtier.server.pool_configurator import plan_pool
from kvtier.server.tiers import RecordCodec, RecordError

PS = 64


def glm_skips(layer: int) -> bool:
    return max(layer - 2, 0) % 4 != 0


def test_glm_stage_20_39_has_the_models_mask_for_those_layers_and_its_first_layer_skips():
    stage = DSAModelConfig.from_preset("glm-5.2", start_layer=20, end_layer=40)
    assert (stage.start_layer, stage.end_layer, stage.num_layers) == (20, 40, 20)
    assert stage.layer_ids == tuple(range(20, 40))
    assert stage.skip_topk_layers == tuple(glm_skips(layer) for layer in range(20, 40))
    assert stage.skip_topk_layers[0] is True  # layer 20 reuses layer 18's top-k from the previous stage
    assert [20 + i for i in stage.live_indexer_layers] == [22, 26, 30, 34, 38]
    whole = DSAModelConfig.from_preset("glm-5.2")
    assert stage.skip_topk_layers == whole.skip_topk_layers[20:40]
    assert stage.fingerprint()["start_layer"] == 20 and whole.fingerprint()["start_layer"] == 0
    assert stage.fingerprint_digest() != DSAModelConfig.from_preset("glm-5.2", start_layer=21, end_layer=41).fingerprint_digest()


def test_only_the_models_own_layer_0_may_not_skip():
    with pytest.raises(ValueError, match="layer 0"):
        DSAModelConfig("m", 2, skip_topk_layers=(True, False))
    assert DSAModelConfig("m", 2, skip_topk_layers=(True, False), start_layer=5).skip_topk_layers == (True, False)


@pytest.mark.parametrize("kwargs, expected", [
    ({}, (0, 78)), ({"num_layers": 4}, (0, 4)), ({"start_layer": 20, "end_layer": 40}, (20, 40)),
    ({"start_layer": 70}, (70, 78)), ({"start_layer": 10, "num_layers": 5}, (10, 15)),
])
def test_layer_range(kwargs, expected):
    assert layer_range(78, **kwargs) == expected


@pytest.mark.parametrize("kwargs, message", [
    ({"start_layer": 40, "end_layer": 40}, "empty"), ({"end_layer": 79}, "runs past the model's 78 layers"),
    ({"num_layers": 79}, "num_layers 79 exceeds the model's 78 layers"), ({"start_layer": -1}, "non-negative"), ({"num_layers": 2, "end_layer": 4}, "not both"),
    ({"num_layers": 0}, "positive"),
])
def test_bad_layer_ranges_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        layer_range(78, **kwargs)
    with pytest.raises(ValueError, match=message):
        DSAModelConfig.from_preset("glm-5.2", **kwargs)


def test_pp_split_matches_sglangs_even_split_with_extra_layers_at_the_end():
    assert [pp_layer_range(78, r, 4) for r in range(4)] == [(0, 19), (19, 38), (38, 58), (58, 78)]
    assert [pp_layer_range(61, r, 4) for r in range(4)] == [(0, 15), (15, 30), (30, 45), (45, 61)]
    assert [pp_layer_range(78, r, 3) for r in range(3)] == [(0, 26), (26, 52), (52, 78)]
    assert pp_layer_range(78, 0, 1) == (0, 78)
    assert [pp_layer_range(78, r, 3, (30, 30, 18)) for r in range(3)] == [(0, 30), (30, 60), (60, 78)]
    for bad in ((1, 2), (40, 40), (0, 78)):
        with pytest.raises(ValueError):
            pp_layer_range(78, 0, 2, bad)
    with pytest.raises(ValueError):
        pp_layer_range(2, 0, 3)
    with pytest.raises(ValueError):
        pp_layer_range(78, 4, 4)


def test_stage_pool_shapes_and_model_layer_ids():
    stage = DSAModelConfig.from_preset("glm-5.2", start_layer=20, end_layer=40)
    pool = create_pool(stage, 1024, device="cpu")
    num_pages = (1024 + PS + 1) // PS
    assert (pool.start_layer, pool.end_layer, pool.layer_num) == (20, 40, 20)
    assert len(pool.kv_buffer) == 20 and all(tuple(b.shape) == (1024 + PS, 1, 656) for b in pool.kv_buffer)
    for i, buf in enumerate(pool.index_k_with_scale_buffer):
        assert tuple(buf.shape) == ((0, 8448) if glm_skips(20 + i) else (num_pages, 8448))
    assert pool.get_kv_size_bytes() == 20 * (1024 + PS) * 656 + 5 * num_pages * 8448
    ptrs, lens, items = pool.get_state_buf_infos()
    assert [n > 0 for n in lens] == [not glm_skips(20 + i) for i in range(20)]
    slots = torch.arange(64, 128)
    rows = torch.randint(0, 256, (64, 656), dtype=torch.uint8)
    pool.set_kv_buffer(23, slots, rows)  # model layer 23 is position 3
    assert torch.equal(pool.kv_buffer[3][64:128, 0].view(torch.uint8), rows)
    assert torch.equal(pool.get_kv_buffer_rows(23, slots).view(torch.uint8).reshape(64, 656), rows)
    keys = torch.randint(0, 256, (64, 128), dtype=torch.uint8)
    scales = torch.rand(64)
    pool.set_index_k_scale_buffer(22, slots, keys, scales)  # live layer 22: buffer position 2
    page_row = pool.index_k_with_scale_buffer[2][1]
    assert torch.equal(page_row[:64 * 128].view(64, 128), keys)
    assert torch.equal(page_row[64 * 128:].view(torch.float32), scales)
    for bad in (19, 40, 0):
        with pytest.raises(ValueError, match=r"out of range \[20, 40\)"):
            pool.set_kv_buffer(bad, slots, rows)
    with pytest.raises(ValueError, match="skips top-k"):
        pool.set_index_k_scale_buffer(20, slots, keys, scales)


def test_records_of_two_stages_never_mix():
    a = DSAModelConfig.from_preset("glm-5.2", start_layer=0, end_layer=4)
    b = DSAModelConfig.from_preset("glm-5.2", start_layer=4, end_layer=8)
    pool = create_pool(a, 256, device="cpu")
    rec = RecordCodec(a).encode_page(pool, 1)
    RecordCodec(a).check(rec)
    with pytest.raises(RecordError, match="fingerprint"):
        RecordCodec(b).check(rec)


def test_stage_plan_counts_only_the_stages_layers():
    stage = DSAModelConfig.from_preset("glm-5.2", start_layer=19, end_layer=38)
    p = plan_pool(stage, 134_227_000_000, accounting="sglang")
    live = sum(1 for layer in range(19, 38) if not glm_skips(layer))
    assert live == 4
    assert p.naive_cell_bytes == 19 * (576 + 132)
    assert p.skip_aware_cell_bytes == 19 * 576 + live * 132
    assert p.skip_aware_tokens == 134_227_000_000 // (19 * 576 + live * 132) // 64 * 64


def test_pd_peers_of_other_stages_are_refused_naming_the_layer_ranges():
    from kvtier.server.transfer import layout_mismatch, pool_layout

    def layout(start: int):
        m = DSAModelConfig.from_preset("glm-5.2", start_layer=start, end_layer=start + 8)
        return pool_layout(create_pool(m, 256, device="cpu"), m.fingerprint())

    assert layout_mismatch(layout(20), layout(20)) is None
    assert layout_mismatch(layout(20), layout(24)) == "layer ranges differ: model layers 20-27 here, 24-31 on the peer"
