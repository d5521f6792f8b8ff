"""The copy engine's pieces: host layout of parts, back-to-back detection (one DMA), row scatters;
the CUDA staging path itself is ``cuda``-marked (it never runs on a CPU machine)."""

from __future__ import annotations

import pytest
import torch

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import create_pool, slots_of_pages
from kvtier.server.pool import device_copy
from kvtier.server.pool.device_copy import (CopyEngine, contiguous_span, copy_pairs, gather_jobs, host_views, part_nbytes,
                                            scatter_jobs, scatter_layers, scatter_rows)
from pool_reference import RefPool, assert_same_bytes, randomize, snapshot


def test_contiguous_span_covers_back_to_back_views_of_one_storage_only():
    flat = torch.arange(100, dtype=torch.uint8)
    a, b = flat[10:30].view(4, 5), flat[30:60]
    span = contiguous_span([a, b])
    assert span is not None and span.data_ptr() == a.data_ptr() and span.numel() == 50
    assert torch.equal(span, flat[10:60])
    assert contiguous_span([a, flat[31:60]]) is None  # a gap
    assert contiguous_span([b, a]) is None  # out of order
    assert contiguous_span([a, torch.arange(30, 60, dtype=torch.uint8)]) is None  # another storage
    assert contiguous_span([]) is None


def test_a_get_cpu_copy_result_is_one_span_in_copy_order():
    """What lets CUDA upload a copy in one DMA: its chunks (latent layers, then live indexer pages)."""
    pool = create_pool(DSAModelConfig.from_preset("glm-5.2", num_layers=8), 1024, device="cpu")
    copy = pool.get_cpu_copy(slots_of_pages(torch.tensor([3, 9]), 64))
    chunks = [c for layer in copy["kv"] for c in layer] + [c for layer in copy["index_k"] for c in layer]
    span = contiguous_span([c.reshape(-1).view(torch.uint8) for c in chunks])
    assert span is not None and span.numel() == pool.cpu_copy_nbytes(slots_of_pages(torch.tensor([3, 9]), 64))


def test_host_views_lay_parts_out_one_after_another():
    src = torch.zeros(3, 10, 4, dtype=torch.int64)
    idx = torch.tensor([1, 5])
    flat = torch.zeros(2 * part_nbytes(src, idx), dtype=torch.uint8)
    v1, v2 = host_views(flat, [(src, idx), (src, idx)])
    assert v1.shape == (3, 2, 4) and v1.data_ptr() == flat.data_ptr()
    assert v2.data_ptr() == flat.data_ptr() + 3 * 2 * 4 * 8


def test_scatter_rows_writes_rows_at_distinct_targets():
    dst = torch.zeros(6, 3, dtype=torch.int64)
    scatter_rows(dst, torch.tensor([4, 0]), torch.tensor([[1, 2, 3], [7, 8, 9]]))
    assert dst.tolist() == [[7, 8, 9], [0, 0, 0], [0, 0, 0], [0, 0, 0], [1, 2, 3], [0, 0, 0]]


@pytest.mark.parametrize("layers", [3, 40])
def test_scatter_layers_puts_each_row_at_its_slot_on_every_layer(layers):
    """Scattered slots on several layers (3 small layers: the caller alone; 40 of ~1.6 MB: two
    threads): row i of each layer's source lands at slot index[i] of that layer, worked out row by
    row here; every other row keeps its bytes."""
    g = torch.Generator().manual_seed(layers)
    n_slots, n, words = 4096, 2000, 82
    index = torch.randperm(n_slots, generator=g)[:n]
    dsts = [torch.randint(0, 1 << 40, (n_slots, words), dtype=torch.int64, generator=g) for _ in range(layers)]
    before = [d.clone() for d in dsts]
    srcs = [torch.randint(0, 1 << 40, (n, words), dtype=torch.int64, generator=g) for _ in range(layers)]
    scatter_layers(list(zip(dsts, srcs)), index)
    target = dict(zip(index.tolist(), range(n)))
    for d, b, s in zip(dsts, before, srcs):
        for slot in range(0, n_slots, 7):
            want = s[target[slot]] if slot in target else b[slot]
            assert torch.equal(d[slot], want)


def test_cpu_engine_uploads_nothing():
    t = [torch.ones(3)]
    assert CopyEngine(torch.device("cpu")).to_device(t)[0] is t[0]


# ----- CUDA (never run on a CPU machine) ------------------------------------------------------------
cuda = pytest.mark.cuda


