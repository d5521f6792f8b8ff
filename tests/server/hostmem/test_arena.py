"""The host arena: memfd-backed, faulted in once, blocks freed when their tensors are gone."""

from __future__ import annotations

import gc
import mmap
import os
import time

import numpy as np
import pytest
import torch

from kvtier.server.hostmem import PAGE_BYTES, HostArena


def test_a_block_is_freed_only_when_its_tensor_and_every_view_are_gone():
    arena = HostArena(1 << 20)
    block = arena.alloc(10_000)
    view = block.tensor[100:200].view(torch.int32)
    assert arena.stats().used_bytes == 3 * PAGE_BYTES and arena.stats().live_blocks == 1
    del block
    gc.collect()
    assert arena.stats().used_bytes == 3 * PAGE_BYTES  # the view still holds it
    del view
    assert arena.stats().used_bytes == 0 and arena.stats().live_blocks == 0


def test_blocks_do_not_overlap_and_a_freed_block_comes_back_at_the_same_place():
    arena = HostArena(1 << 20)
    a, b = arena.alloc_tensor(5000), arena.alloc_tensor(5000)
    oa, ob = arena.offset_of(a), arena.offset_of(b)
    assert ob >= oa + 5000 and oa % PAGE_BYTES == 0 and ob % PAGE_BYTES == 0
    a.fill_(1)
    b.fill_(2)
    assert int(a.sum()) == 5000 and int(b.sum()) == 10000
    del a
    assert arena.offset_of(arena.alloc_tensor(5000)) == oa  # best fit: the same pages, already faulted in


def test_exhausted_arena_returns_none_and_counts_the_callers_fallback():
    arena = HostArena(8 * PAGE_BYTES)
    held = arena.alloc_tensor(6 * PAGE_BYTES)
    assert arena.alloc(3 * PAGE_BYTES) is None
    arena.count_fallback()
    s = arena.stats()
    assert (s.failed_allocs, s.fallbacks, s.largest_free_bytes) == (1, 1, 2 * PAGE_BYTES)
    del held


def test_memory_is_an_anonymous_memfd_another_mapping_of_the_fd_sees_the_same_bytes():
    """What local attach will rely on: the fd and a block's offset name the block's bytes."""
    before = set(os.listdir("/dev/shm"))
    arena = HostArena(1 << 20, name="kvtier-test-arena")
    assert os.readlink(f"/proc/self/fd/{arena.fd}").startswith("/memfd:kvtier-test-arena")
    assert set(os.listdir("/dev/shm")) == before  # nothing named in /dev/shm
    block = arena.alloc(PAGE_BYTES * 2)
    block.tensor.copy_(torch.arange(PAGE_BYTES * 2, dtype=torch.int64).to(torch.uint8))
    with mmap.mmap(arena.fd, arena.capacity, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as other:
        seen = np.frombuffer(other, dtype=np.uint8, count=block.nbytes, offset=block.offset)
        assert np.array_equal(seen, block.tensor.numpy())
        del seen
    ptr, n = arena.registration_range()
    assert n == arena.capacity and ptr <= block.tensor.data_ptr() < ptr + n


def test_prefault_modes_fault_every_page_in_and_background_finishes():
    assert HostArena(3 << 20).stats().prefaulted_bytes == 3 << 20
    assert HostArena(3 << 20, prefault=False).stats().prefaulted_bytes == 0
    bg = HostArena(3 << 20, prefault="background")
    for _ in range(200):
        if bg.stats().prefaulted_bytes == 3 << 20:
            break
        time.sleep(0.01)
    assert bg.stats().prefaulted_bytes == 3 << 20


def test_closed_arena_hands_out_nothing_but_live_blocks_stay_valid():
    arena = HostArena(1 << 20)
    t = arena.alloc_tensor(100)
    t.fill_(7)
    arena.close()
    assert arena.alloc(10) is None
    assert int(t.sum()) == 700
    del t


def test_forked_child_gets_no_blocks_from_the_parents_arena():
    arena = HostArena(1 << 20)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must not carve memory the parent also hands out
        os.write(w, b"none" if arena.alloc(10) is None else b"block")
        os._exit(0)
    os.close(w)
    got = os.read(r, 16)
    os.waitpid(pid, 0)
    os.close(r)
    assert got == b"none"
    assert arena.alloc(10) is not None


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        HostArena(0)
    with pytest.raises(ValueError):
        HostArena(1 << 20, page_bytes=1000)
    with pytest.raises(ValueError):
        HostArena(1 << 20, prefault="sometimes")
    with pytest.raises(ValueError):
        HostArena(1 << 20).alloc(-1)


@pytest.mark.cuda
def test_cuda_arena_is_page_locked_for_dma():
    arena = HostArena(4 << 20, pin=True)
    t = arena.alloc_tensor(1 << 20)
    assert arena.pinned and t.is_pinned()
    dev = torch.arange(1 << 18, dtype=torch.int32, device="cuda")
    t.view(torch.int32).copy_(dev, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(t.view(torch.int32), dev.cpu())


def test_prefault_limit_faults_in_only_the_lowest_bytes():
    arena = HostArena(8 << 20, prefault_limit=3 << 20)
    assert arena.stats().prefaulted_bytes == 3 << 20
    t = arena.alloc_tensor(6 << 20)  # beyond the limit pages fault on first use: still usable
    t.fill_(3)
    assert int(t[-1]) == 3
