"""Module rules: ``server/observe`` never imports grpc, ``kvtier.v1`` or the service layer, and a
snapshot reads no data-path lock (a scrape while every tier index lock is held elsewhere completes)."""

from __future__ import annotations

import subprocess
import sys
import threading

import torch

from kvtier.server.observe.daemon_metrics import PoolView, daemon_snapshot
from kvtier.server.observe.metrics import METRICS
from kvtier.server.tiers import HostTier, HostTierConfig, TierStack


def test_observe_does_not_import_grpc():
    code = ("import sys, kvtier.server.observe.metrics, kvtier.server.observe.daemon_metrics, kvtier.server.observe.logs; "
            "bad = sorted(m for m in sys.modules if m == 'grpc' or m.startswith(('grpc.', 'kvtier.server.service', 'kvtier.v1'))); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_snapshot_never_waits_for_a_tier_index_lock():
    """Another thread holds the host tier's index lock (as a long write would): the snapshot still
    completes, with the tier's usage read as plain integers."""
    host = HostTier(HostTierConfig(capacity_bytes=1 << 20))
    host.write([(b"k", torch.zeros(1000, dtype=torch.uint8))])
    stack = TierStack([host])
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with host.index.lock:
            held.set()
            release.wait(60)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    done: list[dict] = []
    scraper = threading.Thread(target=lambda: done.append(daemon_snapshot(stack, lambda: [], lambda: [PoolView("p", 3, 8, 100, "team-a")])))
    scraper.start()
    scraper.join(30)
    finished = not scraper.is_alive()
    release.set()
    t.join()
    scraper.join()
    assert finished, "the snapshot waited for the index lock"
    snap = done[0]
    assert set(snap) == set(METRICS)
    assert ({"tier": "host"}, 1000) in snap["kvtier_tier_used_bytes"]
    assert snap["kvtier_pool_free_pages"] == [({"pool": "p", "tenant": "team-a"}, 3)]
    assert ({"tier": "device"}, 500) in snap["kvtier_tier_used_bytes"]
