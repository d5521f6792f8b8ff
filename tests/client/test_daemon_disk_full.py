"""A real daemon whose disk tier's filesystem fills up (a 4 MiB tmpfs under --disk-path) or fails
(an injected EIO where mounting is not allowed, and always once on its own): the daemon keeps serving
from device and host, says which tier is unhealthy and why (health service, ``kvtier status``), gives
a clear status only to a call that needs the disk, and brings the disk back by itself once space
returns, with every record it held.

Regression (issue 8, defect 4): every Offload and every LoadPrefix that needed an eviction failed with
INTERNAL, health said SERVING and no counter moved.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kv_helpers import PAGE_SIZE, offload_page, put_prefix_pages, verify_restored_page
from small_fs import small_tmpfs, write_ballast

from kvtier.client import KVTierClient
from kvtier.client.errors import AlreadyExistsError, UnavailableError
from kvtier.client.spawn import DaemonProcess
from kvtier.page_keys import page_keys

POOL = "default"
RECORD = 64 * (4 * 656 + 3 * 132)  # bytes of one page copy of GLM-5.2's first 4 layers (+ a small header)


def wait_for(pred, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def status_json(address: str) -> dict:
    """``kvtier status --json`` as a user runs it (a subprocess)."""
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "status", "--server", address, "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def moves(c: KVTierClient, name: str) -> int:
    return c.tier_stats().moves.get(name, {}).get("count", 0)


def run_disk_full_story(tmp_path: Path, fs: Path, *, injected: bool) -> dict:
    """The whole story through one daemon; returns what it observed (for the report)."""
    fault_file = tmp_path / "fault"
    config = tmp_path / "kvtier.toml"
    config.write_text("[tiers]\ndisk_probe_backoff_max_seconds = 2\n")
    args = ["--config", str(config), "--device", "cpu", "--log-level", "WARNING", "--pool", f"{POOL}=glm-5.2:1024",
            "--pool-layers", "4", "--host-memory", str(3 * RECORD + 4096), "--disk-path", str(fs / "lmdb"),
            "--disk-size", "64MiB"]
    env = {"KVTIER_DISK_FAULT_FILE": str(fault_file)} if injected else {}
    seen: dict = {"injected": injected}
    with DaemonProcess(extra_args=args, env=env) as d, KVTierClient(d.address, timeout=60) as c:
        assert c.health("kvtier.tier.disk") == "SERVING" and c.health("kvtier.tier.host") == "SERVING"
        if not injected:
            write_ballast(fs / "ballast", leave_free=6 * RECORD)  # room for about five copies on disk
        # 1. offload until the disk fails: every offload is OK (the host tier takes it)
        n = 0
        while c.health("kvtier.tier.disk") == "SERVING":
            assert n < 200, "the disk never failed"
            if injected and n == 8:
                fault_file.touch()
            offload_page(c, POOL, f"c{n}", seed=n)
            n += 1
            if n > 3:  # the host holds three: from here on each offload spills one copy
                time.sleep(0.05 if injected else 0)
        seen["offloads_until_unhealthy"] = n
        wait_for(lambda: status_json(d.address)["tiers"][-1]["unhealthy"], "status to show the disk unhealthy")
        st = status_json(d.address)
        disk = next(t for t in st["tiers"] if t["tier"] == "disk")
        assert st["health"] == "SERVING" and disk["unhealthy"] and "Input/output error" in disk["unhealthy_reason"]
        assert not next(t for t in st["tiers"] if t["tier"] == "host")["unhealthy"]
        seen["reason"] = disk["unhealthy_reason"]
        table = subprocess.run([sys.executable, "-m", "kvtier.cli", "status", "--server", d.address],
                               capture_output=True, text=True, timeout=60).stdout
        assert "UNHEALTHY" in table and "Input/output error" in table
        assert c.health("") == "SERVING" and c.health("kvtier.tier.host") == "SERVING"
        assert c.tier_stats().tiers["disk"]["io_errors"] >= 1
        # 2. calls keep being served from device and host; what would go down is dropped and counted
        gone = moves(c, "host->gone")
        for i in range(n, n + 4):
            assert offload_page(c, POOL, f"c{i}", seed=i).durable is False
        assert moves(c, "host->gone") >= gone + 4
        seen["host_to_gone"] = moves(c, "host->gone")
        verify_restored_page(c, POOL, f"c{n + 3}", seed=n + 3)  # the newest copy is in the host tier
        c.create_pool("glm-5.2", num_layers=4, size_tokens=8 * PAGE_SIZE, pool_id="px")
        keys = page_keys(list(range(40 * PAGE_SIZE)), PAGE_SIZE)
        for j in range(0, 40, 4):  # LoadPrefix needs evictions: the pool (8 pages) evicts pages down the stack
            put_prefix_pages(c, "px", keys[j:j + 4], seed=1000 + j)
        assert c.lookup_prefix("px", keys[:4]).per_tier["disk"] == 0
        assert c.tier_stats("px").moves["device->host"]["count"] >= 30
        # 3. a call that needs the disk gets a clear status: the first copy went to disk before the fault
        with pytest.raises(UnavailableError, match="disk tier is unhealthy.*kvtier.tier.disk"):
            c.restore(POOL, "c0")
        with pytest.raises(AlreadyExistsError, match="unhealthy"):  # c1 is on the disk: its key stays taken
            offload_page(c, POOL, "c1", seed=777)
        assert c.drop("c1") is True  # dropped now, deleted from LMDB when the disk is back
        offload_page(c, POOL, "c1", seed=777)  # the key is free: a new copy (host tier)
        # 4. space comes back; the daemon probes and the disk serves again with what it held
        if injected:
            fault_file.unlink()
        else:
            os.remove(fs / "ballast")
        t0 = time.monotonic()
        wait_for(lambda: c.health("kvtier.tier.disk") == "SERVING", "the disk tier to recover")
        seen["recovered_after_s"] = round(time.monotonic() - t0, 1)
        assert not next(t for t in status_json(d.address)["tiers"] if t["tier"] == "disk")["unhealthy"]
        verify_restored_page(c, POOL, "c0", seed=0)
        spilled = moves(c, "host->disk")
        for i in range(n + 4, n + 8):
            offload_page(c, POOL, f"c{i}", seed=i)
        assert moves(c, "host->disk") >= spilled + 4
        verify_restored_page(c, POOL, "c1", seed=777)  # the new copy (now on disk), never the dropped one
        assert c.tier_stats().tiers["disk"]["damaged"] == 0
    assert d.returncode == 0, d.log_tail()
    return seen


def test_disk_full_on_a_real_tmpfs(tmp_path):
    """--disk-path on a 4 MiB tmpfs that fills up (a ballast file takes most of it); space returns when
    the ballast is deleted. Where mounting is not allowed, the same story runs with the injected EIO."""
    fs = tmp_path / "fs"
    with small_tmpfs(fs, "4m") as mounted:
        seen = run_disk_full_story(tmp_path, fs, injected=not mounted)
    print("disk-full story:", seen)
    if mounted:
        assert not seen["injected"]


def test_disk_eio_injected(tmp_path):
    """The same story on an ordinary directory: every write transaction fails with EIO while the fault
    file exists (KVTIER_DISK_FAULT_FILE), as on a failing disk."""
    seen = run_disk_full_story(tmp_path, tmp_path / "fs", injected=True)
    print("injected-EIO story:", seen)
