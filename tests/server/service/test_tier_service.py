"""TierService through a real daemon: byte-exact loads from every tier, status codes with nothing
changed, nothing left pinned, disk records surviving a daemon restart, offloaded copies spilling to
the LMDB tier and restoring from it."""

from __future__ import annotations

import pytest
import torch

from kvtier.client.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from kvtier.pytest_plugin import start_tiny_daemon, stop_tiny_daemon

PAGE = 64


def write_pages(d, keys, seed):
    """One request of fresh pages with known random KV; returns {key: (latent rows, keys, scales)}."""
    c = d.client
    lease = c.load_prefix(d.pool_id, keys)
    assert lease.tiers == []
    g = torch.Generator().manual_seed(seed)
    n = len(keys) * PAGE
    lat = {i: torch.randint(0, 256, (n, 656), dtype=torch.uint8, generator=g) for i in range(4)}
    idx = {i: (torch.randint(0, 256, (n, 128), dtype=torch.uint8, generator=g), torch.rand(n, generator=g)) for i in (0, 1, 2)}
    c.write_kv(d.pool_id, lease.slots, latent=lat, index=idx)
    assert c.store_prefix(lease, keys, lease.slots) == len(keys)
    c.release_prefix(lease)
    return {k: ({i: t[j * PAGE:(j + 1) * PAGE] for i, t in lat.items()},
                {i: (kk[j * PAGE:(j + 1) * PAGE], s[j * PAGE:(j + 1) * PAGE]) for i, (kk, s) in idx.items()})
            for j, k in enumerate(keys)}


def verify_loaded(d, lease, keys, written):
    kv = d.client.read_kv(d.pool_id, lease.slots[: len(keys) * PAGE])
    for j, k in enumerate(keys):
        lat, idx = written[k]
        sl = slice(j * PAGE, (j + 1) * PAGE)
        for i in range(4):
            assert torch.equal(kv.latent[i][sl], lat[i]), f"page {j} layer {i} latent differs"
        for i in (0, 1, 2):
            assert torch.equal(kv.index_k[i][sl], idx[i][0])
            assert torch.equal(kv.index_scale[i][sl].view(torch.int32), idx[i][1].view(torch.int32))
        assert 3 not in kv.index_k  # layer 3 skips top-k: no indexer data exists for it


def verify_nothing_pinned(d):
    s = d.client.tier_stats(d.pool_id)
    assert s.device["pinned_pages"] == 0 and s.device["open_leases"] == 0
    assert all(t["pinned"] == 0 for t in s.tiers.values())


@pytest.fixture
def tiny(kvtier_daemon_factory):
    return kvtier_daemon_factory(device_pages=8, host_pages=4, disk_pages=8)


def test_loads_from_device_host_and_disk_are_byte_exact(tiny):
    d = tiny
    keys = d.page_keys(16)
    written = {}
    for i in range(0, 16, 4):
        written.update(write_pages(d, keys[i:i + 4], seed=i))
    # device: keys 8..15, host: 4..7, disk: 0..3
    assert d.client.lookup_prefix(d.pool_id, keys).tiers == ["disk"] * 4 + ["host"] * 4 + ["device"] * 8
    for _ in range(3):
        d.client.lookup_prefix(d.pool_id, keys)
    verify_nothing_pinned(d)  # lookups never followed by a load pin nothing
    lease = d.client.load_prefix(d.pool_id, keys[:8])
    assert lease.tiers == ["disk"] * 4 + ["host"] * 4
    verify_loaded(d, lease, keys[:8], written)
    d.client.release_prefix(lease)
    verify_nothing_pinned(d)
    moves = d.client.tier_stats().moves
    assert moves["disk->device"]["count"] == 4 and moves["host->device"]["count"] == 4


def test_errors_have_their_status_codes_and_change_nothing(tiny):
    d = tiny
    c = d.client
    keys = d.page_keys(8)
    write_pages(d, keys, seed=1)
    held = c.load_prefix(d.pool_id, keys[:6])  # pins 6 of 8 device pages
    before = c.where_is(d.pool_id, keys)
    with pytest.raises(ResourceExhaustedError):
        c.load_prefix(d.pool_id, d.page_keys(3, seed=5))  # 3 fresh pages, only 2 unpinned
    with pytest.raises(NotFoundError):
        c.lookup_prefix("no-such-pool", keys)
    with pytest.raises(InvalidArgumentError, match="1..64 bytes"):
        c.where_is(d.pool_id, [b"x" * 65])
    with pytest.raises(InvalidArgumentError, match="fresh pages"):
        c.store_prefix(held, d.page_keys(1, seed=9), held.slots[:PAGE])  # a cached page, not a fresh one
    c.release_prefix(held)
    with pytest.raises(NotFoundError, match="lease"):
        c.release_prefix(held)
    assert c.where_is(d.pool_id, keys) == before
    verify_nothing_pinned(d)


