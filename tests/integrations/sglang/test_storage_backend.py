"""kvtier as SGLang's HiCache storage backend, against SGLang 0.5.23's own classes and a real daemon.

The backend is created by SGLang's ``StorageBackendFactory`` (``dynamic``) from SGLang's
``HiCacheStorageConfig``, attached to SGLang's own host pools (``MLATokenToKVPoolHost`` with 656-byte
fp8 rows, ``DSAIndexerPoolHost``) of GLM-5.2 layers 20-23 (only 22 runs the indexer), and called the
way SGLang's cache controller calls it (``PoolTransfer``, ``PoolName.INDEXER``, indexer before KV on
writes, KV before indexer on reads). Keys are SGLang's own chained page hashes. Expected bytes are the
host pages' own bytes before they were zeroed; the unit's KV part is checked against an independent
transposition of the ``page_first`` host page.

Every check runs over both data paths: ``shm`` (the daemon on a unix socket: the backend picks shared
memory by itself, page bytes in a storage session's staging buffers) and ``grpc`` (gRPC streams:
told ``transport = "grpc"``; its daemon also on a unix socket, since a token goes over no plaintext
TCP port, and on 127.0.0.1 where no token is used). The daemon's counters say which way the bytes went.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import torch
from hosts import PS, HostPools, indexer, load, make_backend, page_keys, store
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

from kvtier.client import KVTierClient, KVTierError
from kvtier.client.spawn import DaemonProcess
from kvtier.integrations.sglang import KVTierStorage

TOKEN_A = "sglang-tenant-a-0123456789abcdef"
TOKEN_B = "sglang-tenant-b-0123456789abcdef"


def tokens_file(path):
    path.write_text(f'[tokens]\n"{TOKEN_A}" = "team-a"\n"{TOKEN_B}" = "team-b"\n')
    os.chmod(path, 0o600)
    return path


TRANSPORTS = ["shm", "grpc"]


def listen(tmp, transport: str, name: str = "kv") -> str:
    """Where a test daemon listens: a unix socket, for either transport (a token goes over no
    plaintext TCP port, loopback included: attack pass 6, A6-1); the backend of a ``grpc`` daemon is
    told ``transport = "grpc"`` (:func:`extra`)."""
    return f"unix://{tmp}/{name}-{transport}.sock"


def start(tmp, transport: str, args, name: str = "kv") -> DaemonProcess:
    d = DaemonProcess(listen(tmp, transport, name), allow_unauthenticated=True, extra_args=args)
    d.start()
    d.transport = transport
    return d


@pytest.fixture(scope="module", params=TRANSPORTS)
def daemon(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sgl")
    args = ["--device", "cpu", "--auth-tokens", str(tokens_file(tmp / "tokens.toml")), "--host-memory", "64MiB",
            "--disk-path", str(tmp / "disk"), "--disk-size", "128MiB"]
    d = start(tmp, request.param, args)
    yield d
    d.stop()
    d.cleanup()


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return request.param


def extra(d, token=TOKEN_A, **more):
    chosen = {"transport": "grpc"} if d.transport == "grpc" else {}  # shm: "auto", as SGLang users run it
    return {"address": d.address, "token": token, "timeout_s": 30, **chosen, **more}


def unit_counters(d, token=TOKEN_A) -> dict[str, int]:
    with KVTierClient(d.address, token=token) as c:
        return c.unit_stats()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def delta(after: dict, before: dict, key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def exists_v2(backend, keys):
    return backend.batch_exists_v2(keys, indexer(keys, None, hit_policy=PoolHitPolicy.ALL_PAGES))


def test_the_factory_builds_it_from_sglangs_config(daemon):
    pools = HostPools()
    b = make_backend(pools, extra(daemon))
    assert type(b) is KVTierStorage and b.transport.name == daemon.transport      # transport auto picks by address
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


def test_a_page_evicted_inside_kvtier_shows_neither_kv_nor_indexer(tmp_path, transport):
    # host tier of 2 MiB, no disk: 6 units of ~177 KB fit, 20 do not; the oldest are evicted whole
    with DaemonProcess(listen(tmp_path, transport, "ev"), allow_unauthenticated=True, extra_args=["--device", "cpu", "--host-memory", "2MiB"]) as d:
        pools = HostPools()
        b = make_backend(pools, {"address": d.address, "transport": transport})
        keys = page_keys(20, salt=13)
        idx = pools.alloc(20)
        pools.fill(idx, seed=4)
        for i in range(0, 20, 4):
            store(b, keys[i:i + 4], idx[i * PS:(i + 4) * PS])
        r = exists_v2(b, keys[:1])
        assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (0, {})
        fresh = make_backend(pools, {"address": d.address, "transport": transport})  # nothing delivered before here
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


def test_disk_units_survive_a_daemon_restart(tmp_path, transport):
    """Units on disk come back after a restart, to a new backend and to the one that wrote them
    (whose storage session died with the daemon: it opens another by itself)."""
    args = ["--device", "cpu", "--host-memory", "16MiB", "--disk-path", str(tmp_path / "disk"), "--disk-size", "64MiB"]
    address = f"unix://{tmp_path}/r.sock" if transport == "shm" else f"127.0.0.1:{free_port()}"  # the same after restart
    d = DaemonProcess(address, allow_unauthenticated=True, extra_args=args)
    d.start()
    try:
        pools = HostPools()
        keys = page_keys(4, salt=23)
        idx = pools.alloc(4)
        pools.fill(idx, seed=7)
        want = pools.snapshot(idx)
        writer = make_backend(pools, {"address": d.address})
        store(writer, keys, idx)
        d.stop()
        d.start()
        b = make_backend(pools, {"address": d.address})
        assert exists_v2(b, keys).kv_hit_pages == 4
        for reader in (b, writer):
            dst = pools.alloc(4)
            assert load(reader, keys, dst) == ([True] * 4, [True] * 4)
            assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(pools.snapshot(dst), want))
        assert b.transport.name == writer.transport.name == transport
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
    with pytest.raises(ValueError, match="transport must be one of"):
        make_backend(HostPools(), extra(daemon, transport="rdma"))
    # new-user pass: a string timeout was called "not > 0", a number as address was accepted
    with pytest.raises(ValueError, match="timeout_s must be a number"):
        make_backend(HostPools(), extra(daemon, timeout_s="30"))
    with pytest.raises(ValueError, match="address must be a string"):
        make_backend(HostPools(), extra(daemon, address=5))
    with pytest.raises(ValueError, match="number of bytes"):
        make_backend(HostPools(), extra(daemon, staging_bytes="256MiB"))
    with pytest.raises(ValueError, match="unix socket"):   # a TCP address: shared memory is impossible, said at startup
        make_backend(HostPools(), {"address": "127.0.0.1:1", "transport": "shm"})
    with pytest.raises(ValueError, match="in plaintext"):  # attack pass 6, A6-1: no token over plaintext TCP
        make_backend(HostPools(), {"address": "127.0.0.1:1", "token": TOKEN_A, "transport": "grpc"})
    assert make_backend(HostPools(), extra(daemon, transport="shm")).transport.name == "shm"
    assert make_backend(HostPools(), extra(daemon, transport="grpc")).transport.name == "grpc"
    assert make_backend(HostPools(), extra(daemon, transport="auto")).transport.name == "shm"  # a unix socket
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


def test_page_bytes_go_the_transports_way_and_never_both(daemon):
    """On a unix socket the backend moves page bytes through shared memory: the daemon counts every
    byte it received and sent for units as ``staged``, and not one as ``stream`` (gRPC messages). On
    TCP it is the other way round. Expected bytes: SGLang's page sizes (4 layers x 64 x 656 KV,
    one live indexer layer of 8448 bytes), independent of the backend's own figures."""
    kv, ix = 4 * PS * 656, 1 * 8448
    pools = HostPools()
    b = make_backend(pools, extra(daemon))
    keys = page_keys(6, salt=43)
    src = pools.alloc(6)
    pools.fill(src, seed=12)
    want = pools.snapshot(src)
    before = unit_counters(daemon)
    store(b, keys, src)
    dst = pools.alloc(6)
    assert load(b, keys, dst) == ([True] * 6, [True] * 6)
    assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(pools.snapshot(dst), want))
    after = unit_counters(daemon)
    moved = {k: delta(after, before, k) for k in ("put_bytes_stream", "put_bytes_staged", "get_bytes_stream",
                                                   "get_bytes_staged")}
    way, other = ("staged", "stream") if daemon.transport == "shm" else ("stream", "staged")
    assert moved[f"put_bytes_{way}"] == 6 * (kv + ix) and moved[f"get_bytes_{way}"] == 6 * (kv + ix)
    assert moved[f"put_bytes_{other}"] == 0 and moved[f"get_bytes_{other}"] == 0
    if daemon.transport == "shm":
        assert b.transport.grpc_calls == 0 and b.transport.staged_calls == 3   # 2 puts (indexer, KV) + 1 get


