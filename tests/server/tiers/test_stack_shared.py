"""The stack with a shared tier (size-only twins, as ``--simulate`` builds them): pages reach it when
the prefix cache stores them, evictions never cascade into it, lookups and loads use it, and
unhealthy tiers are bypassed (a publish they cannot take is counted ``device-><tier>(unhealthy)``)
and come back through the tier monitor's probes."""

from __future__ import annotations

from kvtier.server.pool import PagedTokenAllocator
from kvtier.server.tiers import PrefixCache, SimTier, SimTierConfig, TierStack, TierUnavailableError
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
    assert stack.put(b"p:xk", 100, source="device") == []  # the only cascade tier is bypassed
    assert stack.moves["device->gone"]["count"] >= 1
    monitor = TierMonitor(stack.tiers)
    reported = {}
    monitor.add_listener(lambda snap: reported.__setitem__(snap.service_name, snap.healthy))
    assert [(s.tier, s.healthy) for s in monitor.run_once()] == [("host", False), ("mooncake", False)]
    assert monitor.probes == 0  # no probe due yet
    assert reported == {"kvtier.tier.host": False, "kvtier.tier.mooncake": False}
    assert monitor.run_once() == []  # nothing changed
    now[0] += 1.0  # the first backoff has passed
    assert [(s.tier, s.healthy) for s in monitor.run_once()] == [("host", True), ("mooncake", True)]
    assert monitor.probes == 2
    assert reported == {"kvtier.tier.host": True, "kvtier.tier.mooncake": True}
    assert cache.lookup(keys[:2]).per_tier["mooncake"] == 2


class FailingSharedTier(SimTier):
    """A shared size-only tier whose store fails after ``ok`` records of a write, as the Mooncake tier
    does when its master goes away mid-batch: it marks itself unhealthy and raises
    TierUnavailableError naming the records put before the failure."""

    def __init__(self, ok: int) -> None:
        super().__init__(SimTierConfig(capacity_bytes=1 << 30, name="mooncake", shared=True))
        self.ok = ok

    def write(self, items, *, on_evict=None, replace=False):
        done = super().write(items[:self.ok])
        self.health.mark_unhealthy("master went away")
        raise TierUnavailableError(self.name, "master went away", written=tuple(done))


def test_publish_to_a_tier_failing_mid_batch_counts_what_it_took_and_skips_the_rest():
    """Scenario: 5 pages are published; the shared tier takes 2, then its store fails. The 2 are
    moves to it (with their bytes), the other 3 are ``device->mooncake(unhealthy)`` (0 bytes: the
    pages stay on the device); nothing raises. A later publish while it is unhealthy skips every page."""
    shared = FailingSharedTier(ok=2)
    stack = TierStack([shared])
    keys = [b"p:k%d" % i for i in range(5)]
    assert stack.publish(keys, lambda i, out: 100 + i, source="device") == 2
    assert stack.moves["device->mooncake"] == {"count": 2, "bytes": 100 + 101}
    assert stack.moves["device->mooncake(unhealthy)"] == {"count": 3, "bytes": 0}
    assert shared.health.healthy is False and len(shared.index) == 2
    assert stack.publish([b"p:k9", b"p:k8"], lambda i, out: 1, source="device") == 0
    assert stack.moves["device->mooncake(unhealthy)"]["count"] == 5