@cuda
@pytest.mark.parametrize("whole_pages", [True, False])
def test_cuda_copy_goes_through_the_pinned_arena_and_back_byte_exact(whole_pages):
    model = DSAModelConfig.from_preset("glm-5.2", num_layers=8)
    pool = create_pool(model, 1024, device="cuda")
    randomize(pool, 3)
    if whole_pages:
        a, b = slots_of_pages(torch.tensor([3, 9]), 64), slots_of_pages(torch.tensor([1, 12]), 64)
    else:
        a, b = torch.arange(70, 170), torch.arange(600, 700).flip(0)
    expected = RefPool(pool)
    copy = pool.get_cpu_copy(a)
    assert pool.host_arena.pinned and all(c.is_pinned() for layer in copy["kv"] for c in layer)
    assert all(pool.host_arena.owns(c) for layer in copy["index_k"] for c in layer)
    expected.move(b.tolist(), a.tolist())
    pool.load_cpu_copy(copy, b.cuda())
    assert_same_bytes(expected.buffers(), snapshot(pool))


@cuda
def test_cuda_load_of_a_copy_made_of_separate_tensors_uploads_each():
    """An SGLang-made copy (a tensor per layer, not back to back): one DMA per tensor, same bytes."""
    model = DSAModelConfig.from_preset("glm-5.2", num_layers=8)
    pool = create_pool(model, 1024, device="cuda")
    randomize(pool, 4)
    a, b = slots_of_pages(torch.tensor([2]), 64), slots_of_pages(torch.tensor([7]), 64)
    copy = pool.get_cpu_copy(a)
    split = {"kv": [[c.clone() for c in layer] for layer in copy["kv"]],
             "index_k": [[c.clone() for c in layer] for layer in copy["index_k"]], "src_loc": copy["src_loc"]}
    expected = RefPool(pool)
    expected.move(b.tolist(), a.tolist())
    pool.load_cpu_copy(split, b)
    assert_same_bytes(expected.buffers(), snapshot(pool))


@pytest.fixture
def two_copy_threads():
    """Copies split over 2 threads (the caller's and one helper's) whatever the machine's cores, restored after."""
    before = device_copy.copy_threads()
    device_copy.set_copy_threads(2)
    yield
    device_copy.set_copy_threads(before)


def _pairs(sizes: list[int], seed: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor], torch.Tensor]:
    """Random sources and back-to-back slices of one zeroed buffer (4 KiB of slack at its end)."""
    g = torch.Generator().manual_seed(seed)
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    buf = torch.zeros(sum(sizes) + 4096, dtype=torch.uint8)
    pairs, at = [], 0
    for src in srcs:
        pairs.append((buf[at:at + src.numel()], src))
        at += src.numel()
    return pairs, srcs, buf


@pytest.mark.parametrize("sizes", [[3 << 20] * 6, [100, 5000, 1], [9 << 20], [1 << 20, 15 << 20]])
def test_copy_pairs_copies_every_pair(two_copy_threads, sizes):
    """Large copies (cut in two halves, one on the helper thread), small ones (the caller alone), one
    pair, and uneven pairs: every destination holds its source's bytes, nothing else is written."""
    pairs, srcs, buf = _pairs(sizes, seed=len(sizes))
    copy_pairs(pairs)
    assert torch.equal(buf[:sum(sizes)], torch.cat(srcs))
    assert buf[sum(sizes):].eq(0).all()


def test_copy_pairs_does_not_wait_for_a_busy_helper(two_copy_threads):
    """With the helper taken (another call's half), a large copy runs on the caller alone and finishes."""
    pairs, srcs, buf = _pairs([4 << 20] * 4, seed=7)
    assert device_copy._idle.acquire(timeout=60)
    try:
        copy_pairs(pairs)
    finally:
        device_copy._idle.release()
    assert torch.equal(buf[:16 << 20], torch.cat(srcs))


def test_copy_pairs_waits_for_the_helper_when_the_callers_half_fails(two_copy_threads):
    """The caller's half raises (a pair of unequal sizes): copy_pairs raises it only once the helper's
    half is done, or cancelled before it began (the caller's half can fail before the helper thread
    picks its half up, on a loaded machine), so no copy is still writing after the caller (which may
    hold the pool's lock) goes on: the helper's destination is whole or untouched when the call
    returns, and stays so once the helper thread has run everything queued before."""
    g = torch.Generator().manual_seed(5)
    bad_dst, bad_src = torch.zeros(8 << 20, dtype=torch.uint8), torch.zeros(7 << 20, dtype=torch.uint8)
    dst, src = torch.zeros(16 << 20, dtype=torch.uint8), torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, generator=g)
    with pytest.raises(RuntimeError):
        copy_pairs([(bad_dst, bad_src), (dst, src)])
    at_return = dst.clone()
    assert torch.equal(at_return, src) or not bool(at_return.any())
    device_copy._helper_pool().submit(lambda: None).result(60)  # the helper thread is past anything queued before
    assert torch.equal(dst, at_return)
    assert device_copy._idle.acquire(timeout=60)  # the helper gave its slot back
    device_copy._idle.release()


