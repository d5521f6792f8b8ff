"""The Mooncake Store tier against a real ``mooncake_master`` on 127.0.0.1 (fixture ``mooncake_master``
of kvtier's pytest plugin): byte-exact put/get, batch presence, damaged and foreign objects, other
models' keys, a master that dies and comes back."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import PagedTokenAllocator, create_pool
from kvtier.server.tiers import PrefixCache, RecordCodec, TierFullError, TierStack, TierUnavailableError
from kvtier.server.tiers.mooncake_store import MooncakeStoreTier, MooncakeStoreTierConfig
from kvtier.server.tiers.record import verify_record

from tierkit import fill_page, keys_for, read_page, record_of, verify_same_page

MiB = 1 << 20


def tier_config(master, **kw) -> MooncakeStoreTierConfig:
    """A small tier on ``master``, with a key prefix of its own so tests never see each other's objects."""
    base = dict(master=master.master, metadata=master.metadata, global_segment_bytes=64 * MiB,
                staging_bytes=4 * MiB, max_object_bytes=512 * 1024, key_prefix=f"t{uuid.uuid4().hex[:8]}/")
    base.update(kw)
    return MooncakeStoreTierConfig(**base)


@pytest.fixture
def open_tier(mooncake_master):
    tiers = []

    def make(**kw) -> MooncakeStoreTier:
        t = MooncakeStoreTier(tier_config(mooncake_master, **kw))
        t.open()
        tiers.append(t)
        return t

    yield make
    for t in tiers:
        t.close()