def test_threads_each_get_a_staging_buffer_and_more_threads_fall_back_to_grpc(daemon):
    """Six threads set and read their own pages at once (SGLang's backup and prefetch threads do, on
    one backend): with shared memory, four hold a staging buffer each (the backend's limit) and the
    rest go over gRPC (transport auto); every page comes back byte-exact either way."""
    pools = HostPools(size=2048)
    b = make_backend(pools, extra(daemon))
    jobs = []
    for t in range(6):
        keys = page_keys(2, salt=100 + t)
        src = pools.alloc(2)
        pools.fill(src, seed=100 + t)
        jobs.append((keys, src, pools.alloc(2), pools.snapshot(src)))
    go, errors, results = threading.Barrier(6), [], {}

    def work(t):
        keys, src, dst, _ = jobs[t]
        try:
            go.wait(60)
            store(b, keys, src)
            results[t] = load(b, keys, dst)
            go.wait(60)       # every thread still holds its buffer until all are done
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert errors == [] and all(results[t] == ([True] * 2, [True] * 2) for t in range(6))
    for keys, src, dst, want in jobs:
        assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(pools.snapshot(dst), want))
    if daemon.transport == "shm":
        assert b.transport.staged_calls == 4 * 3 and b.transport.grpc_calls == 2 * 3


