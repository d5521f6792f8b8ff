"""ReadKV's gather in process: the streamed read returns read_kv's segments, checks everything
before it returns, and holds the pool's shared lock only while it gathers (a writer waits for the
copy, not for the stream, and gets the lock even when the reader stops half way)."""

from __future__ import annotations

import threading

import pytest
from daemonkit import A, daemon, fill, pool

from kvtier.server.daemon import kv_ops
from kvtier.server.daemon.errors import InvalidArgument
from kvtier.server.daemon.kv_ops import KVSelection


@pytest.fixture
def d():
    dm = daemon(host_memory_bytes=8 << 20)
    yield dm
    dm.close()


def selection(slots, layers=range(4), live=(0, 1, 2)) -> KVSelection:
    return KVSelection(pool_id="p", slots=slots.tolist(), latent_layers=tuple(layers), index_layers=tuple(live))


def test_streamed_read_is_read_kv_segment_for_segment(d):
    pool(d, A)
    slots, rows = fill(d, A, "p", 130, seed=4)
    want = kv_ops.read_kv(d.pools, A, selection(slots))
    read = kv_ops.read_kv_streamed(d.pools, A, selection(slots))
    got = list(read)
    assert [s for s, _ in got] == [s for s, _ in want]
    assert all((a == b).all() for (_, a), (_, b) in zip(got, want))
    assert read.nbytes == sum(s.nbytes for s, _ in want) == sum(a.size for _, a in got)
    assert (got[0][1].reshape(130, -1) == rows.numpy()).all()


def test_bad_input_fails_before_the_read_returns(d):
    pool(d, A)
    slots, _ = fill(d, A, "p", 64, seed=1)
    with pytest.raises(InvalidArgument):
        kv_ops.read_kv_streamed(d.pools, A, selection(slots + 10_000))
    with pytest.raises(InvalidArgument):
        kv_ops.read_kv_streamed(d.pools, A, selection(slots, layers=[0, 0]))


def test_the_shared_lock_goes_back_when_the_gather_is_done_even_if_nobody_reads_on(d):
    pool(d, A)
    slots, _ = fill(d, A, "p", 256, seed=2)
    read = kv_ops.read_kv_streamed(d.pools, A, selection(slots))
    next(iter(read))  # the reader stops after one segment and drops the rest
    got = threading.Event()

    def writer():
        with d.pools.locked(A, "p", exclusive=True):
            got.set()

    t = threading.Thread(target=writer)
    t.start()
    t.join(timeout=60)
    assert got.is_set()
