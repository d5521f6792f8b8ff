"""Prefix cache: per-tier longest prefixes, the eviction cascade device -> host -> disk -> gone with
its counters, byte-exact loads from every tier, pins, and failures half way that leave nothing behind."""

from __future__ import annotations

import pytest
import torch

from kvtier.server.pool import slots_of_pages
from kvtier.server.tiers import DiskTierConfig, HostTierConfig, PrefixCache, TierFullError, TierStack
from tierkit import PAGE, fill_page, keys_for, read_page, verify_same_page


@pytest.fixture
def stack(tmp_path, codec):
    size = codec.page_nbytes()
    # host: 2 pages; disk: 3 pages (record budget = half the map: LMDB reuses freed pages only two
    # transactions later, so a tiny map with big records needs a big reserve)
    per_disk = -(-(size + 16) // 4096) * 4096 + 256
    disk_bytes = 6 * per_disk + 4096
    s = TierStack.from_configs([HostTierConfig(capacity_bytes=2 * size),
                                DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=disk_bytes,
                                               reserve_fraction=0.5)])
    assert s.tiers[1].index.capacity // per_disk == 3
    yield s
    s.close()


def store_pages(cache: PrefixCache, pool, keys: list[bytes], seed: int) -> list[dict]:
    """One request that misses everywhere: load (allocates), fill, store, release; returns the data."""
    ld = cache.load(keys)
    assert ld.tiers == []
    written = []
    for i in range(len(keys)):
        page = int(ld.slots[i * PAGE]) // PAGE
        written.append(fill_page(pool, page, seed + i))
    assert cache.store(ld.lease, keys, ld.slots) == len(keys)
    cache.release(ld.lease)
    return written


def verify_nothing_pinned(cache: PrefixCache) -> None:
    assert cache.pinned_pages == 0 and cache.open_leases == 0
    assert all(t.stats().pinned == 0 for t in cache.stack.tiers)


def test_cascade_device_host_disk_gone_with_counters(pool, allocator, codec, stack):
    """A 16-page pool; 24 distinct pages stored 8 at a time: the oldest fall down tier by tier."""
    cache = PrefixCache(stack, allocator, codec, pool=pool)
    keys = keys_for(24)
    for r in range(3):
        store_pages(cache, pool, keys[8 * r: 8 * r + 8], seed=100 * r)
    # device holds the newest 16, host the 2 before them, disk the 3 before those, 3 are gone
    assert cache.device_order() == keys[8:]
    where = cache.where_is(keys)
    assert where[:3] == [[]] * 3
    assert where[3:6] == [["disk"]] * 3
    assert where[6:8] == [["host"]] * 2
    assert where[8:] == [["device"]] * 16
    size = codec.page_nbytes()
    m = stack.moves
    assert m["device->host"] == {"count": 8, "bytes": 8 * size}
    assert m["host->disk"] == {"count": 6, "bytes": 6 * size}
    assert m["disk->gone"]["count"] == 3
    verify_nothing_pinned(cache)


def test_lookup_answers_per_tier_and_pins_nothing(pool, allocator, codec, stack):
    cache = PrefixCache(stack, allocator, codec, pool=pool)
    keys = keys_for(24)
    for r in range(3):
        store_pages(cache, pool, keys[8 * r: 8 * r + 8], seed=r)
    for _ in range(5):
        lk = cache.lookup(keys[3:])
    assert lk.per_tier == {"device": 0, "host": 0, "disk": 3}
    assert lk.tiers == ["disk"] * 3 + ["host"] * 2 + ["device"] * 16
    assert cache.lookup(keys).tiers == []  # page 0 is gone: no prefix at all
    verify_nothing_pinned(cache)


