"""WriteKV that allocates (``write_new_kv``, ``allocate_tokens``) through a real daemon: it takes whole
pages, writes the latent rows straight into them as the stream arrives, and hands the pages out only
when the whole stream has checked out; any failure allocates nothing.

Pool: the conftest's 16 pages of 64 tokens, GLM-5.2's first 8 layers (indexer on 0, 1, 2, 6). The
expected slots and bytes are worked out here (pages are handed out lowest first; page 0 is padding).
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
import torch
from kv_helpers import NUM_LAYERS, PAGE_SIZE, random_kv, verify_kv

from kvtier.client import DaemonProcess, FailedPreconditionError, InvalidArgumentError, KVTierClient, NotFoundError, ResourceExhaustedError
from kvtier.client.wire import encode_write_chunk
from kvtier.v1 import pool_pb2, transfer_pb2


def slots_of(pages: list[int], n: int) -> list[int]:
    return [p * PAGE_SIZE + i for p in pages for i in range(PAGE_SIZE)][:n]


def test_write_new_kv_allocates_pages_and_writes_them(client, pool):
    """150 tokens: pages 1-3 (the lowest free), the slots of their first 150 rows, every byte back."""
    latent, index = random_kv(150, seed=11)
    before = client.describe_pool(pool).free_pages
    slots = client.write_new_kv(pool, latent=latent, index=index)
    assert slots.tolist() == slots_of([1, 2, 3], 150)
    assert client.describe_pool(pool).free_pages == before - 3
    verify_kv(client.read_kv(pool, slots), latent, index)
    assert client.free_slots(pool, slots) == 3


def test_write_new_kv_into_scattered_free_pages_in_small_chunks(daemon, client, pool):
    """Free pages 2, 4, 5, 7 between allocated ones: a 250-token write lands on them in that order, in
    4 KiB messages that cross row, run and segment boundaries; every byte is where its slot says."""
    held = client.allocate_slots(pool, 8 * PAGE_SIZE)  # pages 1..8
    client.free_slots(pool, [s for s in held.tolist() if s // PAGE_SIZE in (2, 4, 5, 7)])
    latent, index = random_kv(250, seed=12)
    with KVTierClient(daemon.address, timeout=30, chunk_bytes=4096) as small:
        slots = small.write_new_kv(pool, latent=latent, index=index)
    assert slots.tolist() == slots_of([2, 4, 5, 7], 250)
    verify_kv(client.read_kv(pool, slots), latent, index)
    for page, rows in ((2, slice(0, 64)), (7, slice(192, 250))):  # and slot by slot, layer 3 (a skip layer)
        got = client.read_kv(pool, slots_of([page], 64)[:rows.stop - rows.start], latent_layers=[3], index_layers=[])
        assert torch.equal(got.latent[3], latent[3][rows])


def test_write_new_kv_refusals_allocate_nothing(client, pool):
    """Too many tokens, rows of unequal length (the client's check, naming the tensor), a skip layer's
    indexer data: each refused with its own error, the pool's free pages unchanged."""
    free = client.describe_pool(pool).free_pages
    latent, index = random_kv(17 * PAGE_SIZE, seed=13, layers=[0], live=[])
    with pytest.raises(ResourceExhaustedError, match="pages"):
        client.write_new_kv(pool, latent=latent)
    a, _ = random_kv(10, seed=1, layers=[0], live=[])
    b, _ = random_kv(12, seed=1, layers=[1], live=[])
    with pytest.raises(InvalidArgumentError, match=r"latent\[1\]: expected \(10, 656\) uint8 or float8_e4m3fn rows for 10 tokens"):
        client.write_new_kv(pool, latent={**a, **b})
    _, idx = random_kv(10, seed=1, layers=[], live=[3])
    with pytest.raises(FailedPreconditionError, match="skips top-k"):
        client.write_new_kv(pool, index=idx)
    assert client.describe_pool(pool).free_pages == free


def _stream(client: KVTierClient, pool: str, latent: dict, n: int, *, slots=(), offset_error: bool = False,
            end_early: bool = False, stall: threading.Event | None = None, sent: threading.Event | None = None):
    """WriteKV requests asking to allocate ``n`` tokens for layer 0's rows: the header, the first 4 KiB,
    then (after ``stall`` is set, if given) the rest. ``offset_error``: the rest skips 4 KiB ahead;
    ``end_early``: the rest never comes."""
    header = pool_pb2.KVHeader(pool_id=pool, slots=list(slots), latent_layers=list(latent),
                               layout_digest=client.layout(pool).fingerprint_digest)
    yield encode_write_chunk(0, 0, 0, [], header=header.SerializeToString(), allocate_tokens=n)
    rows = memoryview(latent[0].numpy()).cast("B")
    yield encode_write_chunk(0, pool_pb2.COMPONENT_LATENT, 0, [rows[:4096]])
    if sent is not None:
        sent.set()
    if stall is not None:
        stall.wait(30)
    if not end_early:
        at = 8192 if offset_error else 4096
        yield encode_write_chunk(0, pool_pb2.COMPONENT_LATENT, at, [rows[at:]])


def wait_free(client: KVTierClient, pool: str, want: int, bound_s: float = 10.0) -> int:
    """Poll the pool's free pages until they equal ``want`` (the daemon sees a cancel on its own
    thread) or ``bound_s`` passes; returns the last count."""
    end = time.monotonic() + bound_s
    while True:
        got = client.describe_pool(pool).free_pages
        if got == want or time.monotonic() > end:
            return got
        time.sleep(0.02)


def test_broken_streams_give_their_pages_back(client, pool):
    """A bad offset, a stream that ends early and slots named as well as allocate_tokens: each
    INVALID_ARGUMENT, no page kept."""
    free = client.describe_pool(pool).free_pages
    latent, _ = random_kv(128, seed=14, layers=[0], live=[])
    for kw, match in (({"offset_error": True}, "offset 8192; expected 4096"), ({"end_early": True}, "got 4096 of"),
                      ({"slots": [64, 65]}, "not both")):
        with pytest.raises(grpc.RpcError) as e:
            client._write_kv_raw(_stream(client, pool, latent, 128, **kw), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in e.value.details()
        assert client.describe_pool(pool).free_pages == free


def test_pages_of_a_stream_in_flight_belong_to_no_one_until_it_commits(daemon, client, pool):
    """While a 128-token stream is stalled after its first piece: its 2 pages are taken (the next
    allocation gets pages 3, 4) yet no call can name them (read, free: not allocated), and other
    clients' writes and reads go on; cancelled, it gives them back."""
    latent, _ = random_kv(128, seed=15, layers=[0], live=[])
    free = client.describe_pool(pool).free_pages
    stall, sent = threading.Event(), threading.Event()
    call = client._write_kv_raw.future(_stream(client, pool, latent, 128, stall=stall, sent=sent), timeout=30)
    try:
        assert sent.wait(30)
        reserved = slots_of([1, 2], 128)
        assert client.describe_pool(pool).free_pages == free - 2
        with pytest.raises(FailedPreconditionError, match=r"2 pages allocated \(2 of them taken by writes still arriving\)"):
            client.delete_pool(pool)
        with pytest.raises(InvalidArgumentError, match="not allocated"):
            client.read_kv(pool, reserved[:4], latent_layers=[0], index_layers=[])
        with pytest.raises(InvalidArgumentError, match="not allocated"):
            client.free_slots(pool, reserved[:1])
        with KVTierClient(daemon.address, timeout=30) as other:
            mine = other.allocate_slots(pool, 100)
            assert mine.tolist() == slots_of([3, 4], 100)
            lat2, idx2 = random_kv(100, seed=16)
            other.write_kv(pool, mine, latent=lat2, index=idx2)
            verify_kv(other.read_kv(pool, mine), lat2, idx2)
            other.free_slots(pool, mine)
        call.cancel()
    finally:
        stall.set()
    with pytest.raises(grpc.FutureCancelledError):
        call.result(30)
    assert wait_free(client, pool, free) == free


def test_a_pool_deleted_under_a_stream_ends_it_not_found(daemon, client, pool):
    """DeletePool --force while a write that allocates is stalled: the write ends NOT_FOUND and the
    daemon serves on (a new pool of the same name takes a full write)."""
    latent, _ = random_kv(128, seed=17, layers=[0], live=[])
    stall, sent = threading.Event(), threading.Event()
    call = client._write_kv_raw.future(_stream(client, pool, latent, 128, stall=stall, sent=sent), timeout=30)
    try:
        assert sent.wait(30)
        client.delete_pool(pool, force=True)
    finally:
        stall.set()
    with pytest.raises(grpc.RpcError) as e:
        call.result(30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
    client.create_pool("glm-5.2", num_layers=NUM_LAYERS, size_tokens=1024, pool_id=pool)
    latent, index = random_kv(64, seed=18)
    slots = client.write_new_kv(pool, latent=latent, index=index)
    verify_kv(client.read_kv(pool, slots), latent, index)
    with pytest.raises(NotFoundError):
        client.write_new_kv("no-such-pool", latent=latent)


class StalledPeer:
    """A PD peer in front of a real daemon: a gRPC proxy whose ReadPages waits for ``release`` before it
    forwards. A PullKV from it holds its destination pool's exclusive lock (the pull runs under it) for
    as long as the test wants, so a WriteKV commit on that pool waits for the lock meanwhile. The
    layout it forwards leaves out the daemon's id: a pull that met its own id would copy in process
    and never reach this ReadPages."""

    SERVICE = "kvtier.v1.TransferService"

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.reading, self.release = threading.Event(), threading.Event()
        layout = self.channel.unary_unary(f"/{self.SERVICE}/GetTransferLayout")
        pages = self.channel.unary_stream(f"/{self.SERVICE}/ReadPages")

        def read_pages(request, context):
            self.reading.set()
            self.release.wait(60)
            yield from pages(request, timeout=30)

        def get_layout(request, context):
            msg = transfer_pb2.TransferLayout.FromString(layout(request, timeout=30))
            msg.daemon_id = ""
            return msg.SerializeToString()

        handlers = {"GetTransferLayout": grpc.unary_unary_rpc_method_handler(get_layout),
                    "ReadPages": grpc.unary_stream_rpc_method_handler(read_pages)}
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(self.SERVICE, handlers),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def close(self) -> None:
        self.release.set()
        self.server.stop(0)
        self.channel.close()


@pytest.fixture()
def idle_daemon():
    """A daemon that cancels a KV stream idle for 1 s, with pools ``p`` (the writes) and ``q`` (a
    pull's source page, written with seed 40), and a stalled peer in front of it."""
    with DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=["--device", "cpu", "--log-level", "WARNING",
                                                  "--stream-idle-seconds", "1"]) as d, KVTierClient(d.address, timeout=30) as c:
        for p in ("p", "q"):
            c.create_pool("glm-5.2", num_layers=NUM_LAYERS, size_tokens=1024, pool_id=p)
        src = c.allocate_slots("q", PAGE_SIZE)
        c.write_kv("q", src, latent=random_kv(PAGE_SIZE, seed=40)[0])
        peer = StalledPeer(d.address)
        try:
            yield d, c, peer
        finally:
            peer.close()


def _commit_under_a_held_lock(c: KVTierClient, peer: StalledPeer, requests, go: threading.Event, sent: threading.Event):
    """Start the WriteKV ``requests`` (stalled after its first piece until ``go``), hold pool ``p``'s
    exclusive lock with a PullKV from ``peer``, let the rest of the stream go, and return the status the write ends with while its commit still waits for the lock (its
    8 s deadline passes: the idle watchdog leaves a stream whose client sent everything, attack pass
    4, A4-16); then let the pull (page 1 of q onto page 1 of p) finish. Returns ``(code, pull result)``."""
    call = c._write_kv_raw.future(requests, timeout=8)
    assert sent.wait(30)
    pulled: dict = {}

    def pull():
        pulled["r"] = c.pull_kv("p", peer.address, "q", src_pages=[1], dst_pages=[1], transport="grpc", timeout=60)

    t = threading.Thread(target=pull)
    t.start()
    try:
        assert peer.reading.wait(30)  # the pull holds p's exclusive lock now
        go.set()
        with pytest.raises(grpc.RpcError) as e:
            call.result(30)
    finally:
        go.set()
        peer.release.set()
        t.join(60)
    return e.value.code(), pulled.get("r")


def test_a_write_that_allocates_cancelled_while_its_commit_waits_allocates_nothing(idle_daemon):
    """Regression: the stream of a write that allocates arrived whole, its commit waited for the pool's
    lock (held by a PullKV) past --stream-idle-seconds and the watchdog cancelled the call (now: past
    the call's deadline) -- the client saw CANCELLED, yet the commit went on and granted the 2 pages to no one who knew of them
    (free pages 13 of 15 afterwards, for good). A commit of a call no longer active gives them back."""
    d, c, peer = idle_daemon
    assert c.allocate_slots("p", PAGE_SIZE).tolist() == slots_of([1], PAGE_SIZE)  # the pull's destination
    free = c.describe_pool("p").free_pages
    assert free == 15
    latent, _ = random_kv(128, seed=41, layers=[0], live=[])
    go, sent = threading.Event(), threading.Event()
    code, pulled = _commit_under_a_held_lock(c, peer, _stream(c, "p", latent, 128, stall=go, sent=sent), go, sent)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert pulled is not None and pulled.num_pages == 1
    got = c.read_kv("p", slots_of([1], PAGE_SIZE), latent_layers=[0], index_layers=[])  # the pull's page, seed 40
    assert torch.equal(got.latent[0].contiguous().view(torch.uint8).view(PAGE_SIZE, -1), random_kv(PAGE_SIZE, seed=40)[0][0])
    assert c.describe_pool("p").free_pages == free  # the write's pages 2, 3 came back
    assert c.write_new_kv("p", latent=latent).tolist() == slots_of([2, 3], 128)  # and are handed out again


def test_a_write_into_named_slots_cancelled_while_its_commit_waits_writes_nothing(idle_daemon):
    """Regression (README "Threads": a cancelled WriteKV wrote nothing): page 2 of p holds layer 0 rows
    of seed 42; a write of seed 43's rows into it arrived whole, its commit waited for the pool's lock
    (a PullKV) until the watchdog cancelled the call -- the client saw CANCELLED, yet the commit
    overwrote the page. Afterwards the page still holds seed 42's rows."""
    d, c, peer = idle_daemon
    assert c.allocate_slots("p", PAGE_SIZE).tolist() == slots_of([1], PAGE_SIZE)  # the pull's destination
    target = c.allocate_slots("p", PAGE_SIZE)
    assert target.tolist() == slots_of([2], PAGE_SIZE)
    kept, _ = random_kv(PAGE_SIZE, seed=42, layers=[0], live=[])
    c.write_kv("p", target, latent=kept)
    latent, _ = random_kv(PAGE_SIZE, seed=43, layers=[0], live=[])
    go, sent = threading.Event(), threading.Event()
    code, _ = _commit_under_a_held_lock(c, peer, _stream(c, "p", latent, 0, slots=target.tolist(), stall=go, sent=sent),
                                        go, sent)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    got = c.read_kv("p", target, latent_layers=[0], index_layers=[])
    assert torch.equal(got.latent[0].contiguous().view(torch.uint8).view(PAGE_SIZE, -1), kept[0])


@pytest.mark.parametrize("allocate", [True, False])
def test_empty_messages_are_refused_not_taken_as_liveness(client, pool, allocate):
    """Regression: a WriteKV message without data after the header was skipped, yet it counted as a
    message moved, so a client sending empty messages now and then held a worker thread (and, for a
    write that allocates, its reserved pages) for ever past --stream-idle-seconds and the 4096-byte
    chunk rule. Now INVALID_ARGUMENT at the first such message; nothing allocated, nothing written."""
    free = client.describe_pool(pool).free_pages
    slots = [] if allocate else client.allocate_slots(pool, PAGE_SIZE).tolist()
    latent, _ = random_kv(PAGE_SIZE, seed=44, layers=[0], live=[])
    header = pool_pb2.KVHeader(pool_id=pool, slots=slots, latent_layers=[0],
                               layout_digest=client.layout(pool).fingerprint_digest).SerializeToString()
    rows = memoryview(latent[0].numpy()).cast("B")
    requests = [encode_write_chunk(0, 0, 0, [], header=header, allocate_tokens=PAGE_SIZE if allocate else 0),
                encode_write_chunk(0, pool_pb2.COMPONENT_LATENT, 0, []),
                encode_write_chunk(0, pool_pb2.COMPONENT_LATENT, 0, [rows])]
    with pytest.raises(grpc.RpcError) as e:
        client._write_kv_raw(iter(requests), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "carry data" in e.value.details()
    assert client.describe_pool(pool).free_pages == free - (0 if allocate else 1)
