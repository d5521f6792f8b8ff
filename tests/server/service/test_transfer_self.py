"""A PullKV whose peer is its own daemon copies in process (issue 23, defect 3).

Regression: such a pull held the destination pool exclusive on one worker and waited for its own
ReadPages, which needed another worker and a stream slot; with the workers busy or queued on that
pool, the whole daemon stalled until the pull's deadline. Structural, not timed: stalled 40 MB
ReadPages streams (each confirmed running by its first message) hold the stream slots and workers;
a same-daemon pull must land its bytes anyway. Naming the daemon's bound address (known without
asking) it needs no slot: all 4 are held. Naming another spelling of it, it asks that address for
the layout like any peer, so it holds a stream slot (attack pass 2, F6): 3 are held, the pull takes
the last one, and is recognised by the daemon id in the layout answer (one short call on a free
worker); a ReadPages of its own would find no slot left.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from stalled import StalledCalls

from kvtier.client import InvalidArgumentError, KVTierClient
from kvtier.client.spawn import DaemonProcess
from kvtier.v1 import transfer_pb2, transfer_pb2_grpc

PS = 64
STREAMS = 4
ARGS = ["--device", "cpu", "--workers", str(STREAMS + 2), "--max-streams", str(STREAMS), "--stream-idle-seconds", "600",
        "--pool", "glm-5.2:8192", "--pool-layers", "8", "--log-level", "WARNING"]
LIVE = (0, 1, 2, 6)  # glm-5.2 cut to 8 layers: these own an indexer buffer


@pytest.fixture(scope="module")
def d():
    with DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=ARGS) as dp:
        with KVTierClient(dp.address, timeout=60) as c:
            c.allocate_slots("default", 120 * PS)  # pages 1..120: what the stalled streams read
            c.create_pool("glm-5.2", num_layers=8, size_tokens=1024, pool_id="dst")
        yield dp


class StalledStreams:
    """``n`` ReadPages streams of pages 1..120 of every layer, each running (first message received)
    and then not read: they hold ``n`` stream slots and as many workers."""

    def __init__(self, address: str, n: int = STREAMS) -> None:
        self.channels = [grpc.insecure_channel(address) for _ in range(n)]
        self.calls = []
        runs = [transfer_pb2.PageRun(layer_id=x, component=transfer_pb2.PAGE_COMPONENT_LATENT, first_page=1,
                                     num_pages=120) for x in range(8)]
        for ch in self.channels:
            call = transfer_pb2_grpc.TransferServiceStub(ch).ReadPages(
                transfer_pb2.ReadPagesRequest(pool_id="default", runs=runs), timeout=300)
            self.calls.append(call)
            next(call)

    def __enter__(self) -> StalledStreams:
        return self

    def __exit__(self, *exc: object) -> None:
        for call in self.calls:
            call.cancel()
        for ch in self.channels:
            ch.close()


def _pull_while_stalled(d: DaemonProcess, peer_address: str, seed: int, stalled: int = STREAMS) -> None:
    with KVTierClient(d.address, timeout=60) as c:
        src = c.allocate_slots("default", 2 * PS)
        g = torch.Generator().manual_seed(seed)
        latent = {x: torch.randint(0, 256, (2 * PS, 656), dtype=torch.uint8, generator=g) for x in range(8)}
        index = {x: (torch.randint(0, 256, (2 * PS, 128), dtype=torch.uint8, generator=g),
                     torch.rand(2 * PS, generator=g, dtype=torch.float32)) for x in LIVE}
        c.write_kv("default", src, latent=latent, index=index)
        c.allocate_slots("dst", PS)  # destination page ids differ from the source's
        dst = c.allocate_slots("dst", 2 * PS)
        with StalledStreams(d.address, stalled):
            r = c.pull_kv("dst", peer_address, "default", src_slots=src, dst_slots=dst, transport="grpc", timeout=30)
            assert r.transport == "local" and r.num_pages == 2
            assert (r.latent_bytes, r.index_bytes) == (8 * 2 * PS * 656, len(LIVE) * 2 * 8448)
        kv = c.read_kv("dst", dst)
        for x in range(8):
            assert torch.equal(kv.latent[x], latent[x]), f"latent layer {x}"
        for x in LIVE:
            assert torch.equal(kv.index_k[x], index[x][0]) and torch.equal(kv.index_scale[x], index[x][1]), f"indexer {x}"
        c.free_slots("dst", dst)
        c.free_slots("default", src)


def test_a_pull_from_the_bound_address_copies_in_process(d):
    """The daemon's own address: the pull needs neither a second worker nor a stream slot."""
    _pull_while_stalled(d, d.address, seed=31)


