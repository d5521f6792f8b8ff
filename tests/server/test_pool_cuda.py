"""The same pool checks on a CUDA device (pinned host copies, non-blocking transfers).

Marked ``cuda``: left out of the default run, selected with ``-m cuda`` on a machine with a GPU,
where a missing device makes them fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import create_pool
from pool_reference import RefPool, assert_same_bytes, randomize, snapshot

pytestmark = pytest.mark.cuda


def cuda_pool(dtype: str):
    pool = create_pool(DSAModelConfig.from_preset("glm-5.2", num_layers=8, kv_cache_dtype=dtype), 1024, device="cuda")
    assert pool.kv_buffer[0].is_cuda and pool.index_k_with_scale_buffer[0].is_cuda
    randomize(pool, 1)
    return pool


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 129])
def test_round_trip_on_cuda(dtype, n):
    pool = cuda_pool(dtype)
    rng = np.random.default_rng(n)
    slots = rng.permutation(np.arange(1, 1088))
    a, b = torch.from_numpy(slots[:n].copy()), torch.from_numpy(slots[n:2 * n].copy())
    expected = RefPool(pool)
    copy = pool.get_cpu_copy(a)
    assert all(c.device.type == "cpu" and c.is_pinned() for layer in copy["kv"] for c in layer)
    out = torch.empty(pool.cpu_copy_nbytes(a), dtype=torch.uint8, pin_memory=True)
    copy_out = pool.get_cpu_copy(a, out=out)
    assert all(torch.equal(x, y) for lx, ly in zip(copy["kv"], copy_out["kv"]) for x, y in zip(lx, ly))
    expected.move(b.tolist(), a.tolist())
    pool.load_cpu_copy(copy, b.cuda())
    assert_same_bytes(expected.buffers(), snapshot(pool))


def test_move_on_cuda():
    pool = cuda_pool("fp8")
    expected = RefPool(pool)
    tgt, src = [70, 135, 500, 501], [135, 70, 3, 3]
    pool.move_kv_cache(torch.tensor(tgt, device="cuda"), torch.tensor(src))
    expected.move(tgt, src)
    assert_same_bytes(expected.buffers(), snapshot(pool))
