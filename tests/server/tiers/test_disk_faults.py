"""The disk tier on a filesystem that fills up (a real tmpfs of 4 MiB) or fails (an injected EIO):
it turns unhealthy and is bypassed, the stack keeps serving from the host tier and counts what it
drops, records already on disk stay untouched, and a probe brings all of it back once space returns.
Also: unusable disk paths are refused with a clear message, and the monitor reports changes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import torch
from small_fs import small_tmpfs, write_ballast
from tierkit import record_of

from kvtier.server.tiers import DiskTier, DiskTierConfig, HostTier, HostTierConfig, TierStack
from kvtier.server.tiers.disk_faults import check_disk_path
from kvtier.server.tiers.errors import DiskPathError, TierUnavailableError
from kvtier.server.tiers.health import TierHealth
from kvtier.server.tiers.monitor import TierMonitor

MiB = 1 << 20


_LIST_KEYS = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=4, subdir=True)
db = env.open_db(b"records", create=False)
with env.begin(db=db) as txn:
    print(" ".join(bytes(k).hex() for k, _ in txn.cursor()))
"""


def lmdb_keys(path: Path) -> set[bytes]:
    """The record keys LMDB really holds, read by another process (py-lmdb allows one environment
    per file and process, and the tier's own answer is what is being checked)."""
    out = subprocess.run([sys.executable, "-c", _LIST_KEYS, str(path)], capture_output=True, text=True, check=True)
    return {bytes.fromhex(h) for h in out.stdout.split()}


def read(tier, key: bytes, size: int) -> torch.Tensor | None:
    out = torch.empty(size, dtype=torch.uint8)
    n = tier.read_into([key], [out])[0]
    return out[:n] if n else None


@pytest.mark.parametrize("fault", ["tmpfs", "injected"])
def test_full_disk_is_bypassed_and_recovers(tmp_path, pool, codec, fault):
    """A stack host(2 records) -> disk(64 MiB map) whose filesystem fills up (tmpfs) or starts failing
    every write (injected EIO) after a few spills: the disk turns unhealthy with LMDB's reason, later
    spills are dropped and counted host->gone, presence and reads of the disk miss, LMDB keeps exactly
    what it had, a removal waits as a tombstone; after space returns the probe succeeds and every
    record is back byte for byte (the removed one deleted), and spills go to disk again."""
    size = codec.page_nbytes()
    recs = {b"p:%03d" % i: record_of(codec, pool, 1 + i % 8, seed=i) for i in range(40)}
    keys = list(recs)
    fs = tmp_path / "fs"
    fault_file = tmp_path / "fault"
    with small_tmpfs(fs, "4m") as mounted:
        injected = fault == "injected" or not mounted  # no mount allowed: the same story with the injected fault
        disk = DiskTier(DiskTierConfig(path=str(fs / "lmdb"), capacity_bytes=64 * MiB,
                                       fault_file=str(fault_file) if injected else ""))
        disk.open()
        host = HostTier(HostTierConfig(capacity_bytes=2 * size + 1024))
        stack = TierStack([host, disk])
        if not injected:
            write_ballast(fs / "ballast", leave_free=5 * size)  # room for about four more records in LMDB
        stored: list[bytes] = []
        for i, k in enumerate(keys):
            if injected and i == 6:
                fault_file.touch()
            assert stack.put(k, recs[k], source="device") == ["host"]
            if not disk.health.healthy:
                break
            stored = [x for x in keys[:i + 1] if disk.contains([x])[0]]
        else:
            pytest.fail("the disk never filled up")
        assert len(stored) >= 2
        reason = disk.health.snapshot().reason
        assert "Input/output error" in reason and reason.startswith("write")
        assert disk.stats().io_errors == 1 and disk.stats().entries == len(stored)
        # bypassed: nothing found, nothing read, records kept as they were
        assert disk.contains(stored) == [False] * len(stored) and disk.lookup(stored) == 0
        assert read(disk, stored[0], size) is None
        assert all(disk.held_while_unhealthy(k) for k in stored)
        assert stack.where(stored[:1]) == [[]]
        assert lmdb_keys(fs / "lmdb") == set(stored)
        # the host keeps serving; what would go down is dropped and counted
        gone = stack.moves.get("host->gone", {}).get("count", 0)
        later = keys[i + 1:i + 4]
        for k in later:
            assert stack.put(k, recs[k], source="device") == ["host"]
        assert stack.moves["host->gone"]["count"] == gone + len(later)
        assert read(host, later[-1], size) is not None
        with pytest.raises(TierUnavailableError):
            disk.write([(b"p:new", recs[keys[0]])])
        # a removal while unhealthy: gone from the index now, from LMDB on recovery
        assert disk.remove([stored[0]]) == 1 and not disk.held_while_unhealthy(stored[0])
        # still full: the probe fails and the tier stays unhealthy
        with pytest.raises((OSError, lmdb.Error)):
            disk.probe()
        # space comes back
        if injected:
            fault_file.unlink()
        else:
            os.remove(fs / "ballast")
        disk.probe()
        assert disk.health.mark_healthy()
        assert lmdb_keys(fs / "lmdb") == set(stored[1:])
        for k in stored[1:]:
            got = read(disk, k, size)
            assert got is not None and torch.equal(got, recs[k]), f"record {k!r} changed"
        assert disk.contains(stored[:1]) == [False]
        moved = stack.moves["host->disk"]["count"]
        for k in keys[i + 4:i + 7]:
            stack.put(k, recs[k], source="device")
        assert stack.moves["host->disk"]["count"] == moved + 3
        assert disk.stats().damaged == 0
        disk.close()


