"""One daemon a ``--disk-path``: a second ``kvtier serve`` on a directory another daemon holds is refused.

Regression (attack pass F3): two daemons on one ``--disk-path`` (two services with one config file, a
replacement started on another socket while the old one drains) both started; each kept its own
index and budget over one LMDB environment, and a ``Restore`` of daemon 1's copy returned the bytes
daemon 2 had offloaded under the same key, with no error (the record is valid, its checksum fine).
Now the disk tier holds an exclusive ``flock`` on ``DIR/kvtier.lock`` while its environment is open,
and ``kvtier serve`` asks before it allocates anything: the second daemon stops with one line naming
the directory and the holder's pid. ``kill -9`` leaves no stale lock (the kernel releases it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from kv_helpers import offload_page, verify_restored_page

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess

POOL = "off"


def args(disk: Path, *more: str) -> list[str]:
    return ["--device", "cpu", "--log-level", "WARNING", "--pool", f"{POOL}=glm-5.2:1024", "--pool-layers", "4",
            "--host-memory", "4MiB", "--disk-path", str(disk), "--disk-size", "64MiB", *more]


def in_use_line(disk: Path, pid: int) -> str:
    return (f"Error: disk path {disk} is in use by another kvtier daemon (pid {pid}); stop it or give another "
            f"--disk-path")


def serve_second(disk: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """``kvtier serve`` on ``disk`` with a socket of its own and a pool far larger than memory (so only a
    refusal that comes before any pool is allocated names the disk path); returns the result and the socket."""
    sock = Path(tempfile.mkdtemp(prefix="kvtier-second-")) / "kv.sock"
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", "--listen", f"unix://{sock}", "--device", "cpu",
           "--pool", f"glm-5.2:{4 * total // (1 << 30) + 64}GiB", "--disk-path", str(disk), "--disk-size", "64MiB"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120), sock


def verify_refused(disk: Path, holder: int) -> None:
    r, sock = serve_second(disk)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines == [in_use_line(disk, holder)], r.stderr
    assert not sock.exists()


def test_a_second_daemon_on_a_disk_path_in_use_is_refused_and_kill9_leaves_no_stale_lock(tmp_path):
    """Daemon 1 holds ``disk`` and has durable copies in it. A second ``kvtier serve`` there (another
    socket) stops with one line naming the path and daemon 1's pid, before its pool is allocated;
    daemon 1 still serves its own bytes. After ``kill -9`` of daemon 1 the next daemon starts on the
    same path at once and restores every copy byte for byte."""
    disk = tmp_path / "disk"
    with DaemonProcess(extra_args=args(disk, "--write-through")) as d1, KVTierClient(d1.address, timeout=60) as c:
        for i in range(6):
            assert offload_page(c, POOL, f"a{i}", seed=100 + i).durable
        verify_refused(disk, d1.process.pid)
        for i in range(6):
            verify_restored_page(c, POOL, f"a{i}", seed=100 + i)
        d1.signal(signal.SIGKILL)
        assert d1.wait(60) == -signal.SIGKILL
    with DaemonProcess(extra_args=args(disk)) as d2, KVTierClient(d2.address, timeout=60) as c:
        for i in range(6):
            verify_restored_page(c, POOL, f"a{i}", seed=100 + i)


def test_a_replacement_daemon_is_refused_until_the_old_one_has_closed_its_disk(tmp_path):
    """A replacement started while the old daemon shuts down (its host records still going down to the
    disk, held there by the test-only slow-disk hook) is refused naming the old daemon's pid; once the old
    one exits, the replacement starts and restores the copies the old one moved down at shutdown."""
    disk, slow = tmp_path / "disk", tmp_path / "slow"
    d1 = DaemonProcess(extra_args=args(disk, "--write-back"), env={"KVTIER_TEST_DISK_SLOW_FILE": str(slow)})
    with d1, KVTierClient(d1.address, timeout=60) as c:
        for i in range(4):
            assert not offload_page(c, POOL, f"b{i}", seed=200 + i).durable  # in the host tier only
        slow.write_text("")  # from now on every put transaction waits until the file is removed
        d1.signal(signal.SIGTERM)  # the shutdown moves the host records down and waits in their commit
        with pytest.raises(subprocess.TimeoutExpired):
            d1.wait(2)
        verify_refused(disk, d1.process.pid)
        slow.unlink()
        assert d1.wait(60) == 0, d1.log_tail()
    with DaemonProcess(extra_args=args(disk)) as d2, KVTierClient(d2.address, timeout=60) as c:
        for i in range(4):
            verify_restored_page(c, POOL, f"b{i}", seed=200 + i)
