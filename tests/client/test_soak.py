"""Soak: 32 clients (16 threads in each of 2 processes) run mixed scenarios against one daemon -- KV
writes, reads and moves, offload/restore, prefix load/store/release, self-pulls, and stats, tier
stats, health and status polling -- for 15 s (60 s with ``-m slow``), while a fault thread cancels
writes and reads mid-stream, writes past a 1 ms deadline, and SIGKILLs a writer mid-stream and an
attached worker holding slots and a lease (``soak_faults.py``).

Asserted: 0 errors (every scenario checks its own bytes; a fault's call fails only with the status it
causes, and the slots it named hold their old bytes, or for a write past its deadline old or new
whole); afterwards free pages and tier usage are
back to their start values (the prefix pool's 48 shared pages, cached before the start, included),
nothing is pinned and no lease is open; the daemon's resident memory
grew by at most :data:`RSS_GROWTH_BOUND` between the end of a 3 s warm-up and the end of the soak.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess

sys.path.insert(0, str(Path(__file__).parent))
from soak_faults import Faults  # noqa: E402
from soak_worker import store_shared_keys  # noqa: E402

RSS_GROWTH_BOUND = 64 << 20  # bytes; measured: +37 MiB in 15 s, +40 MiB in 60 s (it levels off: allocator caches, gRPC buffers)
WARM_UP_S = 3.0
PS = 64
WORKER = Path(__file__).with_name("soak_worker.py")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def usage(c: KVTierClient) -> dict:
    pools = {p.pool_id: (p.free_pages, p.used_pages) for p in c.list_pools()}
    tiers = {t.tier: (t.used_bytes, t.entries) for t in c.stats().tiers if t.tier != "device"}
    pfx = c.tier_stats("soak-pfx").device
    return {"pools": pools, "tiers": tiers, "pinned": pfx["pinned_pages"], "leases": pfx["open_leases"]}


@pytest.mark.parametrize("seconds", [15, pytest.param(60, marks=pytest.mark.slow)])
def test_soak(tmp_path, seconds):
    args = ["--device", "cpu", "--workers", "64", "--max-streams", "40", "--host-memory", "64MiB",
            "--disk-path", str(tmp_path / "disk"), "--disk-size", "128MiB", "--log-level", "WARNING"]
    with DaemonProcess(extra_args=args) as d, KVTierClient(d.address, timeout=60) as c:
        for pool_id, pages in (("soak", 512), ("soak-dst", 64), ("soak-pfx", 128)):
            c.create_pool("glm-5.2", num_layers=2, size_tokens=pages * PS, pool_id=pool_id)
        store_shared_keys(c)
        start = usage(c)
        assert start["pools"]["soak-pfx"] == (80, 48)
        procs = [subprocess.Popen([sys.executable, str(WORKER), d.address, str(seconds), "16", str(seed)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
                 for seed in (1, 2)]
        samples: list[int] = []
        stop = threading.Event()

        def sample() -> None:
            time.sleep(WARM_UP_S)
            while not stop.is_set():
                samples.append(rss_bytes(d.process.pid))
                stop.wait(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        faults = Faults(d.address, seconds)
        faults.start()
        outs = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=seconds + 240)
                assert p.returncode == 0, err[-3000:]
                outs.append(json.loads(out.strip().splitlines()[-1]))
            faults.join(120)
        finally:
            stop.set()
            sampler.join(10)
            for p in procs:
                if p.poll() is None:
                    p.kill()
        errors = [e for o in outs for e in o["errors"]]
        ops = {k: sum(o["ops"].get(k, 0) for o in outs) for k in set().union(*(o["ops"] for o in outs))}
        print(f"soak {seconds}s: {sum(ops.values())} scenarios {ops}, {len(errors)} errors, "
              f"RSS after warm-up {samples[0] >> 20} MiB, peak {max(samples) >> 20} MiB, end {samples[-1] >> 20} MiB")
        print(f"faults: {dict(faults.ops)}")
        assert errors == [], errors[:5]
        assert faults.errors == [], faults.errors[:5]
        assert min(faults.ops.get(k, 0) for k in ("cancelled_write", "cancelled_new_write", "abandoned_read", "deadline_write",
                                                   "killed_writer", "killed_attached_worker")) > 0, faults.ops
        assert min(ops.get(k, 0) for k in ("kv_round_trip", "kv_write_new", "offload_restore", "prefix_request", "monitor",
                                           "pull")) > 0
        assert usage(c) == start
        assert samples and samples[-1] - samples[0] <= RSS_GROWTH_BOUND, (samples[0], samples[-1])
