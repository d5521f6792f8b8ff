"""Host copies in the host arena (``get_cpu_copy`` as SGLang calls it) and the whole-page copy paths,
byte for byte against the numpy reference of :mod:`pool_reference`."""

from __future__ import annotations

import pytest
import torch

from kvtier.server.hostmem import HostArena
from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import MLATokenToKVPool, create_pool, slots_of_pages
from pool_reference import RefPool, assert_same_bytes, randomize, scattered_slots, small_pool, snapshot


def copy_tensors(copy: dict) -> list[torch.Tensor]:
    return [c for key in ("kv", "index_k") for layer in copy[key] for c in layer]


def test_copy_without_out_lives_in_the_pools_arena_and_is_freed_when_dropped():
    pool = small_pool(seed=1)
    a = scattered_slots(100, seed=1, limit=1088)
    copy = pool.get_cpu_copy(a)
    arena = pool.host_arena
    assert all(arena.owns(t) for t in copy_tensors(copy))
    assert arena.stats().used_bytes >= pool.cpu_copy_nbytes(a)
    kept = copy["kv"][3][0]  # one chunk outlives the dict: the block stays
    del copy
    assert arena.stats().live_blocks == 1
    del kept
    assert arena.stats().used_bytes == 0 and arena.stats().live_blocks == 0


def test_copies_share_the_arena_they_are_given_and_fall_back_when_it_is_full():
    """A too-small arena: the second copy is ordinary memory (counted), with the same bytes."""
    model = DSAModelConfig.from_preset("glm-5.2", num_layers=8)
    pool = create_pool(model, 1024, device="cpu")
    randomize(pool, 2)
    a = scattered_slots(200, seed=2, limit=1088)
    arena = HostArena(pool.cpu_copy_nbytes(a) + 4096)
    pool_b = create_pool(model, 1024, device="cpu", host_arena=arena)
    assert pool_b.host_arena is arena
    first = pool_b.get_cpu_copy(a)  # fits
    randomize(pool_b, 2)  # same bytes as pool
    second = pool_b.get_cpu_copy(a)
    assert all(arena.owns(t) for t in copy_tensors(first))
    assert not any(arena.owns(t) for t in copy_tensors(second)) and arena.stats().fallbacks == 1
    ref = pool.get_cpu_copy(a, out=torch.empty(pool.cpu_copy_nbytes(a), dtype=torch.uint8))
    for x, y in zip(copy_tensors(ref), copy_tensors(second)):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_whole_scattered_pages_round_trip(dtype):
    """Whole pages in shuffled order (the page-row copy path) onto other whole pages."""
    pool = small_pool(dtype, seed=5)
    src_pages, dst_pages = torch.tensor([9, 2, 14, 3]), torch.tensor([1, 11, 6, 16])
    a, b = slots_of_pages(src_pages, 64), slots_of_pages(dst_pages, 64)
    expected = RefPool(pool)
    copy = pool.get_cpu_copy(a)
    for layer in range(pool.layer_num):  # the copy's rows are the source slots' rows, in order
        want = pool.kv_buffer[layer][a].view(torch.uint8)  # bytes: random bf16 holds NaNs
        assert torch.equal(torch.cat(copy["kv"][layer]).view(torch.uint8), want)
    expected.move(b.tolist(), a.tolist())
    pool.load_cpu_copy(copy, b)
    assert_same_bytes(expected.buffers(), snapshot(pool))


def test_whole_pages_onto_token_slots_and_token_slots_onto_whole_pages():
    """Either side not whole pages: the token paths, same bytes."""
    pool = small_pool(seed=6)
    whole = slots_of_pages(torch.tensor([4, 12]), 64)
    tokens = scattered_slots(128, seed=6, limit=1088, exclude=whole.tolist())
    expected = RefPool(pool)
    pool.load_cpu_copy(pool.get_cpu_copy(whole), tokens)
    expected.move(tokens.tolist(), whole.tolist())
    assert_same_bytes(expected.buffers(), snapshot(pool))
    expected = RefPool(pool)
    pool.load_cpu_copy(pool.get_cpu_copy(tokens), whole)
    expected.move(whole.tolist(), tokens.tolist())
    assert_same_bytes(expected.buffers(), snapshot(pool))


def test_pages_with_tokens_out_of_order_are_not_taken_for_whole_pages():
    pool = small_pool(seed=8)
    a = slots_of_pages(torch.tensor([3, 7]), 64)
    a[[0, 1]] = a[[1, 0]]  # two tokens of page 3 swapped: still the page's tokens, not in order
    b = slots_of_pages(torch.tensor([10, 5]), 64)
    expected = RefPool(pool)
    pool.load_cpu_copy(pool.get_cpu_copy(a), b)
    expected.move(b.tolist(), a.tolist())
    assert_same_bytes(expected.buffers(), snapshot(pool))


def test_latent_only_pool_whole_pages_and_its_partial_last_page():
    """An MLA pool of 1000 tokens has 1064 slots: 16 whole pages and a partial one (1024..1063),
    which only the token path can reach."""
    pool = MLATokenToKVPool(1000, 64, 512, 64, 3, device="cpu", kv_cache_dtype="fp8")
    g = torch.Generator().manual_seed(10)
    for b in pool.kv_buffer:
        b.copy_(torch.randint(0, 256, tuple(b.shape), dtype=torch.uint8, generator=g))
    before = [b.clone() for b in pool.kv_buffer]
    src = torch.cat([slots_of_pages(torch.tensor([15, 2]), 64), torch.arange(1024, 1064)])
    dst = torch.cat([slots_of_pages(torch.tensor([7, 9]), 64), torch.arange(300, 340)])
    pool.load_cpu_copy(pool.get_cpu_copy(src), dst)
    whole_src, whole_dst = slots_of_pages(torch.tensor([15, 2]), 64), slots_of_pages(torch.tensor([7, 9]), 64)
    pool.load_cpu_copy(pool.get_cpu_copy(whole_src), whole_dst)  # the page-row path
    for b, old in zip(pool.kv_buffer, before):
        assert torch.equal(b[dst], old[src])
        untouched = torch.ones(1064, dtype=torch.bool)
        untouched[dst] = False
        assert torch.equal(b[untouched], old[untouched])
