"""``kill -9`` during a spill storm, restart on the same ``--disk-path``, verify, repeat.

Each round a daemon runs a storm: two threads offload one-page copies (and drop some), one thread
stores single-page prefixes through a pool of 4 pages, so records stream device -> host -> disk all
the time; the host tier holds 2 records. After a random number of acknowledged offloads the daemon is
killed with SIGKILL. Rounds alternate the write policy: write-through (an OK Offload is committed to
LMDB: ``durable``), write-back (an OK is in host memory; durable only when the host tier could not
take it and it went straight to disk).

After each kill, before the next daemon starts, the test reads the LMDB environment itself (every
record checked against the record format, the charge each takes); the next daemon's startup scrub
must agree exactly (entries, bytes, nothing damaged). Then, through the new daemon: every copy
acknowledged durable and not dropped restores byte for byte; every copy whose call was in flight or
not durable either restores byte for byte or is NOT_FOUND; every acknowledged drop is NOT_FOUND;
every prefix page that loads holds its exact bytes. Nothing damaged is ever served.

3 rounds in the default run, 20 marked ``slow``.
"""

from __future__ import annotations

import random
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from kv_helpers import LAYERS4, LIVE4, PAGE_SIZE, offload_page, random_kv, verify_kv, verify_restored_page

from kvtier.client import KVTierClient
from kvtier.client.errors import KVTierError, NotFoundError
from kvtier.client.spawn import DaemonProcess
from kvtier.page_keys import page_keys

RECORD = 194_048  # one page record of GLM-5.2's first 4 layers (README "Replay")
LMDB_PAGE = resource.getpagesize()

_READ_LMDB = """
import sys, lmdb
from kvtier.server.tiers.record import verify_record
env = lmdb.open(sys.argv[1], readonly=True, max_dbs=4, subdir=True)
db = env.open_db(b"records", create=False)
bad = n = charged = 0
with env.begin(db=db, buffers=True) as txn:
    for k, v in txn.cursor():
        n += 1
        charged += -(-(len(v) + 16) // int(sys.argv[2])) * int(sys.argv[2]) + 256
        try:
            verify_record(v)
        except Exception:
            bad += 1
print(n, charged, bad)
"""


def lmdb_census(path: Path) -> tuple[int, int, int]:
    """``(records, charged bytes, damaged records)`` of the environment at ``path``, read by another
    process with its own read-only environment (no daemon runs meanwhile)."""
    r = subprocess.run([sys.executable, "-c", _READ_LMDB, str(path), str(LMDB_PAGE)], capture_output=True,
                       text=True, check=True, timeout=300)
    n, charged, bad = map(int, r.stdout.split())
    return n, charged, bad


@dataclass
class Ledger:
    """What the clients were told, across rounds."""

    durable: dict[str, int] = field(default_factory=dict)     # acknowledged durable: key -> seed
    maybe: dict[str, int] = field(default_factory=dict)       # OK but not durable, or in flight at the kill
    dropped: set[str] = field(default_factory=set)            # acknowledged drops
    prefix: dict[bytes, int] = field(default_factory=dict)    # prefix page key -> seed (stored or in flight)
    lock: threading.Lock = field(default_factory=threading.Lock)


def storm(address: str, ledger: Ledger, rnd: int, stop: threading.Event,
          progress: threading.Condition, counts: dict[str, int]) -> list[threading.Thread]:
    """Start the storm's threads; they end when the daemon is gone or ``stop`` is set."""

    def offloader(worker: int) -> None:
        with KVTierClient(address, timeout=30) as c:
            i = 0
            while not stop.is_set():
                key, seed = f"r{rnd}w{worker}i{i}", rnd * 100_000 + worker * 10_000 + i
                with ledger.lock:
                    ledger.maybe[key] = seed  # in flight until the answer says otherwise
                try:
                    res = offload_page(c, "off", key, seed)
                except KVTierError:
                    return  # the daemon was killed
                with ledger.lock:
                    if res.durable:
                        ledger.durable[key] = ledger.maybe.pop(key)
                with progress:
                    counts["acks"] += 1
                    counts["durable"] += int(res.durable)
                    progress.notify_all()
                if i % 3 == 2:  # drop an older copy of this worker
                    old = f"r{rnd}w{worker}i{i - 2}"
                    try:
                        c.drop(old)
                    except KVTierError:
                        return
                    with ledger.lock:
                        ledger.dropped.add(old)
                        ledger.durable.pop(old, None)
                        ledger.maybe.pop(old, None)
                i += 1

    def prefixer() -> None:
        with KVTierClient(address, timeout=30) as c:
            j = 0
            while not stop.is_set():
                seed = rnd * 100_000 + 90_000 + j
                key = page_keys(list(range(seed * PAGE_SIZE, (seed + 1) * PAGE_SIZE)), PAGE_SIZE)[0]
                with ledger.lock:
                    ledger.prefix[key] = seed
                try:
                    lease = c.load_prefix("px", [key])
                    try:
                        if lease.loaded_pages == 0:
                            latent, index = random_kv(PAGE_SIZE, seed, layers=LAYERS4, live=LIVE4)
                            c.write_kv("px", lease.slots, latent=latent, index=index)
                            c.store_prefix(lease, [key], lease.slots)
                    finally:
                        c.release_prefix(lease)
                except KVTierError:
                    return
                with progress:
                    counts["pages"] += 1
                    progress.notify_all()
                j += 1

    threads = [threading.Thread(target=offloader, args=(w,)) for w in range(2)] + [threading.Thread(target=prefixer)]
    for t in threads:
        t.start()
    return threads


