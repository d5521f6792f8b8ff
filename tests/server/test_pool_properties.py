"""Property tests: random moves, writes and host-copy round trips against the numpy reference.

The reference (:class:`pool_reference.RefPool`) copies a token's latent row and its key and scale
bytes at (loc // 64, loc % 64) by hand; after every sequence of operations every byte of every
buffer must agree.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import create_pool
from pool_reference import RefPool, assert_same_bytes, randomize, snapshot

SLOTS = 320  # size 256 + one padding page; 5 indexer pages
LIVE = [0, 1, 2]  # GLM-5.2's first 5 layers: F F F S S

POOLS = {}


def pool_for(dtype: str):
    if dtype not in POOLS:
        pool = create_pool(DSAModelConfig.from_preset("glm-5.2", num_layers=5, kv_cache_dtype=dtype), 256, device="cpu")
        randomize(pool, 0)
        POOLS[dtype] = pool
    return POOLS[dtype]


PROPS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
slot = st.integers(0, SLOTS - 1)


@st.composite
def move_op(draw):
    tgt = draw(st.lists(slot, min_size=0, max_size=80, unique=True))
    src = draw(st.lists(slot, min_size=len(tgt), max_size=len(tgt)))
    return ("move", tgt, src)


@st.composite
def copy_op(draw):
    n = draw(st.integers(0, 150))
    src = draw(st.lists(slot, min_size=n, max_size=n))  # repeated sources are fine
    tgt = draw(st.lists(slot, min_size=n, max_size=n, unique=True))
    return ("copy", tgt, src, draw(st.booleans()))


@st.composite
def write_op(draw):
    tgt = draw(st.lists(slot, min_size=0, max_size=30, unique=True))
    return ("write", tgt, draw(st.sampled_from(range(5))), draw(st.integers(0, 2**31)))


def apply(pool, ref: RefPool, op) -> None:
    kind = op[0]
    if kind == "move":
        _, tgt, src = op
        pool.move_kv_cache(torch.tensor(tgt, dtype=torch.int64), np.array(src, dtype=np.int64))
        ref.move(tgt, src)
    elif kind == "copy":
        _, tgt, src, use_out = op
        src_t = torch.tensor(src, dtype=torch.int64)
        out = torch.empty(pool.cpu_copy_nbytes(src_t), dtype=torch.uint8) if use_out else None
        copy = pool.get_cpu_copy(src_t, out=out)
        data = [ref.token(s) for s in src]
        pool.load_cpu_copy(copy, tgt)
        for t, d in zip(tgt, data):
            ref.put_token(t, d)
    else:
        _, tgt, layer, seed = op
        g = torch.Generator().manual_seed(seed)
        n = len(tgt)
        lat = torch.randint(0, 256, (n, pool.row_bytes), dtype=torch.uint8, generator=g)
        pool.set_kv_buffer(layer, tgt, lat)
        for i, t in enumerate(tgt):
            ref.lat[layer][t] = lat[i].numpy()
        if layer in LIVE:
            keys = torch.randint(0, 256, (n, 128), dtype=torch.uint8, generator=g)
            scales = torch.randn(n, generator=g)
            pool.set_index_k_scale_buffer(layer, tgt, keys, scales)
            for i, t in enumerate(tgt):
                ref.key(layer, t)[:] = keys[i].numpy()
                ref.scale(layer, t)[:] = np.frombuffer(scales[i].numpy().tobytes(), dtype=np.uint8)


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@PROPS
@given(ops=st.lists(st.one_of(move_op(), copy_op(), write_op()), min_size=1, max_size=4))
def test_operations_match_the_reference(dtype, ops):
    pool = pool_for(dtype)
    ref = RefPool(pool)
    for op in ops:
        apply(pool, ref, op)
    assert_same_bytes(ref.buffers(), snapshot(pool))
    assert all(tuple(pool.index_k_with_scale_buffer[i].shape) == (0, 8448) for i in (3, 4))


@PROPS
@given(data=st.data())
def test_round_trip_restores_every_live_byte(data):
    """load_cpu_copy(get_cpu_copy(a), b): slots b hold a's bytes on every layer; nothing else changes."""
    pool = pool_for("fp8")
    n = data.draw(st.integers(1, 200))
    a = data.draw(st.lists(slot, min_size=n, max_size=n, unique=True))
    b = data.draw(st.lists(slot, min_size=n, max_size=n, unique=True))
    ref = RefPool(pool)
    before = [ref.token(s) for s in a]
    pool.load_cpu_copy(pool.get_cpu_copy(a), b)
    ref.move(b, a)
    after = RefPool(pool)
    assert [after.token(t) for t in b] == before
    assert_same_bytes(ref.buffers(), after.buffers())


