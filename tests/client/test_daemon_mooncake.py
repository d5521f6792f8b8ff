"""Two kvtier daemons sharing one real Mooncake Store (``mooncake_master`` with its HTTP metadata
server, 127.0.0.1): a prefix one daemon stores is found in tier ``mooncake`` by the other and loaded
byte-exact; another model's pages miss; a master that dies turns the tier unhealthy (misses, health
NOT_SERVING, nothing wrong served) and a restarted one brings it back by itself.

The expected bytes are the test's own seeded KV (``kv_helpers.random_kv``), never read back from the
daemon that wrote them. A tenant test belongs here once tenants land (another tenant's pages miss).
"""

from __future__ import annotations

import time

import pytest

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess
from kvtier.page_keys import page_keys

from kv_helpers import NUM_LAYERS, PAGE_SIZE, random_kv, verify_kv

TIER_SERVICE = "kvtier.tier.mooncake"


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
