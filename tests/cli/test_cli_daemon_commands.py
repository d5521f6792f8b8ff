"""`kvtier status` and `kvtier pools` against a real daemon (tables and --json)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvtier.cli import main


def test_pools_json_lists_the_pool(daemon, client, pool):
    client.allocate_slots(pool, 65)  # two pages
    r = CliRunner().invoke(main, ["pools", "--server", daemon.address, "--json"])
    assert r.exit_code == 0, r.output
    mine = [p for p in json.loads(r.output) if p["pool_id"] == pool][0]
    assert mine["size_tokens"] == 1024 and mine["used_pages"] == 2 and mine["free_pages"] == 14
    assert mine["layout"]["skip_mask"] == "FFFSSSFS" and mine["live_layers"] == [0, 1, 2, 6]
    assert mine["layout"]["model_name"] == "glm-5.2" and mine["layout"]["latent_row_bytes"] == 656


def test_pools_table(daemon, pool):
    r = CliRunner().invoke(main, ["pools", "--server", daemon.address], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert pool in r.output and "glm-5.2" in r.output and "8/4" in r.output
    assert "0-7" in r.output  # the layer range: the pool's first 8 layers of the model


def test_pools_table_shows_a_stage_pools_model_layers(client):
    """New-user pass: a pipeline stage's pool showed only '19/4'; its model layers show too."""
    client.create_pool("glm-5.2", start_layer=19, end_layer=38, size_tokens=256, pool_id="stage-1")
    try:
        r = CliRunner().invoke(main, ["pools", "--server", client.address], terminal_width=220)
        assert r.exit_code == 0, r.output
        row = [line for line in r.output.splitlines() if "stage-1" in line][0]
        assert "19-37" in row and "19/" in row
    finally:
        client.delete_pool("stage-1", force=True)


def test_status_json_and_table(daemon, pool):
    r = CliRunner().invoke(main, ["status", "--server", daemon.address, "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert s["health"] == "SERVING" and s["max_message_bytes"] == 4 * 1024 * 1024 and s["device"] == "cpu"
    assert {t["tier"] for t in s["tiers"]} == {"device", "host"}
    assert pool in [p["pool_id"] for p in s["pools"]]
    t = CliRunner().invoke(main, ["status", "--server", daemon.address], terminal_width=200)
    assert t.exit_code == 0 and "SERVING" in t.output and "host" in t.output


def test_status_shows_each_pools_open_leases_and_pinned_pages(daemon, client, pool):
    """Scenario: 3 pages are stored in the pool's prefix cache (keys k0-k2), then three leases are
    opened: k0-k1 (2 cached pages), k0-k2 (3 cached pages; k0 and k1 now pinned twice) and a new key
    (1 fresh page, which is the lease's own, not a pinned cached page). ``kvtier status --json``
    must show the pool with 3 open leases and 3 pinned pages (the distinct cached pages the leases
    hold; they were only in GetTierStats before), the table the same row, and 0 and 0 once every
    lease is released."""
    keys = [b"status-leases-%d" % i for i in range(4)]
    first = client.load_prefix(pool, keys[:3])
    assert client.store_prefix(first, keys[:3], first.slots, release=True) == 3
    leases = [client.load_prefix(pool, keys[:2]), client.load_prefix(pool, keys[:3]), client.load_prefix(pool, keys[3:])]
    assert [len(x.slots) for x in leases] == [2 * 64, 3 * 64, 64]

    def mine() -> dict:
        r = CliRunner().invoke(main, ["status", "--server", daemon.address, "--json"])
        assert r.exit_code == 0, r.output
        return next(p for p in json.loads(r.output)["pools"] if p["pool_id"] == pool)

    try:
        got = mine()
        assert (got["open_leases"], got["pinned_pages"]) == (3, 3)
        assert got["used_tokens"] == (3 + 1) * 64  # the 3 cached pages and the fresh one
        t = CliRunner().invoke(main, ["status", "--server", daemon.address], terminal_width=200)
        assert t.exit_code == 0, t.output
        row = next(line for line in t.output.splitlines() if pool in line)
        cells = [c.strip() for c in row.strip().strip("│").split("│")]
        assert cells == [pool, "glm-5.2", "256", "1,024", "3", "3"], row
    finally:
        for lease in leases:
            client.release_prefix(lease)
    got = mine()
    assert (got["open_leases"], got["pinned_pages"]) == (0, 0)


def test_status_of_no_daemon_is_a_clean_error(tmp_path):
    r = CliRunner().invoke(main, ["status", "--server", f"unix://{tmp_path}/none.sock", "--timeout", "2"])
    assert r.exit_code == 1 and "UNAVAILABLE" in r.output and "Traceback" not in r.output


def test_status_without_a_daemon_says_so(tmp_path):
    """``kvtier status`` against a socket nobody serves explains that no daemon answers, exit 1."""
    from click.testing import CliRunner

    from kvtier.cli import main

    result = CliRunner().invoke(main, ["status", "--server", f"unix://{tmp_path}/none.sock", "--timeout", "2"])
    assert result.exit_code == 1
    assert f"no kvtier daemon answers at unix://{tmp_path}/none.sock (start one" in result.output


def test_status_and_pools_honour_kvtier_token(tmp_path):
    """On a daemon with tenants, `kvtier status` and `kvtier pools` use KVTIER_TOKEN; without a known
    token they stop with one line saying to set it."""
    import os

    from kvtier.client.spawn import DaemonProcess

    token = "cli-tenant-token-0123456789"
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{token}" = "cli"\n')
    os.chmod(tokens, 0o600)
    with DaemonProcess(extra_args=["--device", "cpu", "--auth-tokens", str(tokens), "--log-level", "WARNING"]) as d:
        from kvtier.client import KVTierClient

        with KVTierClient(d.address, token=token) as c:
            c.create_pool("glm-5.2", num_layers=2, size_tokens=128, pool_id="mine")
        runner = CliRunner()
        r = runner.invoke(main, ["status", "--server", d.address, "--json"], env={"KVTIER_TOKEN": token})
        assert r.exit_code == 0, r.output
        s = json.loads(r.output)
        assert s["tenant"] == "cli" and [p["pool_id"] for p in s["pools"]] == ["mine"]
        t = runner.invoke(main, ["status", "--server", d.address], env={"KVTIER_TOKEN": token}, terminal_width=200)
        assert t.exit_code == 0 and "tenant cli: 1 pool," in t.output
        for cmd in ("status", "pools"):
            bad = runner.invoke(main, [cmd, "--server", d.address], env={"KVTIER_TOKEN": None})
            assert bad.exit_code == 1 and "set KVTIER_TOKEN" in bad.output and "Traceback" not in bad.output
            assert len(bad.output.strip().splitlines()) == 1