def test_disk_records_survive_a_daemon_restart(tmp_path):
    """At SIGTERM the daemon moves device pages and host records down to the disk tier; the next
    daemon on the same directory finds all of them there, byte-exact."""
    d = start_tiny_daemon(tmp_path, device_pages=4, host_pages=1, disk_pages=10)
    keys = d.page_keys(9)
    written = {}
    for i in range(0, 8, 4):
        written.update(write_pages(d, keys[i:i + 4], seed=i))
    # device: 4..7; host: 3; disk: 0..2
    assert d.client.where_is(d.pool_id, keys[:8]) == [["disk"]] * 3 + [["host"]] + [["device"]] * 4
    assert stop_tiny_daemon(d) == 0

    again = start_tiny_daemon(tmp_path, device_pages=8, host_pages=1, disk_pages=10)
    try:
        assert again.client.where_is(again.pool_id, keys[:9]) == [["disk"]] * 8 + [[]]
        lease = again.client.load_prefix(again.pool_id, keys[:8])
        assert lease.tiers == ["disk"] * 8
        verify_loaded(again, lease, keys[:8], written)
        again.client.release_prefix(lease)
    finally:
        stop_tiny_daemon(again)


def test_offloaded_copies_spill_to_disk_and_restore_from_it(tiny):
    d = tiny
    c = d.client
    slots = c.allocate_slots(d.pool_id, 3 * PAGE)
    g = torch.Generator().manual_seed(3)
    lat = {i: torch.randint(0, 256, (3 * PAGE, 656), dtype=torch.uint8, generator=g) for i in range(4)}
    c.write_kv(d.pool_id, slots, latent=lat)
    c.offload(d.pool_id, "req-a", slots, free_slots=True)          # 3 pages: fits the 4-page host tier
    more = c.allocate_slots(d.pool_id, 2 * PAGE)
    c.offload(d.pool_id, "req-b", more, free_slots=True)           # pushes req-a down to the disk tier
    stats = c.tier_stats()
    assert stats.moves["host->disk"]["count"] == 1 and stats.tiers["disk"]["entries"] == 1
    back = c.restore(d.pool_id, "req-a")
    kv = c.read_kv(d.pool_id, back, index_layers=[])
    for i in range(4):
        assert torch.equal(kv.latent[i], lat[i])
    assert c.drop("req-a") and c.drop("req-b")
    assert c.tier_stats().tiers["disk"]["entries"] == 0


def _page_content(key: bytes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every writer stores for ``key``: latent rows, indexer keys, scales, all from the key."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:6], "little"))
    return (torch.randint(0, 256, (PAGE, 656), dtype=torch.uint8, generator=g),
            torch.randint(0, 256, (PAGE, 128), dtype=torch.uint8, generator=g), torch.rand(PAGE, generator=g))


def test_concurrent_clients_on_one_pool_leave_consistent_pages_and_no_pins(kvtier_daemon_factory):
    """Four clients replay overlapping requests at once (prefix operations on a pool are serialised):
    every page that ends up cached holds exactly its key's bytes, and nothing stays pinned."""
    import threading

    from kvtier.client import KVTierClient

    d = kvtier_daemon_factory(device_pages=16, host_pages=6, disk_pages=12)
    keys = d.page_keys(12)
    errors: list[str] = []

    def worker(w: int) -> None:
        with KVTierClient(d.address, timeout=60) as c:
            for r in range(8):
                ks = keys[: 2 + (w + r) % 11]  # 2..12 pages; worker 3 round 7 asks for all 12
                lease = c.load_prefix(d.pool_id, ks)
                try:
                    n = lease.loaded_pages
                    kv = c.read_kv(d.pool_id, lease.slots[: n * PAGE]) if n else None
                    for j in range(n):
                        lat, ik, sc = _page_content(ks[j])
                        sl = slice(j * PAGE, (j + 1) * PAGE)
                        if not (torch.equal(kv.latent[0][sl], lat) and torch.equal(kv.index_k[2][sl], ik)):
                            errors.append(f"worker {w} round {r}: page {j} differs")
                    fresh = lease.slots[n * PAGE:]
                    if fresh.numel():
                        parts = [_page_content(k) for k in ks[n:]]
                        lat = torch.cat([p[0] for p in parts])
                        idx = (torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts]))
                        c.write_kv(d.pool_id, fresh, latent={i: lat for i in range(4)}, index={i: idx for i in (0, 1, 2)})
                        c.store_prefix(lease, ks[n:], fresh)
                finally:
                    c.release_prefix(lease)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    verify_nothing_pinned(d)
    lease = d.client.load_prefix(d.pool_id, keys)
    assert lease.loaded_pages == 12
    kv = d.client.read_kv(d.pool_id, lease.slots)
    for j, k in enumerate(keys):
        lat, ik, sc = _page_content(k)
        sl = slice(j * PAGE, (j + 1) * PAGE)
        assert torch.equal(kv.latent[3][sl], lat) and torch.equal(kv.index_k[1][sl], ik)
        assert torch.equal(kv.index_scale[0][sl].view(torch.int32), sc.view(torch.int32))
    d.client.release_prefix(lease)
    verify_nothing_pinned(d)


