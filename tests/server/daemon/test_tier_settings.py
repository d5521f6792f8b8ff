"""The configured stack: ``stack`` names (``--tiers``) and the ``[tiers.mooncake]`` table, each tier
from its typed config; bad names or keys are clear errors before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier.server.daemon.tier_runtime import build_stack
from kvtier.server.daemon.tier_settings import TierSettings, mooncake_config

MiB = 1 << 20


def test_default_stack_is_host_plus_disk_when_a_path_is_set(tmp_path):
    assert TierSettings().tier_names == ("host",)
    assert TierSettings(disk_path=str(tmp_path)).tier_names == ("host", "disk")


def test_tiers_table_with_a_stack_list_and_a_mooncake_table():
    s = TierSettings.coerce({"stack": ["host", "mooncake"],
                             "mooncake": {"master": "10.0.0.5:50051", "metadata": "P2PHANDSHAKE",
                                          "global_segment_bytes": "32MiB", "replicas": 2, "soft_pin": True,
                                          "namespaces": ["p:"]}})
    assert s.tier_names == ("host", "mooncake")
    m = s.mooncake
    assert (m.master, m.metadata, m.global_segment_bytes, m.replicas, m.soft_pin, m.namespaces) == \
        ("10.0.0.5:50051", "P2PHANDSHAKE", 32 * MiB, 2, True, ("p:",))
    assert mooncake_config(m, replicas=3).replicas == 3 and m.replicas == 2


@pytest.mark.parametrize("table, match", [
    ({"stack": "host,tape"}, r"unknown tiers \['tape'\]"),
    ({"stack": ["host", "host"]}, "repeat"),
    ({"stack": ["host", "disk"]}, "no disk_path"),
    ({"stack": ["mooncake"], "mooncake": {"master_addr": "x:1"}}, r"unknown \[tiers.mooncake\] keys \['master_addr'\]"),
    ({"stack": ["mooncake"], "mooncake": {"protocol": "udp"}}, "protocol"),
    ({"mooncake": {"global_segment_bytes": "lots"}}, "tiers.mooncake.global_segment_bytes"),
    # attack pass 5, A5-8: NaN compared false and passed (a NaN lease TTL never expired), so did 1e308 and inf
    ({"lease_ttl_seconds": float("nan")}, "lease_ttl_seconds must be 0..86400"),
    ({"lease_ttl_seconds": 1e308}, "lease_ttl_seconds must be 0..86400"),
    ({"disk_probe_backoff_max_seconds": float("inf")}, "disk_probe_backoff_max_seconds must be > 0 and at most 86400"),
    ({"disk_max_readers": 1}, "disk_max_readers must be 16..4096"),
    # attack pass 6, A6-3: a disk tier above the host one was taken and lost copies acknowledged durable
    ({"stack": ["disk", "host"], "disk_path": "/d"}, "tiers go fastest first: host,disk, not disk,host"),
    ({"stack": "mooncake,host"}, "tiers go fastest first: host,mooncake, not mooncake,host"),
    # attack pass 6, A6-7: tracebacks, and a disk path silently unused
    ({"disk_reserve_fraction": "0.5", "disk_path": "/d"}, "disk_reserve_fraction must be a number in"),
    ({"disk_path": 5}, "disk_path must be a directory path"),
    ({"write_through": "yes"}, "write_through must be true or false"),
    ({"stack": ["host"], "disk_path": "/d"}, "disk_path .* is set but tiers.stack host has no disk tier"),
])
def test_bad_stack_or_mooncake_settings_name_the_problem(table, match):
    with pytest.raises(ValueError, match=match):
        TierSettings.coerce(table)


def test_the_stack_is_built_by_one_loop_in_the_order_named(tmp_path):
    s = TierSettings.coerce({"stack": "host,disk,mooncake", "disk_path": str(tmp_path / "d"), "disk_bytes": "1MiB",
                             "mooncake": {"staging_bytes": "1MiB", "max_object_bytes": "512KiB"}})
    stack = build_stack(4 * MiB, s)
    try:
        assert stack.names == ["host", "disk", "mooncake"]
        assert [t.name for t in stack.cascade] == ["host", "disk"] and [t.name for t in stack.shared] == ["mooncake"]
        assert stack.tier("mooncake").config is s.mooncake
    finally:
        stack.close()


def test_flags_errors_are_usage_errors():
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--tiers", "host,disk"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no disk_path" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--tiers", "host,mooncake", "--mooncake-master", "nohost"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "HOST:PORT" in r.stderr and "Traceback" not in r.stderr
