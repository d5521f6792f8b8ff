"""Two kvtier daemons sharing one real Mooncake Store (``mooncake_master`` with its HTTP metadata
server, 127.0.0.1): a prefix one daemon stores is found in tier ``mooncake`` by the other and loaded
byte-exact; another model's pages miss; another tenant's pages miss (keys carry the tenant); a master
that dies turns the tier unhealthy (misses, health NOT_SERVING, metrics, nothing wrong served) and a
restarted one brings it back by itself.

The expected bytes are the test's own seeded KV (``kv_helpers.random_kv``), never read back from the
daemon that wrote them.
"""

from __future__ import annotations

import os
import time

import pytest

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess
from kvtier.page_keys import page_keys

from kv_helpers import INDEX_PAGE_BYTES, LIVE_LAYERS, NUM_LAYERS, PAGE_SIZE, ROW_BYTES, put_prefix_pages, random_kv, verify_kv
from metrics_kit import metrics_flags, scrape, value

TIER_SERVICE = "kvtier.tier.mooncake"
RECORD = 194_048  # a page record of GLM-5.2's first 4 layers: 4 x 64 x 656 latent + 3 live layers x 8448 indexer + header and slots


def daemon_args(master) -> list[str]:
    return ["--device", "cpu", "--log-level", "WARNING", "--pool", f"glm-5.2:{16 * PAGE_SIZE}",
            "--pool-layers", str(NUM_LAYERS), "--host-memory", "4MiB", "--tiers", "host,mooncake",
            "--mooncake-master", master.master, "--mooncake-metadata", master.metadata,
            "--mooncake-segment-size", "64MiB"]


@pytest.fixture
def two_daemons(mooncake_master):
    with DaemonProcess(extra_args=daemon_args(mooncake_master)) as a, \
            DaemonProcess(extra_args=daemon_args(mooncake_master)) as b, \
            KVTierClient(a.address, timeout=60) as ca, KVTierClient(b.address, timeout=60) as cb:
        yield ca, cb


def store_prefix(c: KVTierClient, keys: list[bytes], seed: int, pool: str = "default"):
    """One request on ``c``: nothing loaded, seeded KV written into the fresh pages, stored, released.
    Returns the KV written."""
    lease = c.load_prefix(pool, keys)
    try:
        assert lease.loaded_pages == 0
        latent, index = random_kv(lease.slots.numel(), seed)
        c.write_kv(pool, lease.slots, latent=latent, index=index)
        c.store_prefix(lease, keys, lease.slots)
    finally:
        c.release_prefix(lease)
    return latent, index


def verify_loaded_from_store(c: KVTierClient, keys: list[bytes], latent, index, pool: str = "default") -> None:
    """``c`` finds every page of ``keys`` in tier mooncake only, loads them, and reads back ``latent``/``index``."""
    assert c.where_is(pool, keys) == [["mooncake"]] * len(keys)
    found = c.lookup_prefix(pool, keys)
    assert found.tiers == ["mooncake"] * len(keys) and found.per_tier["mooncake"] == len(keys)
    lease = c.load_prefix(pool, keys)
    try:
        assert lease.tiers == ["mooncake"] * len(keys)
        verify_kv(c.read_kv(pool, lease.slots), latent, index)
    finally:
        c.release_prefix(lease)


def wait_health(c: KVTierClient, status: str, timeout_s: float = 90.0) -> None:
    """Poll the daemon's health service for the mooncake tier until it says ``status``."""
    deadline = time.monotonic() + timeout_s
    while (got := c.health(TIER_SERVICE)) != status:
        assert time.monotonic() < deadline, f"{TIER_SERVICE} still {got}, expected {status}"
        time.sleep(0.2)


