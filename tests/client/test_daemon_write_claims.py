"""A WriteKV into named slots through a real daemon writes its latent rows in place as they arrive and
claims their pages meanwhile: every call that names them, a peer's pull of them included, is refused
UNAVAILABLE marked "changed nothing" (the client retries it, writes too), other slots serve as usual,
and a write that breaks off leaves the old rows.

Pool: the conftest's 16 pages of 64 tokens (GLM-5.2's first 8 layers); the rows are seeded here.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from kv_helpers import PAGE_SIZE, random_kv
from test_daemon_write_new import _stream

from kvtier.client import FailedPreconditionError, KVTierClient, UnavailableError


def _until_claimed(c: KVTierClient, pool: str, slots: torch.Tensor, bound_s: float = 10.0) -> UnavailableError:
    """Read ``slots`` until the daemon refuses them (it claims them when the stream's header arrives)."""
    end = time.monotonic() + bound_s
    while True:
        try:
            c.read_kv(pool, slots, latent_layers=[0], index_layers=[])
        except UnavailableError as e:
            return e
        assert time.monotonic() < end, "the write's slots were never claimed"
        time.sleep(0.02)


def _latent0(c: KVTierClient, pool: str, slots: torch.Tensor, bound_s: float = 10.0) -> torch.Tensor:
    """Layer 0's rows of ``slots`` once the daemon serves them again (a cancelled write ends on its own thread)."""
    end = time.monotonic() + bound_s
    while True:
        try:
            return c.read_kv(pool, slots, latent_layers=[0], index_layers=[]).latent[0]
        except UnavailableError:
            assert time.monotonic() < end, "the write's claim never ended"
            time.sleep(0.02)


def test_slots_being_written_are_refused_until_the_write_ends(daemon, client, pool):
    """128 named slots (pages 1-2) hold seed-20 rows; a seed-21 write into them stalls after its first
    4 KiB. Meanwhile reading, freeing, writing them again, moving onto them and pulling their pages
    are refused naming the write, DeletePool without force counts them, and the next page serves as
    usual. Cancelled, the write leaves the seed-20 rows and the slots serve again."""
    slots = client.allocate_slots(pool, 2 * PAGE_SIZE)
    old = random_kv(128, seed=20, layers=[0], live=[])[0]
    client.write_kv(pool, slots, latent=old)
    new = random_kv(128, seed=21, layers=[0], live=[])[0]
    other = client.allocate_slots(pool, PAGE_SIZE)  # page 3: not claimed
    client.create_pool("glm-5.2", num_layers=8, size_tokens=1024, pool_id=pool + "-dst")
    stall, sent = threading.Event(), threading.Event()
    call = client._write_kv_raw.future(_stream(client, pool, new, 0, slots=slots.tolist(), stall=stall, sent=sent), timeout=30)
    try:
        assert sent.wait(30)
        with KVTierClient(daemon.address, timeout=30, retries=0) as quick:
            refused = _until_claimed(quick, pool, slots[:4])
            assert "being written by a WriteKV" in str(refused) and refused.unchanged
            refusals = {
                "free": lambda: quick.free_slots(pool, slots[:1]),
                "write": lambda: quick.write_kv(pool, slots[64:], latent={0: new[0][64:]}),
                "move": lambda: quick.move_kv(pool, slots[:1], other[:1]),
            }
            for what, fn in refusals.items():
                with pytest.raises(UnavailableError, match="being written by a WriteKV"):
                    fn()
            dst = quick.allocate_slots(pool + "-dst", PAGE_SIZE)
            with pytest.raises(UnavailableError, match="being written by a WriteKV"):  # nothing moved: retry-safe
                quick.pull_kv(pool + "-dst", daemon.address, pool, src_pages=[int(slots[0]) // PAGE_SIZE],
                              dst_pages=[int(dst[0]) // PAGE_SIZE], transport="grpc")
            with pytest.raises(FailedPreconditionError, match="pages allocated"):
                quick.delete_pool(pool)
            rows = random_kv(PAGE_SIZE, seed=22, layers=[0], live=[])[0]
            quick.write_kv(pool, other, latent=rows)
            assert torch.equal(quick.read_kv(pool, other, latent_layers=[0], index_layers=[]).latent[0], rows[0])
        call.cancel()
    finally:
        stall.set()
        client.delete_pool(pool + "-dst", force=True)
    with pytest.raises(grpc.FutureCancelledError):
        call.result(30)
    assert torch.equal(_latent0(client, pool, slots), old[0])
    assert client.free_slots(pool, slots) == 2


def test_a_write_whose_stream_breaks_off_leaves_the_old_rows(client, pool):
    """A stream into named slots that ends after its first 4 KiB: INVALID_ARGUMENT, the first rows
    (which had landed in place) are the old ones again, and the slots serve at once."""
    slots = client.allocate_slots(pool, 2 * PAGE_SIZE)
    old = random_kv(128, seed=23, layers=[0], live=[])[0]
    client.write_kv(pool, slots, latent=old)
    new = random_kv(128, seed=24, layers=[0], live=[])[0]
    with pytest.raises(grpc.RpcError) as e:
        client._write_kv_raw(_stream(client, pool, new, 0, slots=slots.tolist(), end_early=True), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "got 4096 of" in e.value.details()
    assert torch.equal(client.read_kv(pool, slots, latent_layers=[0], index_layers=[]).latent[0], old[0])


def test_a_write_into_slots_being_written_is_sent_again_once_they_are_free(daemon, client, pool):
    """A write into slots another write is landing on is refused UNAVAILABLE "changed nothing", so the
    client sends it again until its deadline (it would never resend a write after a plain
    UNAVAILABLE, and retries one only 3 times, ~0.35 s): the first write, cancelled 1 s later, ends its
    claim, and the second write lands whole."""
    slots = client.allocate_slots(pool, PAGE_SIZE)
    first = random_kv(PAGE_SIZE, seed=25, layers=[0], live=[])[0]
    second = random_kv(PAGE_SIZE, seed=26, layers=[0], live=[])[0]
    stall, sent = threading.Event(), threading.Event()
    call = client._write_kv_raw.future(_stream(client, pool, first, 0, slots=slots.tolist(), stall=stall, sent=sent), timeout=30)
    try:
        assert sent.wait(30)
        with KVTierClient(daemon.address, timeout=30, retries=0) as quick:
            _until_claimed(quick, pool, slots)
        threading.Timer(1.0, call.cancel).start()  # longer than the 3 retries of a plain UNAVAILABLE take
        assert client.write_kv(pool, slots, latent=second) == PAGE_SIZE * 656  # the default client: 3 retries
    finally:
        stall.set()
    assert torch.equal(_latent0(client, pool, slots), second[0])