def test_a_unit_larger_than_a_staging_buffer_is_false_under_shm_and_grpc_under_auto(tmp_path):
    """``staging_bytes`` 4096: no unit fits a staging buffer. ``transport: shm`` answers False and
    misses (a log line, never an exception into SGLang) and stores nothing; ``auto`` sends the same
    pages over gRPC and they come back byte-exact."""
    daemon = start(tmp_path, "shm", ["--device", "cpu", "--host-memory", "16MiB"], "big")
    try:
        _unit_larger_than_a_buffer(daemon)
    finally:
        daemon.stop()
        daemon.cleanup()


def _unit_larger_than_a_buffer(daemon) -> None:
    keys = page_keys(2, salt=47)
    pools = HostPools()
    src = pools.alloc(2)
    pools.fill(src, seed=14)
    want = pools.snapshot(src)
    strict = make_backend(pools, {"address": daemon.address, "transport": "shm", "staging_bytes": 4096})
    assert strict.batch_set_v2(indexer(keys, src))[PoolName.INDEXER] == [False, False]
    assert strict.batch_set_v1(keys, src) == [False, False] and strict.batch_exists(keys) == 0
    auto = make_backend(pools, {"address": daemon.address, "staging_bytes": 4096})
    store(auto, keys, src)
    dst = pools.alloc(2)
    assert load(strict, keys, dst) == ([False, False], [False, False])
    assert load(auto, keys, dst) == ([True, True], [True, True])
    assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(pools.snapshot(dst), want))
    # one page a call (no two fit 4096 bytes): 2 indexer puts, 2 KV puts, 2 gets, all over gRPC
    assert auto.transport.grpc_calls == 6 and auto.transport.staged_calls == 0


def test_after_a_sigkill_and_restart_the_next_call_goes_through_shared_memory_again(tmp_path, monkeypatch):
    """Scenario (adversarial finding 08, ``sigkill``): the daemon is SIGKILLed under the backend; the
    backend's storage-session handshake fails while it is down and waits ``REOPEN_AFTER_S`` before the
    next try, restarted by every failed try, so after the restart the backend stayed on gRPC (0
    sessions for 4+ s). Now the first gRPC call that reaches the restarted daemon lets the next call
    open a session at once. The wait is made an hour here, so only that can bring shared memory back."""
    from kvtier.integrations.sglang import transport as transport_module

    monkeypatch.setattr(transport_module, "REOPEN_AFTER_S", 3600.0)
    d = DaemonProcess(f"unix://{tmp_path}/k.sock", extra_args=["--device", "cpu", "--host-memory", "16MiB"])
    d.start()
    try:
        pools = HostPools()
        b = make_backend(pools, {"address": d.address, "timeout_s": 5})
        idx = pools.alloc(2)
        pools.fill(idx, seed=14)
        store(b, page_keys(2, salt=51), idx)
        assert b.transport.name == "shm" and b.transport.staged_calls == 2
        d.signal(signal.SIGKILL)
        d.wait(60)
        assert b.batch_set_v1(page_keys(2, salt=52), idx) == [False, False]   # down: the handshake fails
        d.start()
        keys = page_keys(2, salt=53)
        space = b._stage()
        for _ in range(600):      # until a gRPC call reaches the restarted daemon (its channel reconnects)
            try:
                assert b.transport.exists(space, [k.encode() for k in keys]) == 0
                break
            except KVTierError:
                time.sleep(0.1)
        else:
            raise AssertionError("the backend's gRPC channel never reached the restarted daemon")
        staged = b.transport.staged_calls
        store(b, keys, idx)
        assert b.transport.staged_calls == staged + 2
        counters = unit_counters(d, token=None)
        assert counters.get("put_bytes_staged", 0) > 0 and counters.get("put_bytes_stream", 0) == 0
        want = pools.snapshot(idx)
        dst = pools.alloc(2)
        assert load(b, keys, dst) == ([True] * 2, [True] * 2)
        assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(pools.snapshot(dst), want))
    finally:
        d.stop()
        d.cleanup()
