"""``kvtier serve`` tier flags and the ``[tiers]`` table: the file's table with the flags over it;
a bad key is a usage error before anything starts."""

from __future__ import annotations

import subprocess
import sys

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess

MiB = 1 << 20


def test_flags_go_over_the_files_tiers_table(tmp_path):
    cfg = tmp_path / "kvtier.toml"
    cfg.write_text(f'device = "cpu"\nlog_level = "WARNING"\nhost_memory_bytes = "2MiB"\n\n[tiers]\n'
                   f'disk_path = "{tmp_path / "disk"}"\ndisk_bytes = "4MiB"\ndisk_reserve_fraction = 0.5\n')
    with DaemonProcess(extra_args=["--config", str(cfg), "--disk-size", "8MiB"]) as d, KVTierClient(d.address) as c:
        tiers = c.tier_stats().tiers
        assert tiers["host"]["capacity_bytes"] == 2 * MiB
        assert tiers["disk"]["capacity_bytes"] == 4 * MiB  # half of the 8 MiB map (reserve 0.5 from the file)
        usage = {t.tier: t.budget_bytes for t in c.stats().tiers}
        assert usage["host"] == 2 * MiB and usage["disk"] == 4 * MiB
    assert (tmp_path / "disk" / "data.mdb").is_file()


def test_bad_tiers_key_is_a_usage_error(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[tiers]\ndisk_size = "1GiB"\n')
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown [tiers] keys ['disk_size']" in r.stderr
