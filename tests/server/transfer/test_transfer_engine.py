"""Real Mooncake Transfer Engine transfers between two engines on 127.0.0.1 (TCP).

The engine is a required part: when it is missing these tests fail (TransferEngineUnavailable).
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.server.pool import create_pool
from kvtier.server.transfer import (
    LayoutMismatchError, MooncakeTransferEngine, MooncakeTransport, PoolLayout, TransferEngineConfig,
    TransferEngineUnavailable, TransferError, plan_pull, pool_layout, pull_pages, registration_ranges,
)
from kvtier.server.transfer.engine import MAX_ENGINE_BATCH, MAX_REQUEST_BYTES, engine_requests
from transfer_helpers import INDEX_PAGE_BYTES, LATENT_PAGE_BYTES, LIVE_LAYERS, SKIP_LAYERS, filled_pool


@pytest.fixture(scope="module")
def engines():
    """(prefill engine, decode engine), one process, loopback TCP."""
    return MooncakeTransferEngine(), MooncakeTransferEngine()


@pytest.fixture
def published():
    """``published(pool, engine, fingerprint)``: register the pool's buffers and return its layout
    naming the endpoint; every registration is undone after the test (freed memory gets reused)."""
    done = []

    def publish(pool, engine, fingerprint):
        layout = pool_layout(pool, fingerprint)
        ranges = registration_ranges(layout.latent, layout.index)
        engine.register(ranges)
        done.append((engine, ranges, pool))
        return layout.with_engine(engine.endpoint, ranges)

    yield publish
    for engine, ranges, _ in done:
        engine.unregister(ranges)


def page_bytes(pool, component, layer, page):
    if component == "latent":
        return pool.kv_buffer[layer].view(torch.uint8).view(-1)[page * LATENT_PAGE_BYTES:(page + 1) * LATENT_PAGE_BYTES]
    return pool.index_k_with_scale_buffer[layer][page]


def verify_pages_copied(src_pool, dst_pool, src_pages, dst_pages):
    for layer in range(8):
        comps = ("latent", "index_k") if layer in LIVE_LAYERS else ("latent",)
        for comp in comps:
            for s, d in zip(src_pages, dst_pages):
                assert torch.equal(page_bytes(src_pool, comp, layer, s), page_bytes(dst_pool, comp, layer, d)), (layer, comp, s, d)


def verify_untouched(dst_pool, before, pages):
    """Pages not in ``pages`` still hold the bytes of ``before`` (a clone of the arenas)."""
    for layer in range(8):
        for comp in ("latent", "index_k") if layer in LIVE_LAYERS else ("latent",):
            for p in range(1, dst_pool.num_pages):
                if p not in pages:
                    assert torch.equal(page_bytes(dst_pool, comp, layer, p), page_bytes(before, comp, layer, p))


def test_the_engine_is_installed():
    """CI installs mooncake-transfer-engine-non-cuda; without it this (and every transfer test) fails."""
    import mooncake.engine

    assert hasattr(mooncake.engine.TransferEngine, "batch_transfer_sync_read")


def test_missing_engine_raises_a_clear_error(monkeypatch):
    """What a daemon started with --transfer-engine mooncake says on a machine without the package."""
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # makes `from mooncake.engine import ...` fail
    with pytest.raises(TransferEngineUnavailable, match="pip install 'kvtier\\[mooncake\\]'.*libibverbs1 librdmacm1 libnuma1"):
        MooncakeTransferEngine()


def test_registration_ranges_are_the_arenas(model):
    """Per-layer views of one arena register as one range a component; skip layers add nothing."""
    pool = create_pool(model, 64 * 8, device="cpu")
    lat, idx = pool.get_contiguous_buf_infos(), pool.get_state_buf_infos()
    ranges = registration_ranges(lat, idx)
    assert sorted(ranges) == sorted([(pool._lat_arena.data_ptr(), pool._lat_arena.nbytes),
                                     (pool._idx_arena.data_ptr(), pool._idx_arena.nbytes)])
    assert pool._idx_arena.nbytes == len(LIVE_LAYERS) * 9 * INDEX_PAGE_BYTES


def test_register_refuses_overlap_and_empty():
    engine = MooncakeTransferEngine()
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    p = buf.data_ptr()
    engine.register([(p, 4096)])
    with pytest.raises(ValueError, match="overlaps"):
        engine.register([(p + 4000, 4096)])
    with pytest.raises(ValueError, match="empty"):
        engine.register([(p + 8192, 0)])
    assert engine.registered == [(p, 4096)]


def test_pull_is_byte_identical_on_every_layer(model, engines, published):
    prefill, decode = engines
    src_pool = filled_pool(model, seed=1)
    dst_pool = filled_pool(model, seed=2)
    before = filled_pool(model, seed=2)
    remote = published(src_pool, prefill, model.fingerprint())
    local = published(dst_pool, decode, model.fingerprint())
    src_pages, dst_pages = [4, 5, 6, 7, 20, 11], [30, 31, 32, 2, 3, 17]
    plan = plan_pull(local, remote, src_pages, dst_pages, max_batch_items=7)
    stats = pull_pages(MooncakeTransport(decode), remote, plan)
    verify_pages_copied(src_pool, dst_pool, src_pages, dst_pages)
    verify_untouched(dst_pool, before, set(dst_pages))
    assert stats.index_bytes == len(LIVE_LAYERS) * 6 * 8448
    assert stats.latent_bytes == 8 * 6 * 656 * 64
    assert all(s.index_requests == 0 for s in stats.layers if s.layer_id in SKIP_LAYERS)
    # runs: 4..6 -> 30..32, 7 -> 2, 11 -> 17, 20 -> 3  => 4 requests a layer and component
    assert stats.latent_requests == 8 * 4 and stats.index_requests == len(LIVE_LAYERS) * 4
    assert stats.batches == -(-(12 * 4) // 7)


class _Item:
    def __init__(self, dst: int, src: int, n: int) -> None:
        self.dst_addr, self.src_addr, self.nbytes = dst, src, n


def test_ranges_longer_than_the_request_size_are_cut_into_even_pieces():
    """A 2.7 MB range (one GLM-5.2 layer's 64 latent pages) with 1 MiB requests: 3 pieces of
    895,680 bytes (ceil(2,686,976 / 3) = 895,659, rounded up to 64) and the rest, 895,616, back to
    back on both sides; a 0.5 MB indexer range and a range of exactly 1 MiB stay whole."""
    lat, idx = 64 * 656 * 64, 64 * 8448
    items = [_Item(1_000_000, 50_000_000, lat), _Item(9_000_000, 70_000_000, idx), _Item(20_000_000, 90_000_000, 1 << 20)]
    dsts, srcs, lens = engine_requests(items, 1 << 20)
    assert lens == [895_680, 895_680, 895_616, idx, 1 << 20]
    assert dsts == [1_000_000, 1_895_680, 2_791_360, 9_000_000, 20_000_000]
    assert srcs == [50_000_000, 50_895_680, 51_791_360, 70_000_000, 90_000_000]
    assert sum(lens[:3]) == lat and all(n <= 1 << 20 for n in lens)
    assert engine_requests(items, 0) == ([1_000_000, 9_000_000, 20_000_000], [50_000_000, 70_000_000, 90_000_000],
                                         [lat, idx, 1 << 20])
    assert MAX_REQUEST_BYTES == 16 << 20 and TransferEngineConfig().max_request_bytes == MAX_REQUEST_BYTES


@st.composite
def _ranges_and_cap(draw):
    """A cap of 1 byte to 32 MiB and 1-8 ranges of 1 byte to 300 caps (at most 64 MiB)."""
    cap = draw(st.integers(1, 1 << 25))
    n = st.integers(1, min(300 * cap, 1 << 26))
    return draw(st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 40), n), min_size=1, max_size=8)), cap


@settings(max_examples=400, deadline=None)
@given(_ranges_and_cap())
def test_the_cut_covers_each_range_back_to_back_in_pieces_within_the_cap(case):
    """Any ranges and any cap (not only multiples of 64): each range's pieces start where it starts
    on both sides, follow each other without gap or overlap, end where it ends, are none empty and
    none longer than the cap, and number at most ceil(nbytes / cap)."""
    ranges, cap = case
    dsts, srcs, lens = engine_requests([_Item(d, s, n) for d, s, n in ranges], cap)
    i = 0
    for d, s, n in ranges:
        pos, count = 0, 0
        while pos < n:
            assert (dsts[i], srcs[i]) == (d + pos, s + pos)
            assert 0 < lens[i] <= cap
            pos += lens[i]
            i += 1
            count += 1
        assert pos == n and count <= -(-n // cap)
    assert i == len(lens) == len(dsts) == len(srcs)


def test_a_cap_that_is_no_multiple_of_64_is_never_overshot():
    """A 100-byte cap on 200 bytes: two pieces of 100 (rounding ceil(200 / 2) up to 64 would make
    128, over the cap); an 11-byte range with a 10-byte cap: 6 and 5; with a 16 MiB + 1 cap, 32 MiB
    + 2 bytes: two pieces of 16 MiB + 1."""
    assert engine_requests([_Item(0, 1000, 200)], 100) == ([0, 100], [1000, 1100], [100, 100])
    assert engine_requests([_Item(0, 0, 11)], 10)[2] == [6, 5]
    assert engine_requests([_Item(0, 0, (32 << 20) + 2)], (16 << 20) + 1)[2] == [(16 << 20) + 1] * 2


def test_a_pull_cut_into_more_requests_than_one_engine_call_takes_is_byte_identical(model, engines, published):
    """2 KiB requests: the plan's runs of 3, 1, 1 and 1 pages become, a layer, 62 + 3 x 21 latent
    requests (125,952 and 41,984 bytes in pieces of 2,048) and 13 + 3 x 5 indexer ones (25,344 and
    8,448 bytes in pieces of 1,984 and 1,728): 1,112 requests in the plan's one batch, sent as two
    engine calls (at most MAX_ENGINE_BATCH each); every page arrives whole and nothing else on the
    destination changes."""
    prefill, _ = engines
    small = MooncakeTransferEngine(TransferEngineConfig(max_request_bytes=2048))
    src_pool = filled_pool(model, seed=11)
    dst_pool = filled_pool(model, seed=12)
    before = filled_pool(model, seed=12)
    remote = published(src_pool, prefill, model.fingerprint())
    local = published(dst_pool, small, model.fingerprint())
    src_pages, dst_pages = [4, 5, 6, 7, 20, 11], [30, 31, 32, 2, 3, 17]
    plan = plan_pull(local, remote, src_pages, dst_pages, max_batch_items=1024)
    assert len(plan.batches) == 1
    n_requests = len(engine_requests(plan.batches[0], 2048)[2])
    assert n_requests == 8 * (62 + 3 * 21) + len(LIVE_LAYERS) * (13 + 3 * 5) == 1112 > MAX_ENGINE_BATCH
    pull_pages(MooncakeTransport(small), remote, plan)
    verify_pages_copied(src_pool, dst_pool, src_pages, dst_pages)
    verify_untouched(dst_pool, before, set(dst_pages))


def test_sglang_shaped_peer_interoperates_by_page_ids(model, engines, published):
    """A peer whose buffers are separate per-layer tensors with SGLang's shapes (no arena, no
    fingerprint): the plan comes from its buffer infos alone."""
    prefill, decode = engines
    size, ps = 64 * 32, 64
    g = torch.Generator().manual_seed(5)
    kv = [torch.randint(0, 256, (size + ps, 1, 656), dtype=torch.uint8, generator=g) for _ in range(8)]
    num_pages = (size + ps + 1) // ps
    idx = [torch.empty((0, 8448), dtype=torch.uint8) if l in SKIP_LAYERS
           else torch.randint(0, 256, (num_pages, 8448), dtype=torch.uint8, generator=g) for l in range(8)]
    lat_infos = ([t.data_ptr() for t in kv], [t.nbytes for t in kv], [656 * ps] * 8)
    idx_infos = ([0 if l in SKIP_LAYERS else t.data_ptr() for l, t in enumerate(idx)],
                 [t.nbytes for t in idx], [0 if l in SKIP_LAYERS else 8448 for l in range(8)])
    ranges = registration_ranges(lat_infos, idx_infos)
    prefill.register(ranges)
    try:
        peer = PoolLayout(ps, 656, 8448, [l in SKIP_LAYERS for l in range(8)], lat_infos, idx_infos,
                          endpoint=prefill.endpoint, registered=ranges)
        dst_pool = create_pool(model, size, device="cpu")
        local = published(dst_pool, decode, model.fingerprint())
        stats = pull_pages(MooncakeTransport(decode), peer, plan_pull(local, peer, [8, 9, 1], [1, 2, 3]))
        for layer in range(8):
            for s, d in zip([8, 9, 1], [1, 2, 3]):
                assert torch.equal(kv[layer].view(-1)[s * 656 * ps:(s + 1) * 656 * ps], page_bytes(dst_pool, "latent", layer, d))
                if layer in LIVE_LAYERS:
                    assert torch.equal(idx[layer][s], dst_pool.index_k_with_scale_buffer[layer][d])
        assert stats.index_bytes == len(LIVE_LAYERS) * 3 * 8448
    finally:
        prefill.unregister(ranges)


def test_mismatched_layout_is_refused_before_any_byte_moves(model, engines, published):
    prefill, decode = engines
    src_pool = filled_pool(model, role="draft", seed=3)
    dst_pool = create_pool(model, 64 * 32, device="cpu")
    remote = published(src_pool, prefill, model.fingerprint())
    local = published(dst_pool, decode, model.fingerprint())
    with pytest.raises(LayoutMismatchError, match="skip masks differ"):
        plan_pull(local, remote, [1, 2], [1, 2])
    assert int(dst_pool._lat_arena.count_nonzero()) == 0 and int(dst_pool._idx_arena.count_nonzero()) == 0


def test_injected_failure_stops_the_transfer(model, engines, published):
    """fail_batch=2: the first batch moves, the second raises; later batches never start."""
    prefill, _ = engines
    failing = MooncakeTransferEngine(TransferEngineConfig(fail_batch=2))
    src_pool = filled_pool(model, seed=4)
    dst_pool = create_pool(model, 64 * 32, device="cpu")
    remote = published(src_pool, prefill, model.fingerprint())
    local = published(dst_pool, failing, model.fingerprint())
    plan = plan_pull(local, remote, [1, 3, 5], [1, 3, 5], max_batch_items=4)
    with pytest.raises(TransferError, match="injected failure in batch 2") as err:
        pull_pages(MooncakeTransport(failing), remote, plan)
    assert err.value.batch == 1
    first = plan.batches[0]
    assert torch.equal(page_bytes(dst_pool, "latent", 0, 1), page_bytes(src_pool, "latent", 0, 1))  # batch 1 ran
    last = plan.batches[-1][-1]
    assert not torch.equal(page_bytes(dst_pool, last.component, last.layer_id, 5), page_bytes(src_pool, last.component, last.layer_id, 5))
    assert len(first) == 4


def test_engine_return_code_becomes_transfer_error(model, engines, published):
    """A read from an endpoint nobody listens on returns non-zero: a TransferError naming the batch."""
    _, decode = engines
    dst_pool = create_pool(model, 64 * 8, device="cpu")
    local = published(dst_pool, decode, model.fingerprint())
    ghost = local.with_engine("127.0.0.1:1", ())
    plan = plan_pull(local, ghost, [1], [1])
    with pytest.raises(TransferError, match="return code -1 in batch 1 of 1") as err:
        pull_pages(MooncakeTransport(decode), ghost, plan)
    assert err.value.return_code == -1
