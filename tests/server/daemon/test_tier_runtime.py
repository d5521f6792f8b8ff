"""The tier runtime in process: monitoring never waits for a pool lock, prefix namespaces per tenant,
per-tenant tier quotas (own pages make room first), usage per tenant."""

from __future__ import annotations

import threading

import pytest
from daemonkit import A, B, daemon, keys, pool, store_prefix

from kvtier.server.daemon import kv_ops
from kvtier.server.daemon.errors import NotFound, ResourceExhausted
from kvtier.server.daemon.quotas import Quota, Quotas


def _answers_in_thread(fn, timeout: float = 20.0) -> bool:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


def test_monitoring_answers_while_a_pool_lock_is_held_exclusive():
    """Regression (issue 8, defect 1): GetTierStats with a pool id took the pool's lock exclusive
    (and the cache's lock), so a stats poll waited behind -- and queued in front of -- the data path.
    Monitoring now reads plain integers: with the pool's lock held by a writer, tier stats, daemon
    stats and tier usage all answer."""
    d = daemon(host_memory_bytes=8 << 20)
    try:
        pool(d, A, "p")
        store_prefix(d, A, "p", keys(2), seed=1)
        entry = d.pools.get(A, "p")
        held, release = threading.Event(), threading.Event()

        def writer() -> None:
            with entry.lock.exclusive():
                held.set()
                release.wait(30)

        w = threading.Thread(target=writer, daemon=True)
        w.start()
        assert held.wait(10)
        try:
            out: dict = {}
            assert _answers_in_thread(lambda: out.update(d.tiers.stats(A, "p"))), "GetTierStats(pool) waited for the pool lock"
            assert out["device"]["pages"] == 2 and out["counters"]["stores"] == 1
            assert _answers_in_thread(lambda: d.stats(A)), "GetStats waited for the pool lock"
            assert _answers_in_thread(lambda: d.tier_usage(A))
        finally:
            release.set()
            w.join(10)
    finally:
        d.close()


def test_equal_prompts_of_two_tenants_never_share_or_probe_pages():
    d = daemon(host_memory_bytes=8 << 20)
    try:
        pool(d, A, "p")
        pool(d, B, "p")
        ks = keys(3)
        store_prefix(d, A, "p", ks, seed=1)
        assert d.tiers.lookup(A, "p", ks).tiers == ["device"] * 3
        assert d.tiers.lookup(B, "p", ks).tiers == [] and d.tiers.where_is(B, "p", ks) == [[]] * 3
        lease = d.tiers.load(B, "p", ks, None)
        assert lease.loaded_pages == 0  # B computes its own KV: nothing of A's is handed out
        with pytest.raises(NotFound) as e:
            d.tiers.release(A, "p", lease.lease)  # A cannot end B's lease, even knowing its id
        assert "unknown or released" in str(e.value)
        d.tiers.release(B, "p", lease.lease)
    finally:
        d.close()


def test_a_tenant_over_its_host_quota_pushes_its_own_pages_down_not_others(tmp_path):
    """team-a's host quota holds 2 page records; team-b has none. Evicting a's cached pages to the
    host tier moves a's older host records to disk; b's records in the host tier stay there."""
    from kvtier.server.daemon.tier_settings import TierSettings

    probe = daemon(host_memory_bytes=8 << 20)
    page = probe.tiers.cache_of(pool(probe, A, "x")).page_record_bytes
    probe.close()
    d = daemon(host_memory_bytes=16 * page, quotas=Quotas({"team-a": Quota(host_bytes=2 * page)}),
               tiers=TierSettings(disk_path=str(tmp_path / "disk"), disk_bytes=64 << 20))
    try:
        pool(d, A, "p", tokens=2 * 64)
        pool(d, B, "p", tokens=2 * 64)
        kb = keys(2, seed=9)
        store_prefix(d, B, "p", kb, seed=2)
        ka = keys(6, seed=1)
        for i in range(0, 6, 2):  # each request evicts the tenant's previous two pages from its 2-page pool
            store_prefix(d, A, "p", ka[i:i + 2], seed=i)
        store_prefix(d, B, "p", keys(2, seed=10), seed=3)  # b's first pages go to the host tier
        assert d.tiers.where_is(A, "p", ka) == [["disk"]] * 2 + [["host"]] * 2 + [["device"]] * 2
        assert d.tiers.where_is(B, "p", kb) == [["host"]] * 2
        usage = {t.tier: t for t in d.tier_usage(A)}
        assert usage["host"].tenant_used_bytes == 2 * page and usage["host"].tenant_quota_bytes == 2 * page
        stats = d.tiers.stats(B)["tiers"]["host"]
        assert stats["tenant_used_bytes"] == 2 * page and stats["tenant_quota_bytes"] is None
    finally:
        d.close()


