"""KV streams cannot take every worker thread: stalled WriteKV streams and ReadKV readers that stop
reading hold at most ``--max-streams`` slots, are cancelled after ``--stream-idle-seconds``, and
control calls answer meanwhile; tiny chunks are refused."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess
from kvtier.v1 import pool_pb2, pool_pb2_grpc

PS = 64
ARGS = ["--device", "cpu", "--workers", "16", "--stream-idle-seconds", "2", "--pool", "glm-5.2:8192",
        "--pool-layers", "8", "--log-level", "WARNING"]


@pytest.fixture(scope="module")
def d():
    with DaemonProcess(extra_args=ARGS) as dp:
        yield dp


def _retry_until(fn, what: str, limit_s: float = 60.0):
    """Call ``fn`` until it stops raising grpc.RpcError RESOURCE_EXHAUSTED (slots come back after the idle bound)."""
    end = time.monotonic() + limit_s
    while True:
        try:
            return fn()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > end:
                raise AssertionError(f"{what}: {e.code()} {e.details()}") from None
        time.sleep(0.2)


def test_stalled_writes_leave_threads_for_control_calls_and_are_cancelled(d):
    """Regression (issue 8, defect 7): 16 WriteKV streams that sent their header and then nothing took
    all 16 worker threads, so ListPools timed out. Now 8 (half the workers) hold stream slots, the
    other 8 are refused at once, ListPools answers while they stall, the stalled ones are cancelled
    after 2 s idle (writing nothing) and the slots serve new streams. Each writer names a page of its
    own (two writes into the same slots cannot both be in flight: the second is UNAVAILABLE)."""
    with KVTierClient(d.address, timeout=30) as c:
        slots = c.allocate_slots("default", 16 * PS)
        before = c.read_kv("default", slots, index_layers=[]).latent[0].clone()
    release = threading.Event()
    results: list[grpc.StatusCode] = []
    lock = threading.Lock()

    def stalled_writer(i: int) -> None:
        mine = slots[i * PS:(i + 1) * PS].tolist()

        def messages():
            yield pool_pb2.WriteKVRequest(header=pool_pb2.KVHeader(pool_id="default", slots=mine, latent_layers=[0]))
            release.wait(120)  # a client that stopped sending

        with grpc.insecure_channel(d.address) as ch:
            try:
                pool_pb2_grpc.PoolServiceStub(ch).WriteKV(messages(), timeout=120)
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
        with lock:
            results.append(code)

    writers = [threading.Thread(target=stalled_writer, args=(i,), daemon=True) for i in range(16)]
    for t in writers:
        t.start()
    try:
        with KVTierClient(d.address, timeout=10, retries=0) as c:
            for _ in range(5):  # control calls answer while the streams stall
                assert [p.pool_id for p in c.list_pools()] == ["default"]
                c.stats()
                c.tier_stats("default")
        for t in writers:
            t.join(60)
        assert not any(t.is_alive() for t in writers), "stalled streams were never cancelled"
    finally:
        release.set()
    assert sorted(r.name for r in results) == ["CANCELLED"] * 8 + ["RESOURCE_EXHAUSTED"] * 8
    with KVTierClient(d.address, timeout=30) as c:
        assert torch.equal(c.read_kv("default", slots, index_layers=[]).latent[0], before)  # nothing was written
        rows = torch.full((16 * PS, 656), 7, dtype=torch.uint8)
        c.write_kv("default", slots, latent={0: rows})
        assert torch.equal(c.read_kv("default", slots, index_layers=[]).latent[0], rows)
        c.free_slots("default", slots)


def test_tiny_chunks_are_refused_and_big_reads_leave_room_for_control_calls(d):
    """A ReadKV (or ReadPages) asking for 1-byte chunks is INVALID_ARGUMENT before anything streams;
    eight 43 MB reads in flight leave ListPools answering."""
    from kvtier.v1 import transfer_pb2, transfer_pb2_grpc

    with KVTierClient(d.address, timeout=60) as c:
        slots = c.allocate_slots("default", 8192)
        c.write_kv("default", slots, latent={x: torch.full((8192, 656), x, dtype=torch.uint8) for x in range(8)})
    header = pool_pb2.KVHeader(pool_id="default", slots=slots.tolist(), latent_layers=list(range(8)))
    with grpc.insecure_channel(d.address) as ch:
        stub = pool_pb2_grpc.PoolServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.ReadKV(pool_pb2.ReadKVRequest(header=header, chunk_bytes=1), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "below the minimum of 4096" in e.value.details()
        run = transfer_pb2.PageRun(layer_id=0, component=transfer_pb2.PAGE_COMPONENT_LATENT, first_page=1, num_pages=128)
        with pytest.raises(grpc.RpcError) as e:
            list(transfer_pb2_grpc.TransferServiceStub(ch).ReadPages(
                transfer_pb2.ReadPagesRequest(pool_id="default", runs=[run], chunk_bytes=1), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    sizes: list[int] = []

    def reader() -> None:
        with KVTierClient(d.address, timeout=120) as c:
            kv = c.read_kv("default", slots, index_layers=[])
            sizes.append(sum(int(t.numel()) for t in kv.latent.values()))
            assert all(bool((kv.latent[x] == x).all()) for x in range(8))

    readers = [threading.Thread(target=reader, daemon=True) for _ in range(8)]
    for t in readers:
        t.start()
    with KVTierClient(d.address, timeout=10, retries=0) as c:
        assert [p.pool_id for p in c.list_pools()] == ["default"]
    for t in readers:
        t.join(120)
    assert sizes == [8 * 8192 * 656] * 8
    with KVTierClient(d.address, timeout=30) as c:
        c.free_slots("default", slots)


class _Context:
    """Stands in for a call's ServicerContext: records that the guard cancelled it."""

    def __init__(self) -> None:
        self.cancelled = 0

    def cancel(self) -> None:
        self.cancelled += 1