def verify_round(c: KVTierClient, ledger: Ledger) -> dict[str, int]:
    """Everything acknowledged durable is there and exact; nothing else that is there is wrong."""
    found = {"durable": 0, "maybe_present": 0, "maybe_gone": 0, "prefix_loaded": 0}
    for key, seed in sorted(ledger.durable.items()):
        verify_restored_page(c, "off", key, seed)
        found["durable"] += 1
    for key, seed in sorted(ledger.maybe.items()):
        try:
            verify_restored_page(c, "off", key, seed)
            found["maybe_present"] += 1
        except NotFoundError:
            found["maybe_gone"] += 1
    for key in sorted(ledger.dropped):
        with pytest.raises(NotFoundError):
            c.restore("off", key)
    for key, seed in ledger.prefix.items():
        lease = c.load_prefix("px", [key])
        try:
            if lease.loaded_pages:
                kv = c.read_kv("px", lease.slots)
                verify_kv(kv, *random_kv(PAGE_SIZE, seed, layers=LAYERS4, live=LIVE4))
                found["prefix_loaded"] += 1
        finally:
            c.release_prefix(lease)
    return found


def kill9_rounds(tmp_path: Path, rounds: int, seed: int = 8) -> list[dict]:
    rng = random.Random(seed)
    disk = tmp_path / "disk"
    ledger = Ledger()
    report = []

    def daemon(write_through: bool) -> DaemonProcess:
        return DaemonProcess(extra_args=[
            "--device", "cpu", "--log-level", "WARNING", "--pool", "off=glm-5.2:1024", "--pool", "px=glm-5.2:256",
            "--pool-layers", "4", "--host-memory", str(2 * RECORD + 1000), "--disk-path", str(disk),
            "--disk-size", "512MiB", "--write-through" if write_through else "--write-back"])

    for rnd in range(rounds + 1):
        write_through = rnd % 2 == 0
        census = lmdb_census(disk) if disk.exists() else (0, 0, 0)
        with daemon(write_through) as d:
            with KVTierClient(d.address, timeout=60) as c:
                s = c.tier_stats()
                disk_t, host_t = s.tiers["disk"], s.tiers["host"]
                # the startup scrub agrees with what LMDB holds; nothing was damaged by the kill
                assert census[2] == 0, f"round {rnd}: {census[2]} damaged records on disk after kill -9"
                assert (disk_t["entries"], disk_t["used_bytes"], disk_t["damaged"]) == (census[0], census[1], 0)
                assert disk_t["used_bytes"] <= disk_t["capacity_bytes"] and host_t["entries"] == 0
                found = verify_round(c, ledger)
                pools = {p.pool_id: p for p in c.list_pools()}
                assert pools["off"].free_pages == pools["off"].total_pages  # every restored page freed
                assert c.tier_stats("px").device["pinned_pages"] == 0
            if rnd == rounds:
                assert d.stop() == 0, d.log_tail()
                report.append({"round": "final", "lmdb_records": census[0], **found})
                break
            stop, progress, counts = threading.Event(), threading.Condition(), {"acks": 0, "durable": 0, "pages": 0}
            want = rng.randint(4, 12)
            threads = storm(d.address, ledger, rnd, stop, progress, counts)
            deadline = time.monotonic() + 180
            with progress:
                while counts["acks"] < want or counts["pages"] < 3:
                    assert time.monotonic() < deadline, f"round {rnd}: the storm made no progress: {counts}"
                    progress.wait(1.0)
            d.signal(signal.SIGKILL)
            assert d.wait(60) == -signal.SIGKILL
            stop.set()
            for t in threads:
                t.join(120)
                assert not t.is_alive()
            if write_through:  # with a healthy disk every write-through OK is committed to LMDB
                assert counts["durable"] == counts["acks"], counts
            report.append({"round": rnd, "write_through": write_through, "acks": counts["acks"],
                           "durable_acks": counts["durable"],
                           "prefix_pages": counts["pages"], "lmdb_records_before": census[0], **found})
    return report


def test_kill9_during_spill_storm_3_rounds(tmp_path):
    report = kill9_rounds(tmp_path, rounds=3)
    print("kill -9 rounds:", report)
    assert sum(r.get("durable", 0) for r in report[1:]) > 0


@pytest.mark.slow
def test_kill9_during_spill_storm_20_rounds(tmp_path):
    report = kill9_rounds(tmp_path, rounds=20, seed=20)
    print("kill -9 rounds:", report)
    assert report[-1]["round"] == "final"
