"""Lock order of the tiers: stats (monitoring) never takes an index lock, so it can never stop, or be
stopped by, the data path (README "Concurrency")."""

from __future__ import annotations

import threading

import pytest

from kvtier.server.tiers import DiskTierConfig, HostTierConfig, TierStack
from tierkit import record_of


def _call_in_thread(fn, timeout: float = 20.0):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    return (not t.is_alive()), out


@pytest.fixture
def stack(tmp_path, codec):
    size = codec.page_nbytes()
    s = TierStack.from_configs([HostTierConfig(capacity_bytes=3 * size),
                                DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=32 << 20)])
    yield s
    s.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_stats_answer_while_a_write_holds_the_index_lock(stack, tier, pool, codec):
    """Regression (issue 8, defect 1): Tier.stats() took its counter lock and then the index lock,
    while HostTier.write held the index lock and took the counter lock: GetTierStats racing an Offload
    deadlocked the daemon. Now stats read the index's plain integers without its lock: with the
    index lock held by a writer, stats still answer (and show what the tier held before)."""
    t = stack.tier(tier)
    t.write([(b"k0", record_of(codec, pool, 1, seed=1))])
    held, release = threading.Event(), threading.Event()

    def writer_in_progress():
        with t.index.lock:
            held.set()
            release.wait(30)

    w = threading.Thread(target=writer_in_progress, daemon=True)
    w.start()
    assert held.wait(10)
    try:
        done, out = _call_in_thread(t.stats)
        assert done, f"{tier} tier stats() waited for the index lock"
        assert out[0].entries == 1 and out[0].used_bytes > 0
        done, _ = _call_in_thread(stack.stats)
        assert done, "stack stats() waited for an index lock"
    finally:
        release.set()
        w.join(10)


def test_writes_cascading_down_and_stats_in_a_loop_both_finish(stack, pool, codec):
    """The issue's repro in process: one thread writes records through a 3-record host tier that
    evicts (write-back) to LMDB, another polls stats; both finish and the counters add up."""
    recs = [record_of(codec, pool, 1 + i % 8, seed=i) for i in range(8)]
    stop = threading.Event()
    polls = [0]

    def poll():
        while not stop.is_set():
            stack.stats()
            polls[0] += 1

    def write():
        for i in range(60):
            stack.put(b"key%03d" % i, recs[i % 8], source="device")

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        done, _ = _call_in_thread(write, timeout=120)
    finally:
        stop.set()
        poller.join(20)
    assert done and not poller.is_alive(), "a write and a stats poll deadlocked"
    s = stack.stats()
    host, disk = s["tiers"]["host"], s["tiers"]["disk"]
    assert host["entries"] == 3 and host["writes"] == 60 and host["evictions"] == 57
    assert disk["entries"] == 57 and s["moves"]["host->disk"]["count"] == 57 and polls[0] > 0