def test_an_offload_past_every_tier_quota_is_refused_naming_the_quota(tmp_path):
    from kvtier.server.daemon.tier_settings import TierSettings

    d = daemon(host_memory_bytes=8 << 20, quotas=Quotas({"team-a": Quota(host_bytes=100_000, disk_bytes=100_000)}),
               tiers=TierSettings(disk_path=str(tmp_path / "disk"), disk_bytes=64 << 20))
    try:
        from daemonkit import fill

        pool(d, A, "p")
        slots, _ = fill(d, A, "p", 128, seed=1)  # 4 layers x 128 tokens: ~0.4 MB, above both quotas
        with pytest.raises(ResourceExhausted, match=r"tier quota of tenant 'team-a'.*host_bytes quota 100000 bytes"):
            kv_ops.offload(d.pools, d.offload_store, A, "p", "big", slots, free_slots=True)
        assert d.pools.get(A, "p").allocator.used_pages == 2 and not d.offload_store.contains(A, "big")
        pool(d, B, "p")
        slots_b, _ = fill(d, B, "p", 128, seed=2)
        kv_ops.offload(d.pools, d.offload_store, B, "p", "big", slots_b, free_slots=True)  # b has no quota
        assert d.offload_store.contains(B, "big") and not d.offload_store.contains(A, "big")
    finally:
        d.close()


def test_the_daemon_has_one_host_arena_for_host_records_and_pools_host_copies():
    """Pools of a daemon copy into the host tier's arena (one fd, one registration range), not into an
    arena each: an offloaded copy's record lands there too."""
    d = daemon(host_memory_bytes=16 << 20)
    try:
        host = d.tiers.stack.tier("host")
        pool(d, A)
        entry = d.pools.get(A, "p")
        assert entry.pool.host_arena is host.arena is d.pools.host_arena
        slots = entry.alloc(128)
        copy = entry.pool.get_cpu_copy(slots)
        assert all(host.arena.owns(c) for layer in copy["kv"] for c in layer)
        ptr, n = host.registration_range()
        assert (ptr, n) == host.arena.registration_range() and n >= 16 << 20
    finally:
        d.close()


def test_a_failed_shutdown_hook_is_counted_and_the_rest_still_run():
    """Attack pass 4, A4-2: a shutdown hook that raised (the disk tier's close on a full map) was
    logged and the daemon still exited 0. ``close`` now counts it, so ``serve`` exits 1; the other
    hooks still run."""
    d = daemon()
    ran: list[str] = []

    def fails() -> None:
        ran.append("fails")
        raise RuntimeError("mdb_txn_commit: MDB_MAP_FULL")
    d.add_shutdown_hook(lambda: ran.append("first added"))
    d.add_shutdown_hook(fails)
    d.add_shutdown_hook(lambda: ran.append("last added"))
    d.close()
    assert ran == ["last added", "fails", "first added"] and d.failed_shutdown_hooks == 1


def test_a_deleted_pool_with_a_prefix_cache_is_freed_and_its_referee_goes():
    """Attack pass 8, A8-1 and A8-2: the tier stack kept every prefix cache's device-page check, so
    a deleted pool's cache, and with it the pool's memory, was never freed (a create, prefix call,
    delete loop grew the daemon by a pool each round), and every pool size ever used kept a device
    referee that every later request fed. After a delete the stack holds no check of the pool,
    the pool object is garbage once collected, and the history has no referee of its size; the
    pool that remains keeps its own."""
    import gc
    import weakref

    from kvtier.server.daemon.tier_settings import TierSettings

    d = daemon(host_memory_bytes=8 << 20, tiers=TierSettings(policy="duel"))
    try:
        pool(d, A, "keep", tokens=512)
        store_prefix(d, A, "keep", keys(2), seed=1)
        stack = d.tiers.stack
        history = d.pools.get(A, "keep").prefix_cache.history
        for tokens in (1024, 2048):
            pool(d, A, "p", tokens=tokens)
            store_prefix(d, A, "p", keys(2, seed=2), seed=2)
            gone = weakref.ref(d.pools.get(A, "p").pool)
            assert len(stack._devices) == 2 and len(history._own_referees) == 2
            d.pools.delete(A, "p", force=True)
            gc.collect()
            assert gone() is None  # nothing keeps the deleted pool's memory alive
            assert len(stack._devices) == 1 and sorted(history._own_referees) == [512 // 64]
    finally:
        d.close()