def test_a_prefix_stored_by_one_daemon_is_loaded_byte_exact_by_the_other(two_daemons):
    ca, cb = two_daemons
    assert ca.health(TIER_SERVICE) == cb.health(TIER_SERVICE) == "SERVING"
    keys = page_keys(list(range(4 * PAGE_SIZE)), PAGE_SIZE)
    latent, index = store_prefix(ca, keys, seed=1)
    verify_loaded_from_store(cb, keys, latent, index)
    moves = cb.tier_stats("default").moves
    assert moves["mooncake->device"]["count"] == 4
    assert ca.tier_stats("default").moves["device->mooncake"]["count"] == 4
    # a longer request shares the first 4 pages: longest-prefix semantics across daemons
    longer = page_keys(list(range(6 * PAGE_SIZE)), PAGE_SIZE)
    assert longer[:4] == keys
    assert cb.where_is("default", longer) == [["device", "mooncake"]] * 4 + [[]] * 2  # b keeps what it loaded
    assert cb.lookup_prefix("default", longer).tiers == ["device"] * 4


def test_another_models_pages_miss(two_daemons):
    ca, cb = two_daemons
    keys = page_keys(list(range(1000, 1000 + 3 * PAGE_SIZE)), PAGE_SIZE)
    store_prefix(ca, keys, seed=2)
    cb.create_pool("glm-5.2", num_layers=4, size_tokens=8 * PAGE_SIZE, pool_id="four")  # another fingerprint
    assert cb.where_is("four", keys) == [[]] * 3
    lease = cb.load_prefix("four", keys)
    assert lease.loaded_pages == 0
    cb.release_prefix(lease)


def test_master_killed_lookups_miss_and_restart_recovers(mooncake_master, two_daemons):
    """Scenario: the store's master dies while two daemons use it. Lookups become misses (no error),
    a load allocates fresh pages instead of serving anything, StorePrefix still succeeds, and health
    says NOT_SERVING for kvtier.tier.mooncake. The master restarts (empty): both tiers come back by
    themselves and share new prefixes again."""
    ca, cb = two_daemons
    keys = page_keys(list(range(5000, 5000 + 3 * PAGE_SIZE)), PAGE_SIZE)
    latent, index = store_prefix(ca, keys, seed=3)
    verify_loaded_from_store(cb, keys, latent, index)
    other = page_keys(list(range(7000, 7000 + 2 * PAGE_SIZE)), PAGE_SIZE)
    store_prefix(ca, other, seed=4)

    mooncake_master.kill()
    assert cb.lookup_prefix("default", other).tiers == []  # the store is asked, fails: a miss
    wait_health(cb, "NOT_SERVING")
    assert cb.health() == "SERVING"  # the daemon itself serves on
    lease = cb.load_prefix("default", other)
    assert lease.loaded_pages == 0 and lease.slots.numel() == 2 * PAGE_SIZE
    cb.release_prefix(lease)
    fresh = page_keys(list(range(9000, 9000 + 2 * PAGE_SIZE)), PAGE_SIZE)
    store_prefix(ca, fresh, seed=5)  # the publish is dropped, the call succeeds
    wait_health(ca, "NOT_SERVING")

    mooncake_master.start()
    wait_health(ca, "SERVING")
    wait_health(cb, "SERVING")
    assert cb.where_is("default", other) == [[]] * 2  # a restarted master lost every object
    again = page_keys(list(range(11000, 11000 + 3 * PAGE_SIZE)), PAGE_SIZE)
    latent, index = store_prefix(ca, again, seed=6)
    verify_loaded_from_store(cb, again, latent, index)


def test_tiers_from_a_config_file_with_flags_over_it(mooncake_master, tmp_path):
    """The stack and the store's address come from ``[tiers]``/``[tiers.mooncake]``, a flag overrides
    one of its keys; the daemon serves the tier (health SERVING) and publishes stored pages to it."""
    cfg = tmp_path / "kvtier.toml"
    cfg.write_text(f'device = "cpu"\nlog_level = "WARNING"\nhost_memory_bytes = "4MiB"\n\n[tiers]\n'
                   f'stack = ["host", "mooncake"]\n\n[tiers.mooncake]\nmaster = "{mooncake_master.master}"\n'
                   f'metadata = "http://127.0.0.1:1/metadata"\nglobal_segment_bytes = "32MiB"\n')
    args = ["--config", str(cfg), "--mooncake-metadata", mooncake_master.metadata,
            "--pool", f"glm-5.2:{8 * PAGE_SIZE}", "--pool-layers", str(NUM_LAYERS)]
    with DaemonProcess(extra_args=args) as d, KVTierClient(d.address, timeout=60) as c:
        assert c.health(TIER_SERVICE) == "SERVING"
        keys = page_keys(list(range(2 * PAGE_SIZE)), PAGE_SIZE)
        store_prefix(c, keys, seed=7)
        assert c.where_is("default", keys) == [["device", "mooncake"]] * 2
        assert "mooncake" in c.tier_stats().tiers