@pytest.fixture
def threads_and_no_minimum(monkeypatch):
    """Set the copy threads (restored after) and split copies of any size, so small tests take the
    threaded path a 221 MB request takes."""
    before = device_copy.copy_threads()
    monkeypatch.setattr(device_copy, "PARALLEL_MIN_BYTES", 0)
    yield device_copy.set_copy_threads
    device_copy.set_copy_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_gather_and_scatter_jobs_equal_torch_on_any_thread_count(threads_and_no_minimum, threads):
    """Seven layers' gathers and scatters (scattered rows, rows in runs, one empty index) split over
    1-5 threads: every destination equals torch's index_select / index_copy_ of the same rows, and
    rows not named keep their bytes."""
    threads_and_no_minimum(threads)
    g = torch.Generator().manual_seed(threads)
    srcs = [torch.randint(-2**62, 2**62, (50, 9), dtype=torch.int64, generator=g) for _ in range(7)]
    scattered = torch.randperm(50, generator=g)[:20]
    in_runs = torch.cat([torch.arange(3, 9), torch.arange(30, 34)])
    indexes = [scattered, in_runs, torch.empty(0, dtype=torch.int64)] * 3
    outs = [torch.full((idx.numel(), 9), -1, dtype=torch.int64) for idx in indexes[:7]]
    gather_jobs([(o, idx, s) for o, idx, s in zip(outs, indexes, srcs)])
    for o, idx, s in zip(outs, indexes, srcs):
        assert torch.equal(o, s.index_select(0, idx))
    dsts = [torch.randint(0, 9, (50, 9), dtype=torch.int64, generator=g) for _ in range(7)]
    want = [d.clone().index_copy_(0, idx, o) for d, idx, o in zip(dsts, indexes, outs)]
    scatter_jobs([(d, idx, o) for d, idx, o in zip(dsts, indexes, outs)])
    for d, w in zip(dsts, want):
        assert torch.equal(d, w)


def test_the_groups_are_consecutive_non_empty_and_about_equal_in_bytes():
    assert device_copy._groups([10] * 8, 2) == [(0, 4), (4, 8)]
    assert device_copy._groups([10] * 8, 3) == [(0, 3), (3, 6), (6, 8)]  # 30 >= 80/3, 60 >= 160/3
    assert device_copy._groups([100, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    assert device_copy._groups([1, 1], 5) == [(0, 1), (1, 2)]  # never more groups than items
    assert device_copy._groups([5], 4) == [(0, 1)]


def test_copy_threads_refuses_what_is_not_a_thread_count():
    before = device_copy.copy_threads()
    for bad in (0, -1, device_copy.MAX_COPY_THREADS + 1, 2.0, True, "2"):
        with pytest.raises(ValueError, match="copy threads"):
            device_copy.set_copy_threads(bad)
    assert device_copy.copy_threads() == before


@pytest.mark.parametrize("threads", [1, 3])
def test_a_request_copy_and_load_split_over_threads_moves_the_same_bytes(threads_and_no_minimum, threads):
    """get_cpu_copy of scattered whole pages and of scattered single slots, loaded onto other slots,
    with the copy split over 1 and 3 threads: the pool equals the reference pool's moves."""
    threads_and_no_minimum(threads)
    model = DSAModelConfig.from_preset("glm-5.2", num_layers=8)
    pool = create_pool(model, 2048, device="cpu")
    randomize(pool, 11)
    for src, dst in ((slots_of_pages(torch.tensor([9, 2, 5]), 64), slots_of_pages(torch.tensor([20, 14, 17]), 64)),
                     (torch.tensor([70, 3, 900, 65]), torch.tensor([1500, 1600, 1601, 77]))):
        expected = RefPool(pool)
        expected.move(dst.tolist(), src.tolist())
        pool.load_cpu_copy(pool.get_cpu_copy(src), dst)
        assert_same_bytes(expected.buffers(), snapshot(pool))
