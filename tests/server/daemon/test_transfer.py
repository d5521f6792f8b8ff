"""The source side of a gRPC pull (``TransferState.read_pages`` in ``server/daemon/transfer.py``) in
process: a ReadPages stream checks every run before its first chunk and copies the runs one at a
time, each under the pool's shared lock; a run whose pages a WriteKV began writing in place after that
first check must be refused, not copied half written."""

from __future__ import annotations

import pytest
import torch
from daemonkit import A, PS, daemon, fill, pool
from test_kv_write import stream_bytes

from kvtier.server.daemon import kv_write
from kvtier.server.daemon.errors import Busy, NotFound
from kvtier.server.daemon.kv_ops import KVSelection


@pytest.fixture
def d():
    dm = daemon(host_memory_bytes=8 << 20)
    yield dm
    dm.close()


def test_a_run_claimed_after_the_streams_check_is_refused_not_sent_half_written(d):
    """ReadPages of page 1 on layers 0 and 1 (two runs): run 0 is sent; then a WriteKV into page 1
    claims it and lands half of layer 1's new rows in place. Run 1 must be refused Busy (the
    destination frees its pages and the pull fails), never sent holding half old, half new rows
    (bytes no commit ever made; an abort would put the old ones back after they left)."""
    pool(d, A)
    slots, old = fill(d, A, "p", PS, seed=1)
    pages = d.transfer.read_pages(A, "p", [(0, "latent", 1, 1), (1, "latent", 1, 1)], 1 << 20)
    first = next(pages)
    assert first[0] == 0 and first[2] == old.numpy().tobytes()
    data, _, _ = stream_bytes(PS, [1], (), seed=2)
    buf = kv_write.begin_write(d.pools, A, KVSelection("p", slots.tolist(), (1,), ()))
    assert buf.claimed
    buf.add_packed(0, memoryview(data)[:len(data) // 2])
    with pytest.raises(Busy, match="being written by a WriteKV"):
        for _ in pages:
            pass
    kv_write.abort_claimed(d.pools, A, buf)


def test_a_pool_made_again_under_its_name_mid_stream_is_not_read(d):
    """ReadPages of page 1 on layers 0 and 1; after run 0 the pool is deleted (force) and made again
    under its name with page 1 allocated: run 1 is NOT_FOUND, not read from the new pool."""
    pool(d, A)
    fill(d, A, "p", PS, seed=3)
    pages = d.transfer.read_pages(A, "p", [(0, "latent", 1, 1), (1, "latent", 1, 1)], 1 << 20)
    next(pages)
    d.delete_pool(A, "p", force=True)
    pool(d, A)
    fill(d, A, "p", PS, seed=4)
    with pytest.raises(NotFound):
        for _ in pages:
            pass