def test_write_through_copy_skipped_while_unhealthy_goes_down_on_eviction(tmp_path, pool, codec):
    """Write-through host over an unhealthy disk: the copy stays in the host tier (placed there only,
    nothing counted gone); once the disk recovers, evicting it from the host writes it down."""
    size = codec.page_nbytes()
    fault_file = tmp_path / "fault"
    disk = DiskTier(DiskTierConfig(path=str(tmp_path / "lmdb"), capacity_bytes=16 * MiB, fault_file=str(fault_file)))
    host = HostTier(HostTierConfig(capacity_bytes=size + 1024, write_back=False))
    stack = TierStack([host, disk])
    a, b = record_of(codec, pool, 1, seed=1), record_of(codec, pool, 2, seed=2)
    assert stack.put(b"a", a, source="device") == ["host", "disk"]
    fault_file.touch()
    assert stack.put(b"b", b, source="device") == ["host"]  # a evicted from host: it is on disk already
    assert not disk.health.healthy
    assert stack.moves["host->gone"]["count"] == 1  # a's host copy (a is on disk); b's skipped copy is not gone
    fault_file.unlink()
    disk.probe()
    disk.health.mark_healthy()
    assert disk.contains([b"a", b"b"]) == [True, False]
    stack.put(b"c", a, source="device")  # evicts b from the host: written down now
    assert disk.contains([b"b"]) == [True] and torch.equal(read(disk, b"b", size), b)


def test_monitor_probes_with_backoff_and_reports_changes(tmp_path, pool, codec):
    """The monitor probes a tier only when its backoff has passed; a failed probe keeps it unhealthy
    (with the probe's reason), a good one makes it healthy; listeners hear each change once."""
    class Clock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    fault_file = tmp_path / "fault"
    disk = DiskTier(DiskTierConfig(path=str(tmp_path / "lmdb"), capacity_bytes=16 * MiB, fault_file=str(fault_file)))
    disk.health = TierHealth("disk", backoff_initial_s=1.0, backoff_max_s=8.0, clock=clock)
    mon = TierMonitor([disk])
    heard = []
    mon.add_listener(lambda snap: heard.append((snap.tier, snap.healthy)))
    fault_file.touch()
    with pytest.raises(TierUnavailableError):
        disk.write([(b"k", record_of(codec, pool, 1, seed=1))])
    assert mon.run_once()[0].healthy is False and heard == [("disk", False)] and mon.probes == 0
    clock.t = 1.0
    mon.run_once()  # probe due; the fault is still there
    assert mon.probes == 1 and not disk.health.healthy
    reason = disk.health.snapshot().reason  # the first failure, then the latest probe's
    assert reason.startswith("write: ") and "; last probe: " in reason and reason.count("last probe") == 1
    assert disk.health.snapshot().next_probe_in_s == 2.0
    mon.run_once()
    assert mon.probes == 1  # not due yet
    fault_file.unlink()
    clock.t = 3.0
    assert [s.healthy for s in mon.run_once()] == [True] and heard == [("disk", False), ("disk", True)]
    assert disk.health.healthy and mon.probes == 2


def test_monitor_thread_brings_the_tier_back_by_itself(tmp_path, pool, codec):
    """With the background thread running, a tier that failed comes back without anyone calling it."""
    import time

    fault_file = tmp_path / "fault"
    disk = DiskTier(DiskTierConfig(path=str(tmp_path / "lmdb"), capacity_bytes=16 * MiB, fault_file=str(fault_file),
                                   probe_backoff_initial_s=0.05, probe_backoff_max_s=0.2))
    mon = TierMonitor([disk], poll_s=0.1)
    heard = []
    mon.add_listener(lambda snap: heard.append(snap.healthy))
    mon.start()
    try:
        fault_file.touch()
        with pytest.raises(TierUnavailableError):
            disk.write([(b"k", record_of(codec, pool, 1, seed=1))])
        fault_file.unlink()
        deadline = time.monotonic() + 60
        while not (disk.health.healthy and heard == [False, True]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert disk.health.healthy and heard == [False, True]
    finally:
        mon.stop()


def test_unusable_disk_paths_are_refused_with_what_to_do(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DiskPathError, match="is not a directory.*--disk-path DIR"):
        check_disk_path(tmp_path / "afile")
    with pytest.raises(DiskPathError, match="cannot be created"):
        check_disk_path(tmp_path / "afile" / "sub")
    with pytest.raises(DiskPathError, match="pseudo filesystem"):
        check_disk_path("/proc")
    with small_tmpfs(tmp_path / "ro", "1m", options="ro") as mounted:
        if mounted:
            with pytest.raises(DiskPathError, match="read-only filesystem"):
                check_disk_path(tmp_path / "ro")
    assert check_disk_path(tmp_path / "new" / "dir") == tmp_path / "new" / "dir"
    with pytest.raises(DiskPathError, match="not a directory"):
        DiskTier(DiskTierConfig(path=str(tmp_path / "afile"), capacity_bytes=16 * MiB)).open()


def test_the_slow_disk_hook_waits_only_while_its_file_exists(tmp_path):
    """KVTIER_TEST_DISK_SLOW_FILE's hook: unset or absent, no wait; a number, that many seconds; empty,
    until the file holds a number or is gone (written from another thread here)."""
    import threading

    from kvtier.server.tiers.disk_faults import hold_before_commit

    slow = tmp_path / "slow"
    assert hold_before_commit("") == 0.0
    hold_before_commit(str(slow))  # absent: returns (at once; no timing asserted)
    slow.write_text("0.02")
    assert hold_before_commit(str(slow)) >= 0.02
    slow.write_text("")
    for release in (lambda: slow.write_text("0.001"), slow.unlink):
        t = threading.Thread(target=release)
        t.start()
        assert hold_before_commit(str(slow)) >= 0.0  # returned: released by the other thread
        t.join()
        slow.write_text("")