def test_a_pull_from_another_spelling_of_the_daemon_is_recognised_by_its_id(d):
    """``localhost:PORT`` for a daemon bound to ``127.0.0.1:PORT``: not its bound address, so the pull
    takes the last stream slot, asks for the layout, meets its own daemon id and copies in process."""
    port = d.address.rpartition(":")[2]
    _pull_while_stalled(d, f"localhost:{port}", seed=32, stalled=STREAMS - 1)


def test_a_same_daemon_pull_onto_the_source_pool_is_refused_before_anything_moves(d):
    """Pool into itself through its own daemon: INVALID_ARGUMENT naming MoveKV; the pages stay allocated."""
    with KVTierClient(d.address, timeout=30) as c:
        src = c.allocate_slots("default", PS)
        dst = c.allocate_slots("default", PS)
        with pytest.raises(InvalidArgumentError, match="would pull from itself"):
            c.pull_kv("default", d.address, "default", src_slots=src, dst_slots=dst, transport="grpc")
        assert c.free_slots("default", torch.cat([src, dst])) == 2


def test_crossed_same_daemon_pulls_both_land(d):
    """Pool A's pages into B and B's into A at once, on one daemon: each used to hold its destination
    exclusive while waiting for a ReadPages of the other's source, until both deadlines (README,
    "Concurrency"). Copied in process, neither holds two pool locks: both land byte for byte."""
    import threading

    with KVTierClient(d.address, timeout=60) as c:
        c.create_pool("glm-5.2", num_layers=8, size_tokens=1024, pool_id="a")
        c.create_pool("glm-5.2", num_layers=8, size_tokens=1024, pool_id="b")
        src = {p: c.allocate_slots(p, 2 * PS) for p in ("a", "b")}
        dst = {p: c.allocate_slots(p, 2 * PS) for p in ("a", "b")}
        rows = {}
        for i, p in enumerate(("a", "b")):
            g = torch.Generator().manual_seed(40 + i)
            rows[p] = {x: torch.randint(0, 256, (2 * PS, 656), dtype=torch.uint8, generator=g) for x in range(8)}
            c.write_kv(p, src[p], latent=rows[p])
    errors: list[BaseException] = []

    def pull(into: str, source: str) -> None:
        try:
            with KVTierClient(d.address, timeout=30) as cc:
                for _ in range(10):
                    cc.pull_kv(into, d.address, source, src_slots=src[source], dst_slots=dst[into], transport="grpc")
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    threads = [threading.Thread(target=pull, args=("a", "b")), threading.Thread(target=pull, args=("b", "a"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    with KVTierClient(d.address, timeout=60) as c:
        for into, source in (("a", "b"), ("b", "a")):
            kv = c.read_kv(into, dst[into], index_layers=[])
            assert all(torch.equal(kv.latent[x], rows[source][x]) for x in range(8)), f"{source} into {into}"
        for p in ("a", "b"):
            c.delete_pool(p, force=True)


def test_a_pull_naming_its_own_socket_through_a_symlink_copies_in_process(tmp_path):
    """Attack pass 7, A7-10: a pull naming the daemon's own unix socket by another path (a symlink
    listed in --pd-peers) asked itself for the layout over gRPC; with every other worker held, the
    pull waited out its deadline (ABORTED after 30 s). The same socket file by any path is now the
    daemon itself: the pull copies in process, on its own worker, and the bytes land. Here the
    daemon's second worker is held by an AllocateSlots whose request message never comes."""
    sock, alias = tmp_path / "run" / "d.sock", tmp_path / "run" / "alias.sock"
    sock.parent.mkdir(mode=0o700)
    alias.symlink_to(sock)
    args = ["--device", "cpu", "--workers", "2", "--max-streams", "1", "--request-arrival-seconds", "600",
            "--pool", "a=glm-5.2:1024", "--pool", "b=glm-5.2:1024", "--pool-layers", "2",
            "--pd-peers", f"unix://{alias}", "--log-level", "WARNING"]
    with DaemonProcess(f"unix://{sock}", extra_args=args) as dp, KVTierClient(dp.address, timeout=60, retries=0) as c:
        src, dst = c.allocate_slots("a", PS), c.allocate_slots("b", PS)
        rows = torch.randint(0, 256, (PS, 656), dtype=torch.uint8, generator=torch.Generator().manual_seed(11))
        c.write_kv("a", src, latent={x: rows for x in range(2)})
        stalled = StalledCalls(dp.address, "/kvtier.v1.PoolService/AllocateSlots", 1)
        try:
            time.sleep(0.5)  # the stalled call holds a worker
            r = c.pull_kv("b", f"unix://{alias}", "a", src_slots=src, dst_slots=dst, transport="grpc", timeout=10)
        finally:
            stalled.close()
        assert r.transport == "local"
        assert torch.equal(c.read_kv("b", dst, index_layers=[]).latent[1], rows)
