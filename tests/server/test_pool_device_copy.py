"""The copy engine's pieces: host layout of parts, back-to-back detection (one DMA), row scatters;
the CUDA staging path itself is ``cuda``-marked (it never runs on a CPU machine)."""

from __future__ import annotations

import pytest
import torch

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import create_pool, slots_of_pages
from kvtier.server.pool import device_copy
from kvtier.server.pool.device_copy import CopyEngine, contiguous_span, copy_pairs, host_views, part_nbytes, scatter_layers, scatter_rows
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
def test_copy_pairs_copies_every_pair(sizes):
    """Large copies (cut in two halves, one on the helper thread), small ones (the caller alone), one
    pair, and uneven pairs: every destination holds its source's bytes, nothing else is written."""
    pairs, srcs, buf = _pairs(sizes, seed=len(sizes))
    copy_pairs(pairs)
    assert torch.equal(buf[:sum(sizes)], torch.cat(srcs))
    assert buf[sum(sizes):].eq(0).all()


def test_copy_pairs_does_not_wait_for_a_busy_helper():
    """With the helper taken (another call's half), a large copy runs on the caller alone and finishes."""
    pairs, srcs, buf = _pairs([4 << 20] * 4, seed=7)
    assert device_copy._idle.acquire(timeout=60)
    try:
        copy_pairs(pairs)
    finally:
        device_copy._idle.release()
    assert torch.equal(buf[:16 << 20], torch.cat(srcs))


def test_copy_pairs_waits_for_the_helper_when_the_callers_half_fails():
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
