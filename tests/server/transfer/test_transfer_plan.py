"""Transfer planning from buffer infos: figures worked out by hand for an 8-layer GLM-5.2 pool."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import create_pool
from kvtier.server.transfer import (
    LayoutMismatchError, PageMappingError, check_compatible, layout_mismatch, page_runs, pages_from_slots,
    plan_pull, plan_transfer, pool_layout,
)

from transfer_helpers import INDEX_PAGE_BYTES, LATENT_PAGE_BYTES, LIVE_LAYERS, SKIP_LAYERS


def test_glm_8_layer_skip_pattern(model):
    assert model.live_indexer_layers == LIVE_LAYERS
    assert model.skipped_layers == SKIP_LAYERS


def test_plan_coalesces_runs_and_skips_skip_layers(model):
    """Pages 3,4,5 -> 10,11,12 form one run, 9 -> 2 another: two requests a layer and component."""
    src_pool, dst_pool = create_pool(model, 64 * 16, device="cpu"), create_pool(model, 64 * 16, device="cpu")
    plan = plan_pull(pool_layout(dst_pool, model.fingerprint()), pool_layout(src_pool, model.fingerprint()),
                     [5, 3, 9, 4], [12, 10, 2, 11])
    stats = plan.stats()
    assert stats.num_pages == 4
    assert stats.latent_bytes == 8 * 4 * 41984 == 8 * 4 * LATENT_PAGE_BYTES
    assert stats.index_bytes == 4 * 4 * 8448  # live layers x pages x 8448
    assert stats.latent_requests == 8 * 2 and stats.index_requests == 4 * 2
    for s in stats.layers:
        assert s.latent_bytes == 4 * LATENT_PAGE_BYTES and s.latent_requests == 2
        if s.layer_id in SKIP_LAYERS:
            assert (s.index_bytes, s.index_requests) == (0, 0)
        else:
            assert (s.index_bytes, s.index_requests) == (4 * INDEX_PAGE_BYTES, 2)
    assert {it.layer_id for it in plan.items if it.component == "index_k"} == set(LIVE_LAYERS)
    # addresses are ptr + page * item_len on each side
    sp, dp = src_pool.get_state_buf_infos()[0][6], dst_pool.get_state_buf_infos()[0][6]
    idx6 = [it for it in plan.items if it.component == "index_k" and it.layer_id == 6]
    assert [(it.src_addr, it.dst_addr, it.nbytes) for it in idx6] == [
        (sp + 3 * 8448, dp + 10 * 8448, 3 * 8448), (sp + 9 * 8448, dp + 2 * 8448, 8448)]
    lp, ldp = src_pool.kv_buffer[7].data_ptr(), dst_pool.kv_buffer[7].data_ptr()
    lat7 = [it for it in plan.items if it.component == "latent" and it.layer_id == 7]
    assert [(it.src_addr, it.dst_addr, it.nbytes) for it in lat7] == [
        (lp + 3 * 41984, ldp + 10 * 41984, 3 * 41984), (lp + 9 * 41984, ldp + 2 * 41984, 41984)]
    assert all(it.nbytes > 0 for it in plan.items)


def test_batches_stay_under_the_limit(model):
    src_pool, dst_pool = create_pool(model, 64 * 64, device="cpu"), create_pool(model, 64 * 64, device="cpu")
    src_pages = list(range(1, 64, 2))  # 32 pages, none adjacent: 32 requests per layer and component
    plan = plan_pull(pool_layout(dst_pool), pool_layout(src_pool), src_pages, list(range(1, 33)), max_batch_items=50)
    assert len(plan.items) == 32 * (8 + 4)
    assert [len(b) for b in plan.batches] == [50] * 7 + [34]
    with pytest.raises(ValueError, match="max_batch_items"):
        plan_pull(pool_layout(dst_pool), pool_layout(src_pool), [1], [1], max_batch_items=2000)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=30, unique=True), st.randoms())
def test_page_runs_cover_the_mapping_exactly(src, rnd):
    dst = list(range(1, 41))
    rnd.shuffle(dst)
    dst = dst[: len(src)]
    runs = page_runs(np.array(src), np.array(dst))
    pairs = sorted((s + k, d + k) for s, d, n in runs for k in range(n))
    assert pairs == sorted(zip(src, dst))
    for (s0, d0, n0), (s1, d1, _) in zip(runs, runs[1:]):
        assert not (s0 + n0 == s1 and d0 + n0 == d1), "adjacent runs must have been merged"


def test_bad_page_mappings_are_refused(model):
    src, dst = pool_layout(create_pool(model, 64 * 8, device="cpu")), pool_layout(create_pool(model, 64 * 8, device="cpu"))
    for s, d, msg in (([1, 2], [1], "has 2 pages"), ([0], [1], "padding"), ([1], [0], "padding"),
                      ([1, 2], [3, 3], "twice"), ([9], [1], "beyond"), ([1], [9], "beyond"), ([], [], "empty")):
        with pytest.raises(PageMappingError, match=msg):
            plan_pull(dst, src, s, d)


def test_slots_to_pages():
    src = list(range(3 * 64, 5 * 64)) + list(range(7 * 64, 7 * 64 + 10))
    dst = list(range(9 * 64, 11 * 64)) + list(range(2 * 64, 2 * 64 + 10))
    s, d = pages_from_slots(src, dst, 64)
    assert s.tolist() == [3, 4, 7] and d.tolist() == [9, 10, 2]
    with pytest.raises(PageMappingError, match="not page-aligned: token 0 is slot 195"):
        pages_from_slots(list(range(195, 200)), list(range(64, 69)), 64)
    with pytest.raises(PageMappingError, match="dst_slots is not page-aligned: token 64"):
        pages_from_slots(list(range(64, 192)), list(range(64, 128)) + list(range(200, 264)), 64)


def test_target_vs_draft_pool_is_refused_with_the_layers(model):
    """A draft pool keeps an indexer buffer on every layer; a target pool of the same model does not."""
    target = pool_layout(create_pool(model, 64 * 8, role="target", device="cpu"), model.fingerprint())
    draft = pool_layout(create_pool(model, 64 * 8, role="draft", device="cpu"), model.fingerprint())
    reason = layout_mismatch(target, draft)
    assert reason == "skip masks differ: layers [3, 4, 5, 7] (4) own an indexer buffer on the peer but skip top-k here"
    with pytest.raises(LayoutMismatchError, match="skip masks differ"):
        plan_pull(target, draft, [1], [1])


def test_page_size_and_fingerprint_mismatches(model):
    other = DSAModelConfig.from_preset("glm-5.2", num_layers=8, page_size=32)
    a = pool_layout(create_pool(model, 64 * 8, device="cpu"), model.fingerprint())
    b = pool_layout(create_pool(other, 64 * 8, device="cpu"), other.fingerprint())
    assert layout_mismatch(a, b) == "page sizes differ: 64 tokens here, 32 on the peer"
    ds = DSAModelConfig.from_preset("deepseek-v3.2", num_layers=8)
    c = pool_layout(create_pool(ds, 64 * 8, role="draft", device="cpu"), ds.fingerprint())
    d = pool_layout(create_pool(model, 64 * 8, role="draft", device="cpu"), model.fingerprint())
    assert layout_mismatch(d, c).startswith("model fingerprints differ: name 'glm-5.2' here vs 'deepseek-v3.2' on the peer")
    bf16 = DSAModelConfig.from_preset("glm-5.2", num_layers=8, kv_cache_dtype="bf16")
    e = pool_layout(create_pool(bf16, 64 * 8, device="cpu"), bf16.fingerprint())
    assert layout_mismatch(a, e) == "latent row bytes differ: 656 here, 1152 on the peer"
    check_compatible(a, pool_layout(create_pool(model, 64 * 4, device="cpu"), model.fingerprint()))  # sizes may differ


def test_item_len_zero_on_one_side_only_is_refused(model):
    """Planning from raw infos alone still refuses a layer that has an indexer buffer on one side only."""
    t = create_pool(model, 64 * 8, role="target", device="cpu")
    d = create_pool(model, 64 * 8, role="draft", device="cpu")
    with pytest.raises(LayoutMismatchError, match="layer 3 index_k: item_len 8448"):
        plan_transfer({"latent": d.get_contiguous_buf_infos(), "index_k": d.get_state_buf_infos()},
                      {"latent": t.get_contiguous_buf_infos(), "index_k": t.get_state_buf_infos()}, [1], [1])


def test_ranges_outside_registered_memory_are_refused(model):
    src, dst = pool_layout(create_pool(model, 64 * 8, device="cpu")), pool_layout(create_pool(model, 64 * 8, device="cpu"))
    lat0 = src.latent[0][0]
    only_latent = src.with_engine("127.0.0.1:1", [(lat0, 8 * src.latent[1][0])])
    with pytest.raises(LayoutMismatchError, match="layer 0 index_k source pages 1..1 lie outside every registered range"):
        plan_pull(dst, only_latent, [1], [1])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_plan_applied_to_memory_equals_page_by_page_copy(data):
    """Random skip masks, page sizes and mappings: copying the plan's ranges gives exactly what copying
    each mapped page of each layer with a buffer gives (a plain reference), and nothing else."""
    layers = data.draw(st.integers(1, 6))
    mask = [False] + data.draw(st.lists(st.booleans(), min_size=layers - 1, max_size=layers - 1))
    lat_item, idx_item, pages = data.draw(st.sampled_from([8, 24])), 16, data.draw(st.integers(2, 12))
    src_pages = data.draw(st.lists(st.integers(1, pages - 1), min_size=1, max_size=pages - 1, unique=True))
    dst_pages = data.draw(st.permutations(range(1, pages)))[: len(src_pages)]
    batch = data.draw(st.integers(1, 5))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))

    def memory(base):
        """Per-layer latent then indexer buffers laid out one after another from address ``base``."""
        lat, idx, off = ([], [], []), ([], [], []), 0
        for skip in mask:
            for infos, item, has in ((lat, lat_item, True), (idx, idx_item, not skip)):
                n = pages * item if has else 0
                for part, v in zip(infos, (base + off if has else 0, n, item if has else 0)):
                    part.append(v)
                off += n
        return {"latent": lat, "index_k": idx}, rng.integers(0, 256, off, dtype=np.uint8)

    src_base, dst_base = 1 << 20, 1 << 30
    (src, src_mem), (dst, dst_mem) = memory(src_base), memory(dst_base)
    expected = dst_mem.copy()
    for comp in ("latent", "index_k"):
        for layer in range(layers):
            (sp, _, item), (dp, _, _) = (tuple(part[layer] for part in side[comp]) for side in (src, dst))
            for s, d in zip(src_pages, dst_pages):
                if item:
                    so, do = sp - src_base + s * item, dp - dst_base + d * item
                    expected[do:do + item] = src_mem[so:so + item]
    plan = plan_transfer(src, dst, src_pages, dst_pages, max_batch_items=batch)
    got = dst_mem.copy()
    for b in plan.batches:
        assert 1 <= len(b) <= batch
        for it in b:
            assert it.nbytes > 0
            got[it.dst_addr - dst_base:it.dst_addr - dst_base + it.nbytes] = src_mem[it.src_addr - src_base:it.src_addr - src_base + it.nbytes]
    assert np.array_equal(got, expected)
    stats = plan.stats()
    live = sum(not s for s in mask)
    assert stats.index_bytes == live * len(src_pages) * idx_item
    assert stats.latent_bytes == layers * len(src_pages) * lat_item
