"""kvtier as SGLang's HiCache storage backend, against SGLang 0.5.23's own classes and a real daemon.

The backend is created by SGLang's ``StorageBackendFactory`` (``dynamic``) from SGLang's
``HiCacheStorageConfig``, attached to SGLang's own host pools (``MLATokenToKVPoolHost`` with 656-byte
fp8 rows, ``DSAIndexerPoolHost``) of GLM-5.2 layers 20-23 (only 22 runs the indexer), and called the
way SGLang's cache controller calls it (``PoolTransfer``, ``PoolName.INDEXER``, indexer before KV on
writes, KV before indexer on reads). Keys are SGLang's own chained page hashes. Expected bytes are the
host pages' own bytes before they were zeroed; the unit's KV part is checked against an independent
transposition of the ``page_first`` host page.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from hosts import PS, HostPools, indexer, load, make_backend, page_keys, store
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess
from kvtier.integrations.sglang import KVTierStorage

TOKEN_A = "sglang-tenant-a-0123456789abcdef"
TOKEN_B = "sglang-tenant-b-0123456789abcdef"


def tokens_file(path):
    path.write_text(f'[tokens]\n"{TOKEN_A}" = "team-a"\n"{TOKEN_B}" = "team-b"\n')
    os.chmod(path, 0o600)
    return path


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sgl")
    args = ["--device", "cpu", "--auth-tokens", str(tokens_file(tmp / "tokens.toml")), "--host-memory", "64MiB",
            "--disk-path", str(tmp / "disk"), "--disk-size", "128MiB"]
    d = DaemonProcess(f"unix://{tmp}/kv.sock", extra_args=args)
    d.start()
    yield d
    d.stop()
    d.cleanup()


def extra(d, token=TOKEN_A, **more):
    return {"address": d.address, "token": token, "timeout_s": 30, **more}


def exists_v2(backend, keys):
    return backend.batch_exists_v2(keys, indexer(keys, None, hit_policy=PoolHitPolicy.ALL_PAGES))


def test_the_factory_builds_it_from_sglangs_config(daemon):
    pools = HostPools()
    b = make_backend(pools, extra(daemon))
    assert type(b) is KVTierStorage
    assert b._stage().skip_mask == "SSFS" and b._stage().index_nbytes == 8448 and b._stage().kv_nbytes == 4 * PS * 656


@pytest.mark.parametrize("layout, dtype", [("page_first_direct", torch.float8_e4m3fn), ("page_first", torch.float8_e4m3fn),
                                           ("page_first_direct", torch.bfloat16)])
def test_set_then_exists_then_get_gives_the_same_bytes(daemon, layout, dtype):
    pools = HostPools(layout=layout, dtype=dtype)
    row = 656 if dtype == torch.float8_e4m3fn else 1152   # fp8: 656 uint8; bf16: 576 bf16 values
    b = make_backend(pools, extra(daemon))
    keys = page_keys(5, salt=len(layout) + row)
    src = pools.alloc(5)
    pools.fill(src, seed=1)
    want = pools.snapshot(src)
    store(b, keys, src)
    r = exists_v2(b, keys)
    assert r.kv_hit_pages == 5 and r.extra_pool_hit_pages == {PoolName.KV: 5, PoolName.INDEXER: 5}
    assert b.batch_exists(keys) == 5 and b.exists(keys[0])
    pools.zero(src)
    dst = pools.alloc(5)                          # other host pages than the ones written
    assert load(b, keys, dst) == ([True] * 5, [True] * 5)
    got = pools.snapshot(dst)
    for (wk, wi), (gk, gi) in zip(want, got):
        assert torch.equal(gk, wk) and torch.equal(gi, wi)
    m = b.get_stats()                             # SGLang's StorageMetrics: pages per call since the last call
    assert type(m).__name__ == "StorageMetrics" and m.backup_pgs == [5] and m.prefetch_pgs == [5]
    assert b.get_stats().backup_pgs == []
    # the unit's KV part is layer-major (layers, 64, 656): a page_first host page is token-major
    space = b._stage()
    with KVTierClient(daemon.address, token=TOKEN_A) as c:
        raw = torch.empty(space.part_nbytes("both"), dtype=torch.uint8)
        assert c.get_units(space, [keys[0].encode()], "both", raw) == [True]
    assert space.latent_row_bytes == row and space.kv_cache_dtype == ("fp8" if row == 656 else "bf16")
    kv0 = want[0][0].view(torch.uint8).reshape(-1)
    if layout == "page_first":
        kv0 = want[0][0].view(torch.uint8).view(PS, 4, row).transpose(0, 1).reshape(-1)
    assert torch.equal(raw[:space.kv_nbytes], kv0) and torch.equal(raw[space.kv_nbytes:], want[0][1].reshape(-1))


def test_a_unit_evicted_between_the_kv_read_and_the_indexer_read_still_comes_whole(daemon):
    """SGLang reads KV (v1) and then the indexer (v2) in two calls; a page evicted in between must not
    come back as KV without its indexer (SGLang's tracker: garbled output). kvtier reads both parts in
    the v1 call, from one record: the v2 call answers from what v1 delivered."""
    pools = HostPools()
    b = make_backend(pools, extra(daemon))
    keys = page_keys(3, salt=41)
    src = pools.alloc(3)
    pools.fill(src, seed=10)
    want = pools.snapshot(src)
    store(b, keys, src)
    dst = pools.alloc(3)
    assert b.batch_get_v1(keys, dst) == [True] * 3
    assert b.clear() is True and b.batch_exists(keys) == 0        # evicted from kvtier between the two calls
    assert b.batch_get_v2(indexer(keys, dst))[PoolName.INDEXER] == [True] * 3
    assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(pools.snapshot(dst), want))
    other = pools.alloc(3)                                        # other host pages: nothing was delivered there
    assert b.batch_get_v2(indexer(keys, other))[PoolName.INDEXER] == [False] * 3


def test_indexer_read_alone_and_from_another_thread(daemon):
    """batch_get_v2 of the indexer without a v1 call before it reads the indexer part from kvtier."""
    pools = HostPools()
    b = make_backend(pools, extra(daemon))
    keys = page_keys(2, salt=7)
    src = pools.alloc(2)
    pools.fill(src, seed=2)
    want = pools.snapshot(src)
    store(b, keys, src)
    dst = pools.alloc(2)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=b.batch_get_v2(indexer(keys, dst))))
    t.start()
    t.join(60)
    assert out["r"][PoolName.INDEXER] == [True, True]
    got = pools.snapshot(dst)
    assert all(torch.equal(g[1], w[1]) for g, w in zip(got, want))
    assert all(int(g[0].count_nonzero()) == 0 for g in got)          # the KV pages were not touched


def test_longest_prefix_and_half_units_never_count(daemon):
    pools = HostPools()
    b = make_backend(pools, extra(daemon))
    keys = page_keys(6, salt=11)
    idx = pools.alloc(6)
    pools.fill(idx, seed=3)
    pages = lambda ids: idx.reshape(-1, PS)[ids].reshape(-1)  # noqa: E731
    store(b, keys[:3], pages([0, 1, 2]))
    store(b, [keys[4]], pages([4]))
    assert b.batch_set_v2(indexer([keys[3]], pages([3])))[PoolName.INDEXER] == [True]   # indexer only
    assert b.batch_set_v1([keys[5]], pages([5])) == [True]                              # KV only
    assert exists_v2(b, keys).kv_hit_pages == 3 and b.batch_exists(keys) == 3
    assert exists_v2(b, keys[3:4]).extra_pool_hit_pages == {} and b.batch_exists([keys[5]]) == 0
    assert b.batch_get_v1(keys[3:], pools.alloc(3)) == [False, True, False]
    assert b.kvtier_stats()["parts_pending"] >= 2


def test_a_page_evicted_inside_kvtier_shows_neither_kv_nor_indexer(tmp_path):
    # host tier of 2 MiB, no disk: 6 units of ~177 KB fit, 20 do not; the oldest are evicted whole
    with DaemonProcess(f"unix://{tmp_path}/ev.sock", extra_args=["--device", "cpu", "--host-memory", "2MiB"]) as d:
        pools = HostPools()
        b = make_backend(pools, {"address": d.address})
        keys = page_keys(20, salt=13)
        idx = pools.alloc(20)
        pools.fill(idx, seed=4)
        for i in range(0, 20, 4):
            store(b, keys[i:i + 4], idx[i * PS:(i + 4) * PS])
        r = exists_v2(b, keys[:1])
        assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (0, {})
        fresh = make_backend(pools, {"address": d.address})     # nothing delivered before in this backend
        dst = pools.alloc(1)
        assert fresh.batch_get_v2(indexer(keys[:1], dst))[PoolName.INDEXER] == [False]
        assert fresh.batch_get_v1(keys[:1], dst) == [False]
        assert exists_v2(b, keys[-4:]).kv_hit_pages == 4


def test_two_tp_ranks_under_mlas_one_writer(daemon):
    pools0, pools1 = HostPools(), HostPools()
    rank0 = make_backend(pools0, extra(daemon), tp_rank=0, tp_size=2)
    rank1 = make_backend(pools1, extra(daemon), tp_rank=1, tp_size=2)
    keys = page_keys(3, salt=17)
    src = pools1.alloc(3)
    pools1.fill(src, seed=5)
    assert rank1.batch_set_v2(indexer(keys, src))[PoolName.INDEXER] == [False] * 3   # not the writer
    assert rank1.batch_set_v1(keys, src) == [False] * 3
    assert rank0.batch_exists(keys) == 0 and rank1.batch_exists(keys) == 0
    src0 = pools0.alloc(3)
    pools0.fill(src0, seed=5)
    want = pools0.snapshot(src0)
    store(rank0, keys, src0)
    assert rank1.batch_exists(keys) == 3                       # every rank reads the writer's units
    dst = pools1.alloc(3)
    assert load(rank1, keys, dst) == ([True] * 3, [True] * 3)
    assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(pools1.snapshot(dst), want))


def test_tenants_and_pipeline_stages_never_share_units(daemon):
    keys = page_keys(2, salt=19)
    a = HostPools()
    ba = make_backend(a, extra(daemon))
    idx = a.alloc(2)
    a.fill(idx, seed=6)
    store(ba, keys, idx)
    assert make_backend(HostPools(), extra(daemon, token=TOKEN_B)).batch_exists(keys) == 0
    assert make_backend(HostPools(24, 28), extra(daemon)).batch_exists(keys) == 0      # stage 24-27, same keys
    assert make_backend(HostPools(), extra(daemon, model_name="other-model")).batch_exists(keys) == 0


def test_disk_units_survive_a_daemon_restart(tmp_path):
    args = ["--device", "cpu", "--host-memory", "16MiB", "--disk-path", str(tmp_path / "disk"), "--disk-size", "64MiB"]
    d = DaemonProcess(f"unix://{tmp_path}/r.sock", extra_args=args)
    d.start()
    try:
        pools = HostPools()
        keys = page_keys(4, salt=23)
        idx = pools.alloc(4)
        pools.fill(idx, seed=7)
        want = pools.snapshot(idx)
        store(make_backend(pools, {"address": d.address}), keys, idx)
        d.stop()
        d.start()
        b = make_backend(pools, {"address": d.address})
        assert exists_v2(b, keys).kv_hit_pages == 4
        dst = pools.alloc(4)
        assert load(b, keys, dst) == ([True] * 4, [True] * 4)
        assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(pools.snapshot(dst), want))
    finally:
        d.stop()
        d.cleanup()


def test_bad_keys_and_sizes_give_false_and_store_nothing(daemon):
    pools = HostPools()
    b = make_backend(pools, extra(daemon))
    idx = pools.alloc(3)
    pools.fill(idx, seed=8)
    keys = page_keys(3, salt=29)
    assert b.batch_set_v1(["", keys[1], "x" * 300], idx) == [False, True, False]
    assert b.batch_set_v1(keys, idx[:PS + 1]) == [False] * 3                   # not 3 whole pages
    assert b.batch_set_v2(indexer(keys, idx[:-PS]))[PoolName.INDEXER] == [False] * 3
    assert b.batch_get_v1(keys, idx[:PS]) == [False] * 3
    assert b.batch_exists(["", keys[1]]) == 0 and b.batch_exists([keys[1]]) == 0   # KV of keys[1] alone: a half
    assert b.set(keys[0], torch.zeros(7, dtype=torch.uint8)) is False
    assert b.get(keys[0], torch.zeros(7, dtype=torch.uint8)) is None
    assert b.batch_set_v2([indexer(keys, idx)[0].__class__(name=PoolName.MAMBA, host_indices=idx, keys=keys)]) == \
        {PoolName.MAMBA: [False] * 3}


def test_an_unreachable_daemon_is_a_miss_never_an_exception(tmp_path):
    pools = HostPools()
    b = make_backend(pools, {"address": f"unix://{tmp_path}/nobody.sock", "timeout_s": 2})
    keys = page_keys(2, salt=31)
    idx = pools.alloc(2)
    assert exists_v2(b, keys).kv_hit_pages == 0 and not b.exists(keys[0])
    assert b.batch_set_v1(keys, idx) == [False, False]
    assert load(b, keys, idx) == ([False, False], [False, False])
    assert b.clear() is False


def test_settings_and_layouts_it_cannot_store_are_refused_clearly(daemon):
    with pytest.raises(ValueError, match="unknown extra-config keys"):
        make_backend(HostPools(), extra(daemon, adress="typo"))
    with pytest.raises(ValueError, match="attach channel"):
        make_backend(HostPools(), extra(daemon, transport="shm"))
    with pytest.raises(ValueError, match="page_first_direct"):
        make_backend(HostPools(layout="layer_first"), extra(daemon))


def test_legacy_get_and_set_of_flat_pages(daemon):
    pools = HostPools(layout="page_first")
    b = make_backend(pools, extra(daemon))
    (key,) = page_keys(1, salt=37)
    idx = pools.alloc(1)
    pools.fill(idx, seed=9)
    page = pools.kv.get_data_page(idx[0], flat=True).clone()
    assert b.batch_set_v2(indexer([key], idx))[PoolName.INDEXER] == [True]
    assert b.set(key, page) is True
    target = pools.kv.get_dummy_flat_data_page()
    assert b.get(key, target) is target and torch.equal(target, page)
    assert b.clear() is True and b.batch_exists([key]) == 0
