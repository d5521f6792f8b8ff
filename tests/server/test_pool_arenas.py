"""Pools over shared memory and over arenas that already exist (what an attached worker builds).

A pool made ``shared`` keeps each component in a sealed memfd; a second pool built with
``arenas=`` over a second mapping of the same descriptors addresses exactly the same bytes through
the same views (GLM-5.2 layers 0-7, skip mask FFFSSSFS).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvtier.memfd import SharedMemory
from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import create_pool
from kvtier.server.pool.dsa import DSATokenToKVPool

MODEL = DSAModelConfig.from_preset("glm-5.2", num_layers=8)
SIZE = 1024


def twin(pool: DSATokenToKVPool) -> tuple[DSATokenToKVPool, dict[str, SharedMemory]]:
    """A pool over a second mapping of ``pool``'s shared memory (as a worker maps the fds it got)."""
    maps = {c: SharedMemory.open(os.dup(shm.fd), shm.nbytes) for c, shm in pool.shared_memory.items()}
    other = DSATokenToKVPool(SIZE, 64, 512, 64, 8, "cpu", "fp8", skip_topk_layers=MODEL.skip_topk_layers,
                             arenas={c: m.tensor() for c, m in maps.items()})
    return other, maps


def test_shared_pool_lives_in_sealed_memfds():
    pool = create_pool(MODEL, SIZE, device="cpu", shared=True)
    assert set(pool.shared_memory) == {"latent", "index_k"}
    for comp, shm in pool.shared_memory.items():
        assert shm.sealed and shm.nbytes == pool.arena_nbytes()[comp]
        assert pool.arena(comp).data_ptr() == shm.address
    assert pool.get_kv_size_bytes() == create_pool(MODEL, SIZE, device="cpu").get_kv_size_bytes()
    assert create_pool(MODEL, SIZE, device="cpu").shared_memory == {}


def test_a_pool_over_the_same_arenas_reads_and_writes_the_same_bytes():
    pool = create_pool(MODEL, SIZE, device="cpu", shared=True)
    other, _ = twin(pool)
    g = torch.Generator().manual_seed(3)
    slots = torch.arange(64, 192)  # pages 1 and 2
    rows = torch.randint(0, 256, (128, 656), dtype=torch.uint8, generator=g)
    keys = torch.randint(0, 256, (128, 128), dtype=torch.uint8, generator=g)
    scales = torch.rand(128, generator=g)
    other.set_kv_buffer(6, slots, rows)
    other.set_index_k_scale_buffer(6, slots, keys, scales)
    assert torch.equal(pool.get_kv_buffer_rows(6, slots).view(128, 656), rows)
    k, s = pool.get_index_k_scale(6, slots)
    assert torch.equal(k, keys) and torch.equal(s, scales)
    # the page layout itself (DESIGN.md): token t of page p at byte t*128 of the page row, scales after the keys
    assert torch.equal(pool.index_k_with_scale_buffer[6][1, :64 * 128].view(64, 128), keys[:64])
    assert torch.equal(pool.index_k_with_scale_buffer[6][2, 64 * 128:].view(torch.float32), scales[64:])
    for a, b in zip(pool.kv_buffer + pool.index_k_with_scale_buffer, other.kv_buffer + other.index_k_with_scale_buffer):
        assert (tuple(a.shape), a.dtype) == (tuple(b.shape), b.dtype)
    for mine, theirs in ((pool.get_state_buf_infos(), other.get_state_buf_infos()),
                         (pool.get_contiguous_buf_infos(), other.get_contiguous_buf_infos())):
        assert mine[1:] == theirs[1:]


@pytest.mark.parametrize("bad, message", [
    (lambda n: {"latent": torch.zeros(n["latent"] - 1, dtype=torch.uint8)}, "needs"),
    (lambda n: {"latent": torch.zeros(n["latent"], dtype=torch.int8)}, "uint8"),
    (lambda n: {"latent": torch.zeros(n["latent"] + 1, dtype=torch.uint8)[1:]}, "aligned"),
    (lambda n: {"latent": torch.zeros(n["latent"], dtype=torch.uint8).view(1, -1)}, "1-D"),
    (lambda n: {"latent": torch.zeros(n["latent"], dtype=torch.uint8), "index_k": torch.zeros(8, dtype=torch.uint8)}, "index_k"),
    (lambda n: {"latent": torch.zeros(n["latent"], dtype=torch.uint8), "scales": torch.zeros(8)}, "unknown components"),
    (lambda n: {"latent": "memory"}, "torch.Tensor"),
])
def test_arenas_that_do_not_fit_are_refused(bad, message):
    nbytes = create_pool(MODEL, SIZE, device="cpu").arena_nbytes()
    with pytest.raises((TypeError, ValueError), match=message):
        DSATokenToKVPool(SIZE, 64, 512, 64, 8, "cpu", "fp8", skip_topk_layers=MODEL.skip_topk_layers, arenas=bad(nbytes))


def test_a_pool_without_live_layers_needs_no_indexer_arena():
    skip = (True,) * 3  # a pipeline stage of layers 3-5 of GLM-5.2: all three skip top-k
    nbytes = DSATokenToKVPool(256, 64, 512, 64, 3, "cpu", skip_topk_layers=skip, start_layer=3).arena_nbytes()
    assert nbytes["index_k"] == 0
    pool = DSATokenToKVPool(256, 64, 512, 64, 3, "cpu", skip_topk_layers=skip, start_layer=3,
                            arenas={"latent": torch.zeros(nbytes["latent"], dtype=torch.uint8)})
    assert pool.get_index_size_bytes() == 0