def test_pool_calls_cannot_free_pages_the_prefix_cache_holds(tiny):
    """Regression: FreeSlots / Offload(free_slots) on a cached page freed it while the cache still
    indexed it; the page was handed out again and a later LoadPrefix served another client's KV
    as a device hit. Freeing a lease's fresh pages and then releasing the lease freed a third
    client's allocation. Both are now FAILED_PRECONDITION, and nothing changes."""
    from kvtier.client.errors import FailedPreconditionError

    d = tiny
    c = d.client
    keys = d.page_keys(2)
    written = write_pages(d, keys, seed=3)
    cached = c.load_prefix(d.pool_id, keys)  # both pages are device hits, cache-owned
    assert cached.tiers == ["device", "device"]
    c.release_prefix(cached)
    stats_before = c.tier_stats(d.pool_id).device
    with pytest.raises(FailedPreconditionError, match="prefix cache"):
        c.free_slots(d.pool_id, cached.slots)
    with pytest.raises(FailedPreconditionError, match="prefix cache"):
        c.offload(d.pool_id, "stolen", cached.slots[:PAGE], free_slots=True)
    with pytest.raises(NotFoundError):
        c.restore(d.pool_id, "stolen")  # the refused offload stored nothing
    lease = c.load_prefix(d.pool_id, d.page_keys(1, seed=11))  # one fresh page under a lease
    with pytest.raises(FailedPreconditionError, match="release the lease"):
        c.free_slots(d.pool_id, lease.slots)
    other = c.allocate_slots(d.pool_id, PAGE)
    c.release_prefix(lease)
    c.read_kv(d.pool_id, other[:1])  # the other client's page is still allocated
    c.free_slots(d.pool_id, other)
    again = c.load_prefix(d.pool_id, keys)
    assert again.tiers == ["device", "device"]
    verify_loaded(d, again, keys, written)  # the cached pages still hold their own KV
    c.release_prefix(again)
    assert c.tier_stats(d.pool_id).device["pages"] == stats_before["pages"]
    verify_nothing_pinned(d)


def test_a_repeated_key_in_a_lower_tier_is_invalid_argument_and_leaks_no_page(tiny):
    """Regression (issue 8, defect 2): load_prefix(pool, [k, k]) with k in a lower tier was INTERNAL
    (``KeyError ... already in the policy``) and leaked one pool page per call. Now it is
    INVALID_ARGUMENT before anything is pinned or allocated; free pages stay as they were."""
    d = tiny
    c = d.client
    keys = d.page_keys(9)
    write_pages(d, keys[:1], seed=1)
    write_pages(d, keys[1:], seed=2)  # 8 newer pages fill the 8-page pool: keys[0] goes to the host tier
    assert c.where_is(d.pool_id, keys[:1]) == [["host"]]
    free = c.describe_pool(d.pool_id).free_pages
    for _ in range(3):
        with pytest.raises(InvalidArgumentError, match="repeats"):
            c.load_prefix(d.pool_id, [keys[0], keys[0]])
    assert c.describe_pool(d.pool_id).free_pages == free
    assert c.where_is(d.pool_id, keys[:1]) == [["host"]]
    verify_nothing_pinned(d)


def test_store_with_release_ends_the_lease_in_the_same_call(tiny):
    """StorePrefix(release=True) stores and releases at once; when the store is refused, the lease stays open."""
    d, c = tiny, tiny.client
    keys = d.page_keys(3, seed=21)
    lease = c.load_prefix(d.pool_id, keys)
    with pytest.raises(InvalidArgumentError):
        c.store_prefix(lease, keys, lease.slots[:PAGE], release=True)  # 3 keys, 1 page of slots
    assert c.tier_stats(d.pool_id).device["open_leases"] == 1
    assert c.store_prefix(lease, keys, lease.slots, release=True) == 3
    verify_nothing_pinned(d)
    with pytest.raises(NotFoundError):
        c.release_prefix(lease)
    assert c.where_is(d.pool_id, keys) == [["device"]] * 3
