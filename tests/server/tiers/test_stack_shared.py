"""The stack with a shared tier (size-only twins, as ``--simulate`` builds them): pages reach it when
the prefix cache stores them, evictions never cascade into it, lookups and loads use it, and
unhealthy tiers are bypassed and come back through ``probe_due``."""

from __future__ import annotations

from kvtier.server.pool import PagedTokenAllocator
from kvtier.server.tiers import PrefixCache, SimTierConfig, TierStack
from kvtier.server.tiers.health import TierHealth
from kvtier.server.tiers.mooncake_store import MooncakeStoreTierConfig
from kvtier.server.tiers.monitor import TierMonitor

from tierkit import keys_for


def sim_stack(host_pages: int, shared_pages: int, page_bytes: int) -> TierStack:
    return TierStack.from_configs([SimTierConfig(capacity_bytes=host_pages * page_bytes, name="host"),
                                   SimTierConfig.like(MooncakeStoreTierConfig(capacity_bytes=shared_pages * page_bytes))])


def cache_over(stack: TierStack, codec, pages: int = 4) -> PrefixCache:
    return PrefixCache(stack, PagedTokenAllocator(pages * 64 + 64, 64), codec, pool=None, namespace=b"p:x")


def request(cache: PrefixCache, keys: list[bytes]) -> list[str]:
    ld = cache.load(keys)
    cache.store(ld.lease, keys[ld.loaded_pages:], ld.slots[ld.loaded_pages * 64:])
    cache.release(ld.lease)
    return ld.tiers


def test_stored_pages_are_published_and_evictions_do_not_cascade_into_the_shared_tier(codec):
    stack = sim_stack(host_pages=2, shared_pages=100, page_bytes=codec.page_nbytes())
    assert [t.name for t in stack.cascade] == ["host"] and [t.name for t in stack.shared] == ["mooncake"]
    a = cache_over(stack, codec, pages=4)
    keys = keys_for(12, seed=1)
    for i in range(0, 12, 4):
        assert request(a, keys[i:i + 4]) == []
    assert stack.moves["device->mooncake"]["count"] == 12  # published once each, at store
    assert "host->mooncake" not in stack.moves and stack.moves["host->gone"]["count"] >= 1
    # a second daemon's cache over the same shared tier finds every page there
    b = cache_over(TierStack([stack.tier("mooncake")]), codec, pages=16)
    assert b.lookup(keys).tiers == ["mooncake"] * 12
    assert request(b, keys) == ["mooncake"] * 12
    assert b.counters["hit_pages_mooncake"] == 12
    # stored again by b: already in the shared tier, nothing published twice
    assert stack.moves["device->mooncake"]["count"] == 12


def test_unhealthy_tiers_are_bypassed_and_come_back_by_probe(codec):
    stack = sim_stack(host_pages=1, shared_pages=100, page_bytes=codec.page_nbytes())
    host, shared = stack.tier("host"), stack.tier("mooncake")
    now = [0.0]
    for t in (host, shared):
        t.health = TierHealth(t.name, clock=lambda: now[0])
    cache = cache_over(stack, codec, pages=2)
    keys = keys_for(4, seed=2)
    request(cache, keys[:2])
    shared.health.mark_unhealthy("store gone")
    assert cache.lookup(keys[:2]).per_tier["mooncake"] == 0
    request(cache, keys[2:])  # published nowhere: dropped and counted
    assert stack.moves["device->mooncake(unhealthy)"]["count"] == 2
    host.health.mark_unhealthy("disk full")
    assert stack.put(b"p:xk", 100, source="device") is False  # the only cascade tier is bypassed
    assert stack.moves["device->gone"]["count"] >= 1
    monitor = TierMonitor(stack)
    reported = {}
    monitor.watch(lambda name, ok: reported.__setitem__(name, ok))
    assert reported == {"kvtier.tier.host": False, "kvtier.tier.mooncake": False}
    assert monitor.run_once() == {}  # no probe due yet: nothing changed
    now[0] += 1.0  # the first backoff has passed
    assert monitor.run_once() == {"kvtier.tier.host": True, "kvtier.tier.mooncake": True}
    assert reported == {"kvtier.tier.host": True, "kvtier.tier.mooncake": True}
    assert cache.lookup(keys[:2]).per_tier["mooncake"] == 2