def probe_until_healthy(tier: MooncakeStoreTier, timeout_s: float = 60.0) -> None:
    """Probe like the daemon's monitor does until a probe succeeds (clients remount their segments
    a moment after a master restart: puts answer NO_AVAILABLE_HANDLE until then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            tier.probe()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        tier.health.mark_healthy()
        return


def shared_keys(n: int, seed: int = 0) -> list[bytes]:
    return [b"p:" + bytes.fromhex("ab" * 8) + k for k in keys_for(n, seed)]


def records(codec, pool, n: int, seed: int = 0) -> list[torch.Tensor]:
    return [record_of(codec, pool, 1 + i, seed * 100 + i).clone() for i in range(n)]


def test_put_get_byte_exact_and_presence_comes_from_the_store(open_tier, codec, pool):
    a = open_tier()
    keys, recs = shared_keys(6), records(codec, pool, 6)
    assert a.contains(keys) == [False] * 6
    assert a.write(list(zip(keys[:4], recs[:4]))) == keys[:4]
    assert a.contains(keys) == [True] * 4 + [False] * 2
    assert a.lookup(keys) == 4
    outs = [torch.zeros(r.numel() + 100, dtype=torch.uint8) for r in recs]
    assert a.read_into(keys, outs) == [r.numel() for r in recs[:4]] + [0, 0]
    for o, r in zip(outs, recs[:4]):
        assert torch.equal(o[:r.numel()], r)
    with a.borrow(keys) as got:
        assert [g is not None and torch.equal(g, r) for g, r in zip(got, recs)] == [True] * 4 + [False] * 2
    # a second client of the same store (another daemon) sees them, with nothing in its own ledger
    b = open_tier(key_prefix=a.config.key_prefix)
    assert b.contains(keys) == [True] * 4 + [False] * 2 and len(b.index) == 0
    with b.borrow(keys[:4]) as got:
        assert all(torch.equal(g, r) for g, r in zip(got, recs))
    s = a.stats()
    assert (s.writes, s.entries, s.used_bytes) == (4, 4, sum(r.numel() for r in recs[:4]))
    assert s.extra["healthy"] == 1


def test_batch_presence_and_reads_larger_than_one_store_call(open_tier, codec, pool):
    t = open_tier(max_batch_keys=3, staging_bytes=1 * MiB)
    keys, recs = shared_keys(11, seed=1), records(codec, pool, 11, seed=1)
    assert t.write(list(zip(keys, recs))) == keys  # 4 store calls; staging holds 5 records at a time
    assert t.contains(keys) == [True] * 11
    with t.borrow(keys) as got:  # more than one extent holds: copied out group by group
        assert all(torch.equal(g, r) for g, r in zip(got, recs))
    assert t.borrow_batch >= 1


def test_first_writer_wins_and_replace_overwrites(open_tier, codec, pool):
    t = open_tier()
    key, (r1, r2) = shared_keys(1, seed=2)[0], records(codec, pool, 2, seed=2)
    assert t.write([(key, r1)]) == [key]
    t.write([(key, r2)])  # present: kept
    with t.borrow([key]) as (got,):
        assert torch.equal(got, r1)
    assert t.write([(key, r2)], replace=True) == [key]
    with t.borrow([key]) as (got,):
        assert torch.equal(got, r2)


def test_damaged_object_is_a_miss_counted_and_removed(open_tier, codec, pool):
    t = open_tier()
    key, rec = shared_keys(1, seed=3)[0], records(codec, pool, 1, seed=3)[0]
    bad = rec.clone()
    bad[rec.numel() // 2] ^= 0xFF  # one flipped byte in the payload
    with t.staging.extent(bad.numel()) as ext:  # put the damaged bytes with the store's own call
        ext.view[:bad.numel()].copy_(bad)
        assert t.client.put_from([t.store_key(key)], [ext.ptr], [bad.numel()], t._replicate) == [0]
    assert t.contains([key]) == [True]
    out = torch.empty(rec.numel(), dtype=torch.uint8)
    assert t.read_into([key], [out]) == [0]
    assert t.stats().damaged == 1
    assert t.contains([key]) == [False]  # removed from the store


def test_damaged_object_never_reaches_the_pool(open_tier, model, codec, pool):
    """Scenario: a page's object is damaged in the store (one flipped byte). A prefix load borrows it
    (unchecked, like host-tier records) and checks it before copying: a failed load, the page is
    handed out fresh, the object is counted damaged and removed; no byte of it lands in the pool."""
    t = open_tier()
    cache = PrefixCache(TierStack([t]), PagedTokenAllocator(pool.size, 64), codec, pool=pool,
                        namespace=b"p:" + bytes.fromhex(model.fingerprint_digest()))
    page_key = keys_for(1, seed=11)[0]
    rec = record_of(codec, pool, 5, seed=11).clone()
    rec[rec.numel() - 100] ^= 0x01
    with t.staging.extent(rec.numel()) as ext:
        ext.view[:rec.numel()].copy_(rec)
        assert t.client.put_from([t.store_key(cache._tier_key(page_key))], [ext.ptr], [rec.numel()], t._replicate) == [0]
    assert cache.lookup([page_key]).tiers == ["mooncake"]
    for p in range(1, pool.num_pages):
        pool.index_k_with_scale_buffer[0][p].zero_()
    ld = cache.load([page_key])
    assert ld.tiers == [] and cache.counters["failed_loads"] == 1
    assert t.stats().damaged == 1 and t.contains([cache._tier_key(page_key)]) == [False]
    page = int(ld.slots[0]) // 64
    assert int(pool.index_k_with_scale_buffer[0][page].sum()) == 0  # nothing of the damaged record copied
    cache.release(ld.lease)


def test_bytes_that_are_no_record_are_a_miss(open_tier):
    t = open_tier()
    key = shared_keys(1, seed=4)[0]
    junk = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    with t.staging.extent(5000) as ext:
        ext.view[:5000].copy_(junk)
        assert t.client.put_from([t.store_key(key)], [ext.ptr], [5000], t._replicate) == [0]
    assert t.read_into([key], [torch.empty(8192, dtype=torch.uint8)]) == [0]
    assert t.stats().damaged == 1 and t.contains([key]) == [False]


def test_keys_outside_the_shared_namespaces_never_reach_the_store(open_tier, codec, pool):
    t = open_tier()
    rec = records(codec, pool, 1)[0]
    with pytest.raises(ValueError, match="namespaces"):
        t.write([(b"o:req-17", rec)])
    assert t.contains([b"o:req-17"]) == [False]
    with t.borrow([b"o:req-17"]) as (got,):
        assert got is None


def test_tenant_keys_prefix_pages_of_every_tenant_reach_the_store_offloaded_copies_never(open_tier, codec, pool):
    """Scenario: the daemon's keys carry the tenant before the namespace (``tenant_key``), and the daemon
    tells the tier where the namespace starts (``set_key_body(key_body)``). Prefix pages of tenants a
    and b both go to the store, under store keys that differ by tenant (b's key for a's page is a
    miss); offloaded copies (``o:`` past the tenant) are refused and miss without a store call. Without
    the key body, a tenant key is not a ``p:`` key (the filter does not guess)."""
    from kvtier.server.daemon.tenants import key_body, tenant_key

    t = open_tier()
    t.set_key_body(key_body)
    page = b"p:" + bytes.fromhex("cd" * 8) + keys_for(1, seed=12)[0]
    ka, kb = tenant_key("a", page), tenant_key("team-b", page)
    ra, rb = records(codec, pool, 2, seed=12)
    assert t.is_shared_key(ka) and t.is_shared_key(kb) and t.store_key(ka) != t.store_key(kb)
    assert t.write([(ka, ra)]) == [ka]
    assert t.contains([ka, kb]) == [True, False]
    assert t.write([(kb, rb)]) == [kb]
    with t.borrow([ka, kb]) as (got_a, got_b):
        assert torch.equal(got_a, ra) and torch.equal(got_b, rb)
    copy_key = tenant_key("a", b"o:req-17")
    assert not t.is_shared_key(copy_key)
    with pytest.raises(ValueError, match="namespaces"):
        t.write([(copy_key, ra)])
    reads = t.stats().hits + t.stats().misses
    assert t.contains([copy_key]) == [False]
    with t.borrow([copy_key]) as (got,):
        assert got is None
    assert t.stats().hits + t.stats().misses == reads + 1  # counted as a miss, no store call needed
    plain = open_tier(key_prefix=t.config.key_prefix)
    assert not plain.is_shared_key(ka) and plain.contains([ka]) == [False]


def test_stats_answer_while_the_ledger_index_lock_is_held(open_tier, codec, pool):
    """Lock order (README "Concurrency"): the Mooncake tier's stats are monitoring and take only the
    counter lock (the ledger's integers are read without its lock), so with the index lock held
    elsewhere (a write noting its objects) stats still answer, showing the ledger as it was."""
    import threading

    t = open_tier()
    key, rec = shared_keys(1, seed=13)[0], records(codec, pool, 1, seed=13)[0]
    assert t.write([(key, rec)]) == [key]
    held, release = threading.Event(), threading.Event()

    def writer_in_progress():
        with t.index.lock:
            held.set()
            release.wait(30)

    w = threading.Thread(target=writer_in_progress, daemon=True)
    w.start()
    assert held.wait(10)
    out: list = []
    try:
        r = threading.Thread(target=lambda: out.append(t.stats()), daemon=True)
        r.start()
        r.join(20)
        assert not r.is_alive(), "mooncake tier stats() waited for the index lock"
        assert (out[0].entries, out[0].used_bytes, out[0].writes) == (1, rec.numel(), 1)
        assert out[0].extra["healthy"] == 1
    finally:
        release.set()
        w.join(10)


def test_store_prefix_leaves_out_keys_of_namespaces_the_tier_does_not_keep(open_tier, model, codec, pool):
    """Regression: a tier configured for other namespaces (``namespaces=["x:"]``) made the publish at
    StorePrefix hand it prefix pages, whose write raised ValueError (a client saw INVALID_ARGUMENT for
    the daemon's configuration). Now the publish leaves them out: the store succeeds, nothing is
    published, the pages stay on the device."""
    t = open_tier(namespaces=("x:",))
    cache = PrefixCache(TierStack([t]), PagedTokenAllocator(pool.size, 64), codec, pool=pool,
                        namespace=b"p:" + bytes.fromhex(model.fingerprint_digest()))
    keys = keys_for(2, seed=14)
    ld = cache.load(keys)
    assert cache.store(ld.lease, keys, ld.slots) == 2
    cache.release(ld.lease)
    assert "device->mooncake" not in cache.stack.moves and t.stats().writes == 0
    assert cache.lookup(keys).tiers == ["device", "device"]


def test_record_above_max_object_bytes_is_tier_full(open_tier):
    t = open_tier(max_object_bytes=4096, staging_bytes=64 * 1024)
    with pytest.raises(TierFullError, match="max_object_bytes"):
        t.write([(shared_keys(1)[0], torch.zeros(5000, dtype=torch.uint8))])


def test_a_full_store_raises_tier_full(mooncake_master, codec, pool):
    """Scenario: the only segment (16 MiB, the store's minimum) fills up faster than the master evicts
    (it evicts at a 90% high watermark, in the background): puts answer NO_AVAILABLE_HANDLE, which is
    TierFullError; the tier stays healthy."""
    t = MooncakeStoreTier(tier_config(mooncake_master, global_segment_bytes=16 * MiB))
    t.open()
    try:
        recs = records(codec, pool, 10, seed=5)
        keys = shared_keys(400, seed=5)
        with pytest.raises(TierFullError, match="no room"):
            for i in range(0, 400, 10):  # 400 records of 194,048 bytes: 78 MB into 16 MiB
                t.write(list(zip(keys[i:i + 10], recs)))
        assert t.health.healthy and t.stats().full_errors >= 1
    finally:
        t.close()


def test_another_models_keys_and_records_are_misses(open_tier, model, pool, codec):
    """Two prefix caches (two daemons) over one store: pages of GLM-5.2's first 4 layers are stored by
    one; a cache of another layer count asks for the same page keys and misses (its namespace differs);
    a foreign record under this model's key is a failed load (damaged), never loaded."""
    shared = open_tier()
    other_tier = open_tier(key_prefix=shared.config.key_prefix)
    a = PrefixCache(TierStack([shared]), PagedTokenAllocator(pool.size, 64), codec, pool=pool,
                    namespace=b"p:" + bytes.fromhex(model.fingerprint_digest()))
    keys = keys_for(3, seed=6)
    ld = a.load(keys)
    written = [fill_page(pool, int(ld.slots[i * 64]) // 64, seed=60 + i) for i in range(3)]
    a.store(ld.lease, keys, ld.slots)
    a.release(ld.lease)
    assert shared.contains([a._tier_key(k) for k in keys]) == [True] * 3
    assert a.stack.moves["device->mooncake"]["count"] == 3

    model8 = DSAModelConfig.from_preset("glm-5.2", num_layers=8)
    pool8 = create_pool(model8, 8 * 64, device="cpu")
    b = PrefixCache(TierStack([other_tier]), PagedTokenAllocator(pool8.size, 64), RecordCodec.for_pool(model8, pool8),
                    pool=pool8, namespace=b"p:" + bytes.fromhex(model8.fingerprint_digest()))
    assert b.lookup(keys).tiers == []

    # a third cache of the same model loads them byte-exact from the store
    pool_c = create_pool(model, 8 * 64, device="cpu")
    c = PrefixCache(TierStack([other_tier]), PagedTokenAllocator(pool_c.size, 64), RecordCodec.for_pool(model, pool_c),
                    pool=pool_c, namespace=a.namespace)
    assert c.lookup(keys).tiers == ["mooncake"] * 3
    ld = c.load(keys)
    assert ld.tiers == ["mooncake"] * 3
    for i in range(3):
        verify_same_page(read_page(pool_c, int(ld.slots[i * 64]) // 64), written[i])
    c.release(ld.lease)

    # the model-8 record put under the 4-layer model's key: present, but a failed load
    foreign = RecordCodec.for_pool(model8, pool8).encode_page(pool8, 1)
    verify_record(foreign)
    key = keys_for(1, seed=7)[0]
    assert other_tier.write([(c._tier_key(key), foreign)]) == [c._tier_key(key)]
    assert c.lookup([key]).tiers == ["mooncake"]
    ld = c.load([key])
    assert ld.tiers == [] and c.counters["failed_loads"] == 1
    assert other_tier.stats().damaged == 1
    c.release(ld.lease)


def test_master_killed_lookups_miss_and_restart_recovers(mooncake_master, open_tier, codec, pool):
    """Scenario: the master dies. Lookups and reads are misses (nothing raises), a write raises
    TierUnavailableError without a store call (the faults contract: the stack's publish skips it and
    counts it); the tier is unhealthy and the stack bypasses it. The master comes back (empty): the
    probe succeeds, the tier is healthy again and serves new objects."""
    t = open_tier()
    stack = TierStack([t])
    keys, recs = shared_keys(3, seed=8), records(codec, pool, 3, seed=8)
    assert t.write(list(zip(keys, recs))) == keys
    mooncake_master.kill()
    assert t.contains(keys) == [False] * 3
    assert not t.health.healthy and "RPC_FAIL" in t.health.snapshot().reason
    assert stack.where(keys) == [[], [], []]
    with t.borrow(keys) as got:
        assert got == [None] * 3
    with pytest.raises(TierUnavailableError, match="RPC_FAIL") as err:
        t.write(list(zip(keys, recs)))
    assert err.value.tier == "mooncake" and err.value.written == ()
    assert t.stats().extra["write_failures"] == 3
    with pytest.raises(Exception):
        t.probe()
    mooncake_master.start()
    probe_until_healthy(t)  # the client remounts by itself; then a probe object goes through
    assert t.contains(keys) == [False] * 3  # a restarted master has lost every object
    assert t.write(list(zip(keys, recs))) == keys
    with t.borrow(keys) as got:
        assert all(torch.equal(g, r) for g, r in zip(got, recs))


def test_no_master_at_open_starts_unhealthy_and_probe_sets_up_later(codec, pool):
    """Scenario: the daemon starts before the master. ``open`` does not hang (setup would block the
    whole process in the client's retries) nor raise: the tier is unhealthy; once a master answers
    on that address, the probe sets the client up."""
    from kvtier.mooncake_master import MooncakeMaster

    m = MooncakeMaster()
    try:
        t = MooncakeStoreTier(tier_config(m))
        t.open()
        assert not t.health.healthy and "unreachable" in t.health.snapshot().reason
        assert t.contains(shared_keys(1)) == [False]
        m.start()
        probe_until_healthy(t)
        key, rec = shared_keys(1, seed=9)[0], records(codec, pool, 1, seed=9)[0]
        assert t.write([(key, rec)]) == [key]
        t.close()
    finally:
        m.cleanup()


@pytest.mark.parametrize("bad, match", [
    ({"master": "nohost"}, "HOST:PORT"),
    ({"metadata": "etcd://x:1"}, "P2PHANDSHAKE"),
    ({"protocol": "udp"}, "protocol"),
    ({"replicas": 0}, "replicas"),
    ({"soft_pin_ttl_ms": 1000}, "soft_pin"),
    ({"max_batch_keys": 5000}, "max_batch_keys"),
    ({"staging_bytes": 1024, "max_object_bytes": 4096}, "staging_bytes"),
])
def test_config_errors_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        MooncakeStoreTierConfig(**bad).validate()


def test_records_built_in_staged_memory_are_put_without_a_copy(open_tier, codec, pool):
    """``staged`` lends registered memory; a page encoded there (``encode_page(out=...)``, what the
    prefix cache's publish does) is put from where it lies and reads back as the same bytes as a page
    encoded into fresh memory."""
    t = open_tier()
    keys = shared_keys(3, seed=10)
    for page in (1, 2, 3):
        fill_page(pool, page, seed=100 + page)
    expected = [codec.encode_page(pool, p) for p in (1, 2, 3)]
    with t.staged([codec.page_nbytes()] * 3) as bufs:
        assert len(bufs) == 3 and all(t.staging.offset_of(b) is not None for b in bufs)
        recs = [codec.encode_page(pool, p, out=b) for p, b in zip((1, 2, 3), bufs)]
        assert all(torch.equal(r, e) for r, e in zip(recs, expected))
        free_inside = t.staging.free_bytes
        assert t.write(list(zip(keys, recs))) == keys
        assert t.staging.free_bytes == free_inside  # no second extent was needed for a copy
    with t.borrow(keys) as got:
        assert all(torch.equal(g, e) for g, e in zip(got, expected))
    with t.staged([t.config.max_object_bytes + 1]) as bufs:
        assert bufs == []
    with pytest.raises(ValueError, match="at least"):
        codec.encode_page(pool, 1, out=torch.empty(100, dtype=torch.uint8))
