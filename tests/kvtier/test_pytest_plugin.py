"""The pytest plugin: registered as an entry point, and its ephemeral daemon fixture in use."""

from __future__ import annotations

from importlib.metadata import entry_points


def test_plugin_is_registered_as_a_pytest11_entry_point():
    eps = [e for e in entry_points(group="pytest11") if e.name == "kvtier"]
    assert [e.value for e in eps] == ["kvtier.pytest_plugin"]


def test_fixture_daemon_shows_an_lru_eviction_order(kvtier_daemon):
    """Pool of 8 pages, host 4 pages, disk 8: twelve pages stored one request at a time end up
    newest 8 on the device, the 4 before them in the host tier; reusing one brings it back."""
    d = kvtier_daemon
    keys = d.page_keys(12)
    for i in range(0, 12, 2):
        assert d.put_pages(keys[i:i + 2]) == []  # all misses
    where = d.client.where_is(d.pool_id, keys)
    assert where[4:] == [["device"]] * 8
    assert where[:4] == [["host"]] * 4
    assert d.put_pages(keys[:2]) == ["host", "host"]  # loads both back, evicting the two oldest device pages
    assert d.client.where_is(d.pool_id, keys[4:6]) == [["host"]] * 2
    stats = d.client.tier_stats(d.pool_id)
    assert stats.moves["host->device"]["count"] == 2 and stats.device["pinned_pages"] == 0
    assert stats.tiers["host"]["pinned"] == 0 and stats.device["open_leases"] == 0


def test_factory_starts_daemons_with_other_budgets(kvtier_daemon_factory):
    d = kvtier_daemon_factory(device_pages=4, host_pages=1, disk_pages=2)
    keys = d.page_keys(8)
    for k in keys:
        d.put_pages([k])
    where = d.client.where_is(d.pool_id, keys)
    # device 4 pages, host 1, disk 2: the oldest is gone
    assert where == [[], ["disk"], ["disk"], ["host"]] + [["device"]] * 4
    moves = d.client.tier_stats().moves
    assert moves["host->disk"]["count"] == 3 and moves["disk->gone"]["count"] == 1


def test_attached_pool_fixture_writes_through_tensors_and_reads_evicted_pages_back(kvtier_daemon, kvtier_attached_pool):
    """The plugin's attached pool: pages written through its tensors evict like any others (pool 8
    pages, host 4) and come back byte-exact into its tensors."""
    import torch

    d, ap = kvtier_daemon, kvtier_attached_pool
    keys = d.page_keys(10, seed=3)
    rows = torch.randint(0, 256, (64, 656), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    lease = ap.load_prefix(keys[:1])
    ap.kv_buffer[2][lease.slots] = rows.view(64, 1, 656)
    ap.store_prefix(lease, keys[:1], lease.slots)
    ap.release_prefix(lease)
    for i in range(1, 10):
        d.put_pages(keys[i:i + 1], attached=ap)
    assert d.client.where_is(d.pool_id, keys[:2]) == [["host"]] * 2
    lease = ap.load_prefix(keys[:1])
    assert lease.tiers == ["host"]
    assert torch.equal(ap.kv_buffer[2][lease.slots].view(64, 656), rows)
    ap.release_prefix(lease)
    assert d.client.stats().attach_sessions == 1


def test_factory_takes_a_policy_and_get_stats_names_it(kvtier_daemon_factory):
    """The plugin pins ``lru`` unless told; ``policy="s3fifo"`` runs S3-FIFO on every tier, and
    GetStats says so per tier (the device tier too)."""
    pinned = kvtier_daemon_factory()
    assert {t.tier: t.policy for t in pinned.client.stats().tiers} == {"device": "lru", "host": "lru", "disk": "lru"}
    default = kvtier_daemon_factory(policy="default")  # what kvtier serve runs unless told: duel
    assert {t.tier: t.policy for t in default.client.stats().tiers} == {"device": "duel", "host": "duel", "disk": "duel"}
    d = kvtier_daemon_factory(device_pages=4, host_pages=1, disk_pages=2, policy="s3fifo")
    assert {t.tier: t.policy for t in d.client.stats().tiers} == {"device": "s3fifo", "host": "s3fifo", "disk": "s3fifo"}
    keys = d.page_keys(8)
    for k in keys:
        d.put_pages([k])
    # S3-FIFO on one-page tiers: every page is a never-used probationer; each tier evicts its oldest
    # first, as LRU would here (no page was used twice), so the placement is LRU's
    where = d.client.where_is(d.pool_id, keys)
    assert where == [[], ["disk"], ["disk"], ["host"]] + [["device"]] * 4


def test_a_daemon_whose_tiny_disk_filled_stops_cleanly_and_starts_again(tmp_path):
    """Seen as a 30 s teardown: 8 pages into a daemon whose disk tier holds 2 fill LMDB's map, a
    write-behind job fails (map full), and its thread waits for the disk tier's lock to resync; a
    SIGTERM's close held that lock while it waited for the thread, so the daemon hung 30 s and was
    killed (exit -9) before it flushed its disk. It now exits 0. And a restart with the very same
    settings was refused ("--disk-size ... is too small"): the start check counted the file's last
    page (freed pages too) against the records' share of the map; now it starts."""
    from kvtier.pytest_plugin import start_tiny_daemon, stop_tiny_daemon

    budgets = {"device_pages": 4, "host_pages": 1, "disk_pages": 2, "policy": "s3fifo"}
    d = start_tiny_daemon(tmp_path, **budgets)
    keys = d.page_keys(8)
    for k in keys:
        d.put_pages([k])
    assert stop_tiny_daemon(d) == 0
    again = start_tiny_daemon(tmp_path, **budgets)
    try:
        assert again.client.health() == "SERVING" and len(again.client.where_is(again.pool_id, keys)) == 8
    finally:
        assert stop_tiny_daemon(again) == 0