@PROPS
@given(tgt=st.lists(slot, min_size=2, max_size=40), data=st.data())
def test_duplicate_targets_are_refused_and_change_nothing(tgt, data):
    pool = pool_for("fp8")
    tgt = tgt + [tgt[data.draw(st.integers(0, len(tgt) - 1))]]
    src = data.draw(st.lists(slot, min_size=len(tgt), max_size=len(tgt)))
    before = snapshot(pool)
    with pytest.raises(ValueError, match="duplicate"):
        pool.move_kv_cache(tgt, src)
    with pytest.raises(ValueError, match="duplicate"):
        pool.load_cpu_copy(pool.get_cpu_copy(src), tgt)
    assert_same_bytes(before, snapshot(pool))


def corrupt(copy: dict, how: str, live: int, skip: int) -> dict:
    """A copy of ``copy`` with one layout fault."""
    c = {"kv": [list(x) for x in copy["kv"]], "index_k": [list(x) for x in copy["index_k"]], "src_loc": copy["src_loc"]}
    kv0, idx0 = c["kv"][0][0], c["index_k"][live][0]
    if how == "drop_kv_layer":
        c["kv"].pop()
    elif how == "drop_index_layer":
        c["index_k"].pop()
    elif how == "data_on_skip_layer":
        c["index_k"][skip] = [idx0]
    elif how == "live_layer_empty":
        c["index_k"][live] = []
    elif how == "kv_row_short":
        c["kv"][-1] = [kv0[:-1]]
    elif how == "kv_dtype":
        c["kv"][1] = [kv0.view(torch.int16)]
    elif how == "kv_shape":
        c["kv"][1] = [kv0.reshape(kv0.shape[0], 2, -1)]
    elif how == "index_width":
        c["index_k"][live] = [idx0[:, :-8]]
    elif how == "index_dtype":
        c["index_k"][live] = [idx0.view(torch.int8)]
    elif how == "index_1d":
        c["index_k"][live] = [idx0.reshape(-1)]
    elif how == "index_extra_page":
        c["index_k"][live] = [torch.cat([idx0, idx0[:1]])]
    elif how == "index_not_list":
        c["index_k"][live] = idx0
    elif how == "kv_not_list":
        c["kv"][0] = kv0
    elif how == "src_loc_short":
        c["src_loc"] = c["src_loc"][:-1]
    elif how == "src_loc_negative":
        c["src_loc"] = c["src_loc"] - 10_000
    elif how == "src_loc_float":
        c["src_loc"] = c["src_loc"].float()
    elif how == "no_index_k":
        del c["index_k"]
    return c


CORRUPTIONS = ["drop_kv_layer", "drop_index_layer", "data_on_skip_layer", "live_layer_empty", "kv_row_short",
               "kv_dtype", "kv_shape", "index_width", "index_dtype", "index_1d", "index_extra_page",
               "index_not_list", "kv_not_list", "src_loc_short", "src_loc_negative", "src_loc_float", "no_index_k"]


@PROPS
@given(how=st.sampled_from(CORRUPTIONS), data=st.data())
def test_a_corrupted_copy_is_refused_and_changes_nothing(how, data):
    """Whatever layout fault a copy has, load_cpu_copy raises ValueError/TypeError before writing."""
    pool = pool_for("fp8")
    n = data.draw(st.integers(1, 150))
    a = data.draw(st.lists(slot, min_size=n, max_size=n, unique=True))
    b = data.draw(st.lists(slot, min_size=n, max_size=n, unique=True))
    bad = corrupt(pool.get_cpu_copy(a), how, live=data.draw(st.sampled_from(LIVE)), skip=data.draw(st.sampled_from([3, 4])))
    before = snapshot(pool)
    with pytest.raises((ValueError, TypeError)):
        pool.load_cpu_copy(bad, b)
    assert_same_bytes(before, snapshot(pool))