def test_the_guard_cancels_only_streams_that_moved_nothing_for_the_idle_bound():
    """StreamGuard with its own clock: a stream that keeps touching (a reader that reads, a sender
    that sends) is never cancelled; one that stops is cancelled once; a full guard refuses."""
    from kvtier.server.daemon.errors import ResourceExhausted
    from kvtier.server.service.streams import StreamGuard

    now = [0.0]
    g = StreamGuard(2, idle_seconds=5.0, clock=lambda: now[0])
    g.close()  # no watchdog thread here: the test drives check_now() itself
    busy, stalled = _Context(), _Context()
    with g.stream(busy, "ReadKV") as touch_busy, g.stream(stalled, "WriteKV"):
        with pytest.raises(ResourceExhausted, match="2 KV streams are in flight"):
            with g.stream(_Context(), "ReadKV"):
                pass
        for _ in range(4):
            now[0] += 3.0
            touch_busy()
            g.check_now()
        assert (busy.cancelled, stalled.cancelled) == (0, 1)
        assert g.check_now() == 0  # cancelled once only
    assert g.in_flight == 0


def test_a_stream_whose_daemon_is_working_is_not_cancelled_as_idle():
    """Attack pass 4, A4-16: a WriteKV whose client had sent everything, waiting for its pool's lock
    at commit, was cancelled as idle (CANCELLED, ~50 s into a 300 s deadline): the daemon's own wait
    was counted as the client's idleness. After ``touch.daemon_working()`` the watchdog leaves it."""
    from kvtier.server.service.streams import StreamGuard

    now = [0.0]
    g = StreamGuard(2, idle_seconds=5.0, clock=lambda: now[0])
    g.close()
    committing, stalled = _Context(), _Context()
    with g.stream(committing, "WriteKV") as touch, g.stream(stalled, "WriteKV"):
        touch.daemon_working()
        now[0] += 60.0
        assert g.check_now() == 1
        assert (committing.cancelled, stalled.cancelled) == (0, 1)
        touch.client_turn()  # (pass 5, A5-3: around the claim) the client's turn again: idle counts from now
        now[0] += 4.0
        assert g.check_now() == 0
        now[0] += 2.0
        assert g.check_now() == 1 and committing.cancelled == 1


def test_the_guard_keeps_each_tenant_to_its_share():
    """StreamGuard with ``tenant_slots=2`` of 4 (two tenants, attack pass 2 F5): a tenant holding 2 is
    refused a third (naming its share, marked "changed nothing") while another tenant gets its own 2;
    a slot given back is the tenant's again; calls of no tenant ("") count only against the total."""
    from kvtier.server.daemon.errors import StreamsFull
    from kvtier.server.service.streams import StreamGuard

    g = StreamGuard(4, idle_seconds=5.0, tenant_slots=2)
    g.close()
    with g.stream(_Context(), "WriteKV", tenant="a"), g.stream(_Context(), "PutUnits", tenant="a"):
        with pytest.raises(StreamsFull, match=r"tenant 'a' holds 2 KV streams, its share of the daemon's 4 "
                                              r"\(--max-streams-per-tenant\)") as info:
            with g.stream(_Context(), "PullKV", tenant="a", idle_bound=False):
                pass
        assert info.value.unchanged
        with g.stream(_Context(), "WriteKV", tenant="b"), g.stream(_Context(), "ReadKV", tenant="b"):
            assert (g.in_flight, g.held_by("a"), g.held_by("b")) == (4, 2, 2)
            with pytest.raises(StreamsFull, match="4 KV streams are in flight"):
                with g.stream(_Context(), "ReadKV", tenant=""):
                    pass
        with g.stream(_Context(), "ReadKV", tenant=""), g.stream(_Context(), "ReadKV", tenant=""):
            assert g.in_flight == 4
    with g.stream(_Context(), "ReadKV", tenant="a"), g.stream(_Context(), "ReadKV", tenant="a"):
        assert g.held_by("a") == 2
    assert (g.in_flight, g.held_by("a"), g.held_by("b")) == (0, 0, 0)


def test_one_tenant_may_hold_every_slot_without_a_share():
    """``tenant_slots=None`` (no cap per tenant) or equal to the total: one tenant holds every slot."""
    from kvtier.server.service.streams import StreamGuard

    for slots in (None, 3):
        g = StreamGuard(3, idle_seconds=5.0, tenant_slots=slots)
        g.close()
        with g.stream(_Context(), "ReadKV", tenant="default"), g.stream(_Context(), "ReadKV", tenant="default"), \
                g.stream(_Context(), "ReadKV", tenant="default"):
            assert g.in_flight == 3