TOKEN_A = "tenant-a-secret-0123456789abcdef"
TOKEN_B = "tenant-b-secret-0123456789abcdef"


def test_a_tenants_prefix_is_found_by_that_tenant_on_the_other_daemon_and_missed_by_another(mooncake_master, tmp_path):
    """Scenario: two daemons with the same tokens file (tenants team-a, team-b) on one master; each
    tenant has a pool ``p`` of the same model on both. team-a stores a prefix on daemon 1: team-a finds
    it on daemon 2 in tier mooncake and loads it byte-exact; team-b asks for the same page keys on
    either daemon and misses (its tier keys carry its tenant, so its store keys differ). team-b then
    stores the same prompt with other KV on daemon 2: daemon 1 loads team-b's own bytes for team-b,
    never team-a's. The store has no per-tenant quota; each daemon's ledger counts the tenant's bytes
    it put there."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = "team-a"\n"{TOKEN_B}" = "team-b"\n')
    os.chmod(tokens, 0o600)
    args = ["--device", "cpu", "--log-level", "WARNING", "--auth-tokens", str(tokens), "--host-memory", "4MiB",
            "--tiers", "host,mooncake", "--mooncake-master", mooncake_master.master,
            "--mooncake-metadata", mooncake_master.metadata, "--mooncake-segment-size", "64MiB"]
    keys = page_keys(list(range(3 * PAGE_SIZE)), PAGE_SIZE)
    with DaemonProcess(extra_args=args) as d1, DaemonProcess(extra_args=args) as d2, \
            KVTierClient(d1.address, token=TOKEN_A, timeout=60) as a1, KVTierClient(d2.address, token=TOKEN_A, timeout=60) as a2, \
            KVTierClient(d1.address, token=TOKEN_B, timeout=60) as b1, KVTierClient(d2.address, token=TOKEN_B, timeout=60) as b2:
        for c in (a1, a2, b1, b2):
            c.create_pool("glm-5.2", num_layers=NUM_LAYERS, size_tokens=16 * PAGE_SIZE, pool_id="p")
        latent_a, index_a = store_prefix(a1, keys, seed=21, pool="p")
        verify_loaded_from_store(a2, keys, latent_a, index_a, pool="p")
        for b in (b2, b1):
            assert b.where_is("p", keys) == [[]] * 3
            assert b.lookup_prefix("p", keys).tiers == []
            lease = b.load_prefix("p", keys)
            assert lease.loaded_pages == 0 and lease.tiers == []
            b.release_prefix(lease)

        latent_b, index_b = store_prefix(b2, keys, seed=22, pool="p")
        assert b2.tier_stats("p").moves["device->mooncake"]["count"] == 3  # team-b's pages are objects of their own
        verify_loaded_from_store(b1, keys, latent_b, index_b, pool="p")
        assert not all(bool((latent_a[l] == latent_b[l]).all()) for l in latent_a)  # the two tenants' KV differ

        # no per-tenant quota on the shared store; each daemon's ledger counts what the tenant put through it
        page_payload = NUM_LAYERS * PAGE_SIZE * ROW_BYTES + len(LIVE_LAYERS) * INDEX_PAGE_BYTES + PAGE_SIZE * 8
        rows = {(name, c): c.tier_stats().tiers["mooncake"] for name, c in (("a1", a1), ("a2", a2), ("b1", b1), ("b2", b2))}
        a_on_1, b_on_2 = rows[("a1", a1)], rows[("b2", b2)]
        assert a_on_1["tenant_used_bytes"] == b_on_2["tenant_used_bytes"] >= 3 * page_payload
        assert rows[("b1", b1)]["tenant_used_bytes"] == rows[("a2", a2)]["tenant_used_bytes"] == 0  # loaded, not put
        assert a_on_1["used_bytes"] == a_on_1["tenant_used_bytes"]  # daemon 1 put team-a's objects only
        assert all(r["tenant_quota_bytes"] is None for r in rows.values())


def test_the_mooncake_tier_in_the_metrics(mooncake_master, tmp_path):
    """Scenario, one daemon (GLM-5.2's first 4 layers, page records of 194,048 bytes) with ``--tiers
    host,mooncake`` and metrics: 3 pages stored in pool ``default`` are published (3 moves
    device->mooncake of 3 records' bytes; the tier's used bytes are those 3 records: the ledger of
    what this daemon put; capacity is the ledger's default 16 GiB); a second pool of the same layout
    loads them from the store (3 hits of tier mooncake). The master is killed: healthy 0, GetStats says
    why, and 2 new pages stored meanwhile are counted device->mooncake(unhealthy) (0 bytes), never
    gone."""
    args = ["--device", "cpu", "--log-level", "WARNING", "--pool", "default=glm-5.2:512", "--pool-layers", "4",
            *metrics_flags(tmp_path), "--host-memory", "4MiB", "--tiers", "host,mooncake",
            "--mooncake-master", mooncake_master.master, "--mooncake-metadata", mooncake_master.metadata,
            "--mooncake-segment-size", "64MiB"]
    keys = page_keys(list(range(50_000, 50_000 + 5 * PAGE_SIZE)), PAGE_SIZE)
    with DaemonProcess(extra_args=args) as d, KVTierClient(d.address, timeout=60) as c:
        address = c.stats().metrics_address
        before = scrape(address)
        assert value(before, "kvtier_tier_healthy", tier="mooncake") == 1
        assert value(before, "kvtier_tier_used_bytes", tier="mooncake") == 0
        assert value(before, "kvtier_tier_capacity_bytes", tier="mooncake") == 16 << 30
        assert put_prefix_pages(c, "default", keys[:3], seed=1) == []
        c.create_pool("glm-5.2", num_layers=4, size_tokens=8 * PAGE_SIZE, pool_id="two")
        assert put_prefix_pages(c, "two", keys[:3], seed=1) == ["mooncake"] * 3
        m = scrape(address)
        assert value(m, "kvtier_tier_used_bytes", tier="mooncake") == 3 * RECORD
        assert value(m, "kvtier_moves_total", src="device", dst="mooncake") == 3
        assert value(m, "kvtier_moved_bytes_total", src="device", dst="mooncake") == 3 * RECORD
        assert value(m, "kvtier_moves_total", src="mooncake", dst="device") == 3
        assert value(m, "kvtier_hit_pages_total", tier="mooncake", tenant="default") == 3
        assert value(m, "kvtier_miss_pages_total", tenant="default") == 3

        mooncake_master.kill()
        assert c.lookup_prefix("default", keys[3:]).tiers == []  # the store is asked, fails: a miss
        wait_health(c, "NOT_SERVING")
        assert put_prefix_pages(c, "default", keys[3:], seed=2) == []
        m = scrape(address)
        row = next(t for t in c.stats().tiers if t.tier == "mooncake")
    assert value(m, "kvtier_tier_healthy", tier="mooncake") == 0
    assert row.unhealthy and "RPC_FAIL" in row.unhealthy_reason
    assert value(m, "kvtier_moves_total", src="device", dst="mooncake(unhealthy)") == 2
    assert value(m, "kvtier_moved_bytes_total", src="device", dst="mooncake(unhealthy)") == 0
    assert value(m, "kvtier_moves_total", src="device", dst="gone") == 0
    assert value(m, "kvtier_moves_total", src="device", dst="mooncake") == 3
    assert value(m, "kvtier_miss_pages_total", tenant="default") == 5
