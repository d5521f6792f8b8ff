"""``--metrics-port``: a real daemon's /metrics, scraped over 127.0.0.1 with its bearer token
(``--metrics-token-file``) and parsed with prometheus-client's own parser, holds what the test did:
pages missed and hit per tier, records moved between tiers, evictions, tier usage in bytes, free pool
pages and one latency sample per RPC. A scrape without the token gets 401 and nothing else.

Expected values are worked out here from the scenario and the record layout (a GLM-5.2 page record of
the first 4 layers is 194,048 bytes, README "Replay"; LMDB charges whole 4 KiB overflow pages plus
256 bytes of index entries), not read back from the daemon.
"""

from __future__ import annotations

import json
import logging
import os
import resource

import pytest

from kv_helpers import PAGE_SIZE, put_prefix_pages
from metrics_kit import METRICS_TOKEN, get, metrics_flags, scrape, value

from kvtier.client import KVTierClient
from kvtier.client.errors import NotFoundError, UnauthenticatedError
from kvtier.client.spawn import DaemonProcess
from kvtier.page_keys import page_keys

RECORD = 194_048  # one page record: 4 layers x 64 x 656 latent + 3 live layers x 8448 indexer + header and slots
POOL_PAGE = 4 * 64 * 656 + 3 * 64 * 132  # pool bytes of one page: 193,280
LMDB_PAGE = resource.getpagesize()
DISK_CHARGE = -(-(RECORD + 16) // LMDB_PAGE) * LMDB_PAGE + 256


def test_metrics_hold_what_the_test_did(tmp_path):
    """Requests over a pool of 8 pages with a host tier of 2 records above a disk tier:

    A. keys k0-k3, nothing cached: 4 misses; B. the same again: 4 device hits; C. k4-k7: 4 misses into
    the 4 free pages; D. k8-k11: 4 misses, the pool evicts k0-k3 (LRU) to the host tier, which keeps
    2 and spills k0, k1 to disk; E. keys [k2, k3]: 2 host hits; the pool evicts k4, k5, and since the
    host tier's 2 records are pinned by this load they go straight to disk.
    """
    args = ["--device", "cpu", "--pool", "default=glm-5.2:512", "--pool-layers", "4", *metrics_flags(tmp_path),
            "--host-memory", str(2 * RECORD + 1000), "--disk-path", str(tmp_path / "disk"), "--disk-size", "64MiB"]
    with DaemonProcess(extra_args=args) as d, KVTierClient(d.address, timeout=60) as c:
        address = c.stats().metrics_address
        keys = page_keys(list(range(12 * PAGE_SIZE)), PAGE_SIZE)
        before = scrape(address)
        assert value(before, "kvtier_pool_free_pages", pool="default", tenant="default") == 8
        assert value(before, "kvtier_tier_healthy", tier="disk") == 1
        assert put_prefix_pages(c, "default", keys[0:4], seed=1) == []
        assert put_prefix_pages(c, "default", keys[0:4], seed=1) == ["device"] * 4
        put_prefix_pages(c, "default", keys[4:8], seed=2)
        put_prefix_pages(c, "default", keys[8:12], seed=3)
        assert c.where_is("default", keys[0:4]) == [["disk"], ["disk"], ["host"], ["host"]]
        assert put_prefix_pages(c, "default", keys[2:4], seed=4) == ["host", "host"]
        try:
            c.describe_pool("no-such-pool")
        except NotFoundError:
            pass
        m = scrape(address)

    assert value(m, "kvtier_miss_pages_total", tenant="default") == 12
    assert value(m, "kvtier_hit_pages_total", tier="device", tenant="default") == 4
    assert value(m, "kvtier_hit_pages_total", tier="host", tenant="default") == 2
    assert value(m, "kvtier_hit_pages_total", tier="disk", tenant="default") == 0
    moves = {("device", "host"): 4, ("host", "disk"): 2, ("device", "disk"): 2, ("host", "device"): 2}
    for (src, dst), n in moves.items():
        assert value(m, "kvtier_moves_total", src=src, dst=dst) == n, (src, dst)
        assert value(m, "kvtier_moved_bytes_total", src=src, dst=dst) == n * RECORD, (src, dst)
    assert not [k for k in m if k[0] == "kvtier_moves_total" and dict(k[1]).get("dst") == "gone"]
    assert value(m, "kvtier_evictions_total", tier="device") == 6
    assert value(m, "kvtier_evictions_total", tier="host") == 2
    assert value(m, "kvtier_evictions_total", tier="disk") == 0
    assert value(m, "kvtier_tier_used_bytes", tier="host") == 2 * RECORD
    assert value(m, "kvtier_tier_used_bytes", tier="disk") == 4 * DISK_CHARGE
    assert value(m, "kvtier_tier_used_bytes", tier="device") == 8 * POOL_PAGE
    assert value(m, "kvtier_tier_capacity_bytes", tier="device") == 8 * POOL_PAGE
    assert value(m, "kvtier_tier_capacity_bytes", tier="host") == 2 * RECORD + 1000
    assert value(m, "kvtier_pool_free_pages", pool="default", tenant="default") == 0
    assert value(m, "kvtier_checksum_failures_total", tier="disk") == 0
    for tier in ("device", "host", "disk"):
        assert value(m, "kvtier_tier_healthy", tier=tier) == 1
    rpc = "kvtier_rpc_duration_seconds_count"
    assert value(m, rpc, method="kvtier.v1.TierService/LoadPrefix", code="OK", tenant="default") == 5
    assert value(m, rpc, method="kvtier.v1.TierService/StorePrefix", code="OK", tenant="default") == 3
    assert value(m, rpc, method="kvtier.v1.PoolService/WriteKV", code="OK", tenant="default") == 3
    assert value(m, rpc, method="kvtier.v1.PoolService/DescribePool", code="NOT_FOUND", tenant="default") == 1
    assert value(m, "kvtier_rpc_duration_seconds_bucket", method="kvtier.v1.TierService/LoadPrefix", code="OK",
                 tenant="default", le="+Inf") == 5
    # tenant on the rows of one tenant only (pools, prefix caches, calls); tier rows are daemon-wide
    with_tenant = {k[0] for k in m if "tenant" in dict(k[1]) and not k[0].endswith("_created")}
    assert with_tenant == {"kvtier_pool_free_pages", "kvtier_hit_pages_total", "kvtier_miss_pages_total",
                           "kvtier_rpc_duration_seconds_count", "kvtier_rpc_duration_seconds_sum",
                           "kvtier_rpc_duration_seconds_bucket"}, with_tenant


def test_prefix_calls_on_the_attach_connection_are_timed_like_rpcs(tmp_path):
    """A worker attached to an 8-page pool makes its prefix calls on the attach connection: a load
    of 3 new keys (a miss: 3 fresh pages), their store with release, the same load again (3 hits),
    its release, then a second release and a store of that released lease (both NOT_FOUND). The RPC
    histogram must count them under ``kvtier.attach/<Method>`` with each reply's code and the
    session's tenant -- 2 loads OK, 1 store OK and 1 NOT_FOUND, 1 release OK and 1 NOT_FOUND -- and
    none under the gRPC method names (the calls never went over gRPC; before, they were not timed)."""
    args = ["--device", "cpu", "--pool", "default=glm-5.2:512", "--pool-layers", "4", *metrics_flags(tmp_path),
            "--host-memory", "16MiB"]
    keys = page_keys(list(range(3 * PAGE_SIZE)), PAGE_SIZE)
    with DaemonProcess(extra_args=args) as d, KVTierClient(d.address, timeout=60) as c:
        with c.attach("default") as ap:
            miss = ap.load_prefix(keys)
            assert miss.tiers == [] and miss.slots.numel() == 3 * PAGE_SIZE
            assert ap.store_prefix(miss, keys, miss.slots, release=True) == 3
            hit = ap.load_prefix(keys)
            assert hit.tiers == ["device"] * 3
            ap.release_prefix(hit)
            with pytest.raises(NotFoundError):
                ap.release_prefix(hit)
            with pytest.raises(NotFoundError):
                ap.store_prefix(hit, keys, hit.slots)
            m = scrape(c.stats().metrics_address)

    rpc = "kvtier_rpc_duration_seconds_count"
    counts = {(dict(k[1])["method"], dict(k[1])["code"]): v for k, v in m.items()
              if k[0] == rpc and "Prefix" in dict(k[1])["method"]}
    assert counts == {("kvtier.attach/LoadPrefix", "OK"): 2, ("kvtier.attach/StorePrefix", "OK"): 1,
                      ("kvtier.attach/StorePrefix", "NOT_FOUND"): 1, ("kvtier.attach/ReleasePrefix", "OK"): 1,
                      ("kvtier.attach/ReleasePrefix", "NOT_FOUND"): 1}, counts
    assert value(m, rpc, method="kvtier.attach/LoadPrefix", code="OK", tenant="default") == 2
    assert value(m, "kvtier_rpc_duration_seconds_bucket", method="kvtier.attach/ReleasePrefix", code="NOT_FOUND",
                 tenant="default", le="+Inf") == 1


TOKEN_A = "metrics-team-a-0123456789abcdef"
TOKEN_B = "metrics-team-b-0123456789abcdef"


def test_tenant_label_on_pools_prefix_caches_and_calls(tmp_path):
    """Two tenants (bearer tokens) each create a pool named ``p`` (8 and 16 pages) and ask for the
    same 4 page keys: team-a twice (4 misses, then 4 device hits), team-b once (4 misses: tenants
    never share pages). A call without a token is refused. The rows carry the tenant of the pool, the
    cache and the authenticated caller; the refused call is timed with tenant "" and its code."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = "team-a"\n"{TOKEN_B}" = "team-b"\n')
    os.chmod(tokens, 0o600)
    args = ["--device", "cpu", "--auth-tokens", str(tokens), *metrics_flags(tmp_path), "--host-memory", "16MiB"]
    keys = page_keys(list(range(4 * PAGE_SIZE)), PAGE_SIZE)
    with DaemonProcess(extra_args=args) as d, KVTierClient(d.address, token=TOKEN_A, timeout=60) as a, \
            KVTierClient(d.address, token=TOKEN_B, timeout=60) as b:
        a.create_pool("glm-5.2", num_layers=4, size_tokens=8 * PAGE_SIZE, pool_id="p")
        b.create_pool("glm-5.2", num_layers=4, size_tokens=16 * PAGE_SIZE, pool_id="p")
        assert put_prefix_pages(a, "p", keys, seed=1) == []
        assert put_prefix_pages(a, "p", keys, seed=1) == ["device"] * 4
        assert put_prefix_pages(b, "p", keys, seed=2) == []
        with KVTierClient(d.address, token="", timeout=60) as anon, pytest.raises(UnauthenticatedError):
            anon.list_pools()
        m = scrape(a.stats().metrics_address)

    assert value(m, "kvtier_pool_free_pages", pool="p", tenant="team-a") == 8 - 4
    assert value(m, "kvtier_pool_free_pages", pool="p", tenant="team-b") == 16 - 4
    assert value(m, "kvtier_hit_pages_total", tier="device", tenant="team-a") == 4
    assert ("kvtier_hit_pages_total", (("tenant", "team-b"), ("tier", "device"))) in m
    assert value(m, "kvtier_hit_pages_total", tier="device", tenant="team-b") == 0
    assert value(m, "kvtier_miss_pages_total", tenant="team-a") == 4
    assert value(m, "kvtier_miss_pages_total", tenant="team-b") == 4
    rpc = "kvtier_rpc_duration_seconds_count"
    assert value(m, rpc, method="kvtier.v1.TierService/LoadPrefix", code="OK", tenant="team-a") == 2
    assert value(m, rpc, method="kvtier.v1.TierService/LoadPrefix", code="OK", tenant="team-b") == 1
    assert value(m, rpc, method="kvtier.v1.PoolService/CreatePool", code="OK", tenant="team-b") == 1
    assert value(m, rpc, method="kvtier.v1.PoolService/ListPools", code="UNAUTHENTICATED", tenant="") == 1
    assert not [k for k in m if k[0] == rpc and dict(k[1]).get("tenant") == "default"]  # no such tenant here


def test_a_scrape_without_the_token_is_401_and_reads_nothing(tmp_path):
    """Scenario (security pass, D8): /metrics was plain HTTP without authentication, so every local user
    read tenant names, pool ids and per-tenant call counts. Now, with ``--metrics-token-file``, only
    ``Authorization: Bearer <the file's token>`` is answered 200; no header, another token, the token
    with a letter changed or cut short, or the right token under another scheme are each 401 with
    ``WWW-Authenticate: Bearer`` and an empty body (no tenant, pool or metric name)."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = "team-a"\n')
    os.chmod(tokens, 0o600)
    args = ["--device", "cpu", "--auth-tokens", str(tokens), *metrics_flags(tmp_path), "--host-memory", "16MiB"]
    with DaemonProcess(extra_args=args) as d, KVTierClient(d.address, token=TOKEN_A, timeout=60) as a:
        a.create_pool("glm-5.2", num_layers=4, size_tokens=8 * PAGE_SIZE, pool_id="secret-pool")
        address = a.stats().metrics_address
        refused = [get(address, None), get(address, TOKEN_A), get(address, METRICS_TOKEN[:-1]),
                   get(address, METRICS_TOKEN[:-1] + "X"), get(address, METRICS_TOKEN, scheme="Basic"),
                   get(address, METRICS_TOKEN + " extra"), get(address, "")]
        status, _, body = get(address, METRICS_TOKEN)
        lower_scheme = get(address, METRICS_TOKEN, scheme="bearer")[0]
    for code, headers, data in refused:
        assert (code, data) == (401, b""), (code, data[:200])
        assert headers.get("WWW-Authenticate", "").startswith("Bearer"), headers
    assert status == 200 and lower_scheme == 200  # the scheme is case-insensitive (RFC 7235)
    text = body.decode()
    assert 'pool="secret-pool"' in text and 'tenant="team-a"' in text


def test_insecure_metrics_are_served_without_a_token_and_say_so(tmp_path):
    """``--metrics-insecure`` is the explicit opt-out: /metrics answers without a token, and the daemon
    logs one WARNING at start saying who can read what."""
    args = ["--device", "cpu", "--pool", "default=glm-5.2:512", "--pool-layers", "4", "--metrics-port", "0",
            "--metrics-insecure", "--host-memory", "16MiB"]
    with DaemonProcess(extra_args=args) as d, KVTierClient(d.address, timeout=60) as c:
        m = scrape(c.stats().metrics_address, token=None)
        log = d.log_path.read_text()
    assert value(m, "kvtier_pool_free_pages", pool="default", tenant="default") == 8
    warning = [line for line in log.splitlines() if "without a token (--metrics-insecure)" in line]
    assert len(warning) == 1 and "WARNING" in warning[0] and "tenant names, pool ids" in warning[0], log


def test_json_logs_and_no_secret_in_them(capsys):
    """--log-format json writes one JSON object a line; a bearer token or a private key in a message
    (or in an exception's text) is redacted before any handler writes it."""
    from kvtier.server.observe.logs import configure_logging

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        configure_logging("INFO", "json")
        log = logging.getLogger("kvtier.test")
        log.info("client sent authorization: Bearer s3cr3t-token for pool %s", "p")
        try:
            raise ValueError("bad metadata ('authorization', 'Bearer tok-XYZ')")
        except ValueError:
            log.exception("call failed")
        log.warning("key -----BEGIN PRIVATE KEY-----\nMIIEv\n-----END PRIVATE KEY----- loaded")
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert [rec["level"] for rec in lines] == ["INFO", "ERROR", "WARNING"]
    assert lines[0]["logger"] == "kvtier.test" and lines[0]["message"].endswith("for pool p")
    text = json.dumps(lines)
    assert "s3cr3t" not in text and "tok-XYZ" not in text and "MIIEv" not in text
    assert "Bearer <redacted>" in lines[0]["message"] and "ValueError" in lines[1]["exception"]