def test_load_brings_every_tier_back_byte_exact(pool, allocator, codec, stack):
    cache = PrefixCache(stack, allocator, codec, pool=pool)
    keys = keys_for(12)
    written = store_pages(cache, pool, keys[:8], seed=10) + store_pages(cache, pool, keys[8:12], seed=20)
    # make room: 4 more pages push keys[0..3] down (host 2, then disk 2)
    store_pages(cache, pool, keys_for(8, seed=5), seed=30)
    tiers = cache.lookup(keys).tiers
    assert tiers[:2] == ["disk", "disk"] and tiers[2:4] == ["host", "host"] and tiers[4:] == ["device"] * 8
    ld = cache.load(keys[:12])
    assert ld.tiers == tiers and ld.loaded_pages == 12
    for i in range(12):
        verify_same_page(written[i], read_page(pool, int(ld.slots[i * PAGE]) // PAGE))
    assert stack.moves["disk->device"]["count"] == 2 and stack.moves["host->device"]["count"] == 2
    cache.release(ld.lease)
    verify_nothing_pinned(cache)


def test_pinned_pages_are_not_evicted_and_a_full_pool_changes_nothing(pool, allocator, codec, stack):
    cache = PrefixCache(stack, allocator, codec, pool=pool)
    keys = keys_for(16)
    store_pages(cache, pool, keys, seed=1)
    held = cache.load(keys[:10])  # pins 10 device pages
    before = (cache.device_order(), allocator.free_pages, dict(stack.moves))
    with pytest.raises(TierFullError):
        cache.load(keys_for(7, seed=9))  # needs 7 pages, only 6 unpinned
    assert (cache.device_order(), allocator.free_pages, dict(stack.moves)) == before
    assert cache.pinned_pages == 10
    cache.release(held.lease)
    verify_nothing_pinned(cache)


def test_failure_between_latent_and_indexer_parts_is_invisible(pool, allocator, codec, stack, monkeypatch):
    """The device->host eviction copies latent rows, then fails before the indexer pages: no tier
    may show the page, and the device keeps it."""
    cache = PrefixCache(stack, allocator, codec, pool=pool)
    keys = keys_for(16)
    written = store_pages(cache, pool, keys, seed=3)
    arena = pool.arena

    def failing_indexer(component):
        """The pool's arenas, failing when the record copy reaches the indexer (after the latent part)."""
        if component == "index_k":
            raise RuntimeError("injected: failed after the latent part, before the indexer part")
        return arena(component)

    monkeypatch.setattr(pool, "arena", failing_indexer)
    with pytest.raises(RuntimeError, match="injected"):
        cache.load(keys_for(1, seed=7))
    monkeypatch.undo()
    assert cache.where_is(keys[:1]) == [["device"]]
    assert all(t.stats().entries == 0 for t in stack.tiers) and "device->host" not in stack.moves
    assert allocator.free_pages == 0
    verify_nothing_pinned(cache)
    ld = cache.load(keys[:1])
    verify_same_page(written[0], read_page(pool, int(ld.slots[0]) // PAGE))
    cache.release(ld.lease)


def test_damaged_host_record_ends_the_prefix_and_is_counted(pool, allocator, codec, stack):
    cache = PrefixCache(stack, allocator, codec, pool=pool)
    keys = keys_for(16)
    store_pages(cache, pool, keys, seed=3)
    store_pages(cache, pool, keys_for(2, seed=8), seed=9)  # keys[0], keys[1] -> host
    host = stack.tiers[0]
    host.record(keys[1])[codec.header_nbytes + 5] ^= 1
    ld = cache.load(keys[:3])
    assert ld.tiers == ["host"]  # keys[1] is damaged: the prefix ends there; keys[2] is not used
    assert host.stats().damaged == 1 and cache.where_is(keys[1:2]) == [[]]
    assert ld.slots.numel() == 3 * PAGE
    cache.release(ld.lease)
    verify_nothing_pinned(cache)


def test_disk_pages_come_up_in_one_borrow_and_a_damaged_one_ends_the_prefix(pool, allocator, codec, stack, monkeypatch):
    """Three disk pages of a prefix are borrowed in one call (one read transaction); the second is
    damaged on disk: the load keeps the first, ends the prefix there and counts the damage once."""
    cache = PrefixCache(stack, allocator, codec, pool=pool)
    keys = keys_for(16)
    written = store_pages(cache, pool, keys, seed=3)
    store_pages(cache, pool, keys_for(5, seed=8), seed=9)  # keys[0:3] -> disk, keys[3:5] -> host
    assert cache.where_is(keys[:5]) == [["disk"]] * 3 + [["host"]] * 2
    disk = stack.tiers[1]
    tkey = cache._tier_key(keys[1])
    with disk.borrow([tkey]) as (rec,):
        bad = rec.clone()
    bad[codec.header_nbytes + 99] ^= 8
    disk.write([(tkey, bad)], replace=True)
    calls = []
    real = disk.borrow
    monkeypatch.setattr(disk, "borrow", lambda ks: calls.append(list(ks)) or real(ks))
    ld = cache.load(keys[:5])
    assert ld.tiers == ["disk"]
    assert calls == [[cache._tier_key(k) for k in keys[:3]]]
    assert disk.stats().damaged == 1 and cache.where_is(keys[1:2]) == [[]]
    verify_same_page(written[0], read_page(pool, int(ld.slots[0]) // PAGE))
    cache.release(ld.lease)
    verify_nothing_pinned(cache)


def test_store_validates_before_adopting(pool, allocator, codec, stack):
    cache = PrefixCache(stack, allocator, codec, pool=pool)
    keys = keys_for(3)
    ld = cache.load(keys)
    with pytest.raises(ValueError, match="whole page"):
        cache.store(ld.lease, keys[:1], ld.slots[1:PAGE + 1])
    with pytest.raises(ValueError, match="fresh pages"):
        cache.store(ld.lease, keys[:1], slots_of_pages(torch.tensor([15]), PAGE))
    assert cache.device_pages == 0
    cache.release(ld.lease)
    assert allocator.free_pages == 16
    verify_nothing_pinned(cache)


def test_a_lease_never_released_expires_and_unpins(pool, allocator, codec, stack):
    """A client that vanished after a load: its lease is released at the next call after the TTL."""
    cache = PrefixCache(stack, allocator, codec, pool=pool, lease_ttl_seconds=0.0)
    keys = keys_for(4)
    store_pages(cache, pool, keys, seed=2)
    cache.load(keys)  # never released
    assert cache.pinned_pages == 4
    cache.lookup(keys)  # the TTL (0 s) has passed: released here
    assert cache.counters["expired_leases"] == 1
    verify_nothing_pinned(cache)
    assert allocator.free_pages == 16 - 4


def test_a_repeated_key_is_refused_and_leaks_no_page(pool, allocator, codec, stack):
    """Regression (issue 8, defect 2): load([k, k]) with k in a lower tier failed with
    ``KeyError ... already in the policy`` (INTERNAL over gRPC) and leaked one pool page per call.
    Chained page keys of one request never repeat: a repeat is a ValueError (INVALID_ARGUMENT)
    before anything is pinned or allocated, and store refuses it likewise."""
    cache = PrefixCache(stack, allocator, codec, pool=pool)
    keys = keys_for(17)
    store_pages(cache, pool, keys[:1], seed=1)
    store_pages(cache, pool, keys[1:17], seed=2)  # 16 newer pages push keys[0] down to the host tier
    assert cache.where_is(keys[:1]) == [["host"]]
    free = allocator.free_pages
    for _ in range(3):
        with pytest.raises(ValueError, match="repeats"):
            cache.load([keys[0], keys[0]])
    assert allocator.free_pages == free
    ld = cache.load(keys[1:2])
    with pytest.raises(ValueError, match="repeats"):
        cache.store(ld.lease, [keys[0], keys[0]], torch.cat([ld.slots, ld.slots]))
    cache.release(ld.lease)
    assert allocator.free_pages == free and cache.where_is(keys[:1]) == [["host"]]
    verify_nothing_pinned(cache)


def test_a_load_failing_while_a_page_comes_up_frees_that_page(pool, allocator, codec, stack, monkeypatch):
    """A lower-tier page whose load raises (not a damaged record: an unexpected error) leaves no
    page allocated and no pin behind: the page being filled goes back with the lease."""
    cache = PrefixCache(stack, allocator, codec, pool=pool)
    keys = keys_for(17)
    store_pages(cache, pool, keys[:1], seed=1)
    store_pages(cache, pool, keys[1:17], seed=2)

    def broken(*_a, **_k):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(cache.codec, "load_page", broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        cache.load(keys[:1])
    assert allocator.used_pages == cache.device_pages  # every allocated page is a cached one (eviction made room)
    verify_nothing_pinned(cache)


def test_lease_ids_are_128_bit_random():
    """Lease ids are 32 hex characters of fresh randomness, never sequential."""
    from kvtier.server.model_config import DSAModelConfig
    from kvtier.server.pool import PagedTokenAllocator
    from kvtier.server.tiers import RecordCodec

    model = DSAModelConfig.from_preset("glm-5.2", num_layers=4)
    cache = PrefixCache(TierStack([]), PagedTokenAllocator(64 * 64, 64), RecordCodec(model), pool=None)
    ids = [cache.load(keys_for(1, seed=i)).lease for i in range(50)]
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids) and len(set(ids)) == 50
    assert len({i[:4] for i in ids}) > 40  # no common prefix, no counter


def test_fresh_leases_names_the_lease_of_each_fresh_page_and_none_for_cached_pages(pool, allocator, codec, stack):
    """What the daemon's write check asks (issue 23, defect 4): a lease of 3 keys of which 1 is
    cached has 1 hit page (cached: None) and 2 fresh pages (that lease); a second lease's fresh page
    names it; after a store the stored page is cached (None), after release nothing is a fresh page."""
    cache = PrefixCache(stack, allocator, codec, pool=pool)
    keys = keys_for(4)
    store_pages(cache, pool, keys[:1], seed=1)
    one, two = cache.load(keys[:3]), cache.load(keys[3:])
    pages = [int(s) // PAGE for s in one.slots[::PAGE]] + [int(two.slots[0]) // PAGE]
    assert cache.fresh_leases(pages) == [None, one.lease, one.lease, two.lease]
    cache.store(one.lease, keys[1:2], one.slots[PAGE:2 * PAGE])
    assert cache.fresh_leases(pages) == [None, None, one.lease, two.lease]
    cache.release(one.lease)
    cache.release(two.lease)
    assert cache.fresh_leases(pages) == [None] * 4
