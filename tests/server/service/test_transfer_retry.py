"""PullKV over gRPC and a peer that refuses its ReadPages as "retry" (issue 23, defect 7).

Two real daemons on 127.0.0.1; the prefill side allows one KV stream (``--max-streams 1``), held by
a stalled ReadPages (confirmed running by its first message) until the pull has been refused once
(seen in the prefill daemon's log). The refusal changed nothing, so the pull sends it again and
lands the bytes once the slot is back, instead of ending ABORTED with its destination pages freed.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess
from kvtier.v1 import transfer_pb2, transfer_pb2_grpc

PS = 64
POOL = ["--device", "cpu", "--pool", "glm-5.2:8192", "--pool-layers", "8", "--log-level", "INFO"]
REFUSAL = "ReadPages -> RESOURCE_EXHAUSTED"
RETRY_S = 0.5  # the decode daemon's --peer-retry-seconds: the bound of a pull without a deadline


@pytest.fixture(scope="module")
def pair():
    with DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=[*POOL, "--max-streams", "1", "--stream-idle-seconds", "600"]) as pre, \
            DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=[*POOL, "--peer-retry-seconds", str(RETRY_S)]) as dec:
        yield pre, dec


def _hold_the_stream_slot(address: str):
    """A stalled ReadPages of 40 MB (beyond the flow-control window) that holds the prefill daemon's
    one stream slot once its first message came; (the call, its channel)."""
    runs = [transfer_pb2.PageRun(layer_id=x, component=transfer_pb2.PAGE_COMPONENT_LATENT, first_page=1,
                                 num_pages=120) for x in range(8)]
    ch = grpc.insecure_channel(address)
    blocker = transfer_pb2_grpc.TransferServiceStub(ch).ReadPages(
        transfer_pb2.ReadPagesRequest(pool_id="default", runs=runs), timeout=300)
    next(blocker)
    return blocker, ch


def _pull_in_background(d: KVTierClient, peer: str, src_pool: str, src, dst):
    """Start ``d.pull_kv`` (gRPC transport, 120 s deadline) into pool ``default`` on a thread; (the thread, a
    dict that gets ``result`` or ``error``)."""
    outcome: dict[str, object] = {}

    def pull() -> None:
        try:
            outcome["result"] = d.pull_kv("default", peer, src_pool, src_slots=src, dst_slots=dst, transport="grpc",
                                          timeout=120)
        except Exception as e:  # noqa: BLE001 - the test reports it
            outcome["error"] = e

    t = threading.Thread(target=pull, daemon=True)
    t.start()
    return t, outcome


def _release_after_refusals(pre, blocker, ch, t: threading.Thread, outcome: dict, refusals: int, before: int) -> None:
    """Hold the stream slot until ``pre``'s log shows ``refusals`` more ReadPages refusals than ``before``
    (or the pull ended), then cancel the stalled stream and wait for the pull, which must have landed."""
    try:
        while pre.log_path.read_text(errors="replace").count(REFUSAL) - before < refusals and t.is_alive():
            time.sleep(0.05)
    finally:
        blocker.cancel()
        ch.close()
    t.join(120)
    assert not t.is_alive()
    assert "error" not in outcome, f"the pull failed: {outcome.get('error')}"


def test_a_pull_refused_for_a_full_stream_limit_retries_and_lands(pair):
    """Regression: the peer's RESOURCE_EXHAUSTED "--max-streams" refusal ended the pull ABORTED and
    freed the caller's destination pages. Now the refusal says "changed nothing", the pull retries
    it within its deadline, and the 2 pages land byte for byte once the stalled stream is cancelled."""
    pre, dec = pair
    with KVTierClient(pre.address, timeout=60) as p, KVTierClient(dec.address, timeout=60) as d:
        blocker_slots = p.allocate_slots("default", 120 * PS)  # pages 1..120: the stalled stream's source
        src = p.allocate_slots("default", 2 * PS)
        g = torch.Generator().manual_seed(7)
        latent = {x: torch.randint(0, 256, (2 * PS, 656), dtype=torch.uint8, generator=g) for x in range(8)}
        p.write_kv("default", src, latent=latent)
        d.allocate_slots("default", 3 * PS)  # destination page ids differ from the source's
        dst = d.allocate_slots("default", 2 * PS)
        blocker, ch = _hold_the_stream_slot(pre.address)  # it holds the one stream slot now
        t, outcome = _pull_in_background(d, pre.address, "default", src, dst)
        _release_after_refusals(pre, blocker, ch, t, outcome, refusals=1, before=0)
        r = outcome["result"]
        assert (r.latent_bytes, r.index_bytes) == (8 * 2 * PS * 656, 4 * 2 * 8448)  # 8 layers; 4 own an indexer
        kv = d.read_kv("default", dst, index_layers=[])
        for x in range(8):
            assert torch.equal(kv.latent[x], latent[x]), f"latent layer {x}"
        d.free_slots("default", dst)
        p.free_slots("default", torch.cat([blocker_slots, src]))


class _ClaimingProxy:
    """A PD peer in front of a real daemon (a gRPC proxy): its layout answer leaves out the daemon
    id (so a pull from the daemon through it streams), and its first ReadPages waits for ``go``
    before it forwards; a refusal is passed on with its trailing metadata, and sets ``refused``."""

    SERVICE = "kvtier.v1.TransferService"

    def __init__(self, target: str) -> None:
        from concurrent import futures

        self.channel = grpc.insecure_channel(target)
        self.laid_out, self.go, self.refused = threading.Event(), threading.Event(), threading.Event()
        layout = self.channel.unary_unary(f"/{self.SERVICE}/GetTransferLayout")
        pages = self.channel.unary_stream(f"/{self.SERVICE}/ReadPages")

        def get_layout(request, context):
            msg = transfer_pb2.TransferLayout.FromString(layout(request, timeout=30))
            msg.daemon_id = ""
            self.laid_out.set()
            return msg.SerializeToString()

        def read_pages(request, context):
            self.go.wait(60)
            try:
                yield from pages(request, timeout=30)
            except grpc.RpcError as e:
                self.refused.set()
                context.set_trailing_metadata(e.trailing_metadata() or ())
                context.abort(e.code(), e.details())

        handlers = {"GetTransferLayout": grpc.unary_unary_rpc_method_handler(get_layout),
                    "ReadPages": grpc.unary_stream_rpc_method_handler(read_pages)}
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(self.SERVICE, handlers),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def close(self) -> None:
        self.go.set()
        self.server.stop(0)
        self.channel.close()


def test_a_pull_whose_source_pages_a_write_claims_mid_pull_retries_and_lands(pair):
    """The sibling refusal: a WriteKV into the source slots claims them after the pull's layout check
    and before its ReadPages, which is refused UNAVAILABLE "changed nothing". The pull sends it
    again; once the write is cancelled (its claim ends, the old rows stay), it lands the old rows.
    Before: ABORTED with the destination pages freed."""
    from kvtier.client import UnavailableError
    from kvtier.v1 import pool_pb2, pool_pb2_grpc

    _, dec = pair  # the decode daemon is its own peer here, through the proxy
    proxy = _ClaimingProxy(dec.address)
    with KVTierClient(dec.address, timeout=60) as d:
        d.create_pool("glm-5.2", num_layers=8, size_tokens=1024, pool_id="claimed-src")
        src = d.allocate_slots("claimed-src", PS)
        g = torch.Generator().manual_seed(9)
        latent = {x: torch.randint(0, 256, (PS, 656), dtype=torch.uint8, generator=g) for x in range(8)}
        d.write_kv("claimed-src", src, latent=latent)
        dst = d.allocate_slots("default", PS)
        outcome: dict[str, object] = {}

        def pull() -> None:
            try:
                outcome["result"] = d.pull_kv("default", proxy.address, "claimed-src", src_slots=src, dst_slots=dst,
                                              transport="grpc", timeout=120)
            except Exception as e:  # noqa: BLE001 - the test reports it
                outcome["error"] = e

        stop_write = threading.Event()

        def messages():
            yield pool_pb2.WriteKVRequest(header=pool_pb2.KVHeader(pool_id="claimed-src", slots=src.tolist(),
                                                                   latent_layers=[0]))
            stop_write.wait(120)  # a writer that stalls after its header: its claim holds the pages

        t = threading.Thread(target=pull, daemon=True)
        ch = grpc.insecure_channel(dec.address)
        write = None
        try:
            t.start()
            assert proxy.laid_out.wait(60)  # the pull checked the source pages and holds its destination
            write = pool_pb2_grpc.PoolServiceStub(ch).WriteKV.future(messages(), timeout=120)
            with KVTierClient(dec.address, timeout=30, retries=0) as quick:
                while True:  # until the claim is in place
                    try:
                        quick.read_kv("claimed-src", src[:1], index_layers=[])
                    except UnavailableError as e:
                        assert "being written by a WriteKV" in str(e)
                        break
                    time.sleep(0.02)
            proxy.go.set()
            assert proxy.refused.wait(60)
        finally:
            if write is not None:
                write.cancel()
            stop_write.set()
            t.join(120)
            ch.close()
            proxy.close()
        assert "error" not in outcome, f"the pull failed: {outcome.get('error')}"
        kv = d.read_kv("default", dst, index_layers=[])
        for x in range(8):
            assert torch.equal(kv.latent[x], latent[x]), f"latent layer {x}"
        d.free_slots("default", dst)
        d.delete_pool("claimed-src", force=True)


def test_a_pull_with_a_deadline_retries_a_refusal_past_the_no_deadline_bound(pair):
    """Regression (the 30 s cap): a pull with a deadline stopped resending a refused ReadPages once
    the no-deadline bound (``peer_retry_seconds``, 0.5 s here) had passed, and ended ABORTED with its
    destination pages freed though its deadline (120 s) was far. The slot is held here until the
    prefill daemon has refused 6 ReadPages of this pull: its pauses between them (0.05, 0.1, 0.2,
    0.4, 0.5 s) add up to 1.25 s, past the bound; the pull still lands once the slot is back."""
    pre, dec = pair
    with KVTierClient(pre.address, timeout=60) as p, KVTierClient(dec.address, timeout=60) as d:
        blocker_slots = p.allocate_slots("default", 120 * PS)
        src = p.allocate_slots("default", PS)
        g = torch.Generator().manual_seed(11)
        latent = {x: torch.randint(0, 256, (PS, 656), dtype=torch.uint8, generator=g) for x in range(8)}
        p.write_kv("default", src, latent=latent)
        dst = d.allocate_slots("default", PS)
        before = pre.log_path.read_text(errors="replace").count(REFUSAL)
        blocker, ch = _hold_the_stream_slot(pre.address)
        t, outcome = _pull_in_background(d, pre.address, "default", src, dst)
        _release_after_refusals(pre, blocker, ch, t, outcome, refusals=6, before=before)
        assert outcome["result"].latent_bytes == 8 * PS * 656
        kv = d.read_kv("default", dst, index_layers=[])
        for x in range(8):
            assert torch.equal(kv.latent[x], latent[x]), f"latent layer {x}"
        d.free_slots("default", dst)
        p.free_slots("default", torch.cat([blocker_slots, src]))


def test_a_pull_without_a_deadline_stops_retrying_after_the_bound(pair):
    """The bound still holds a pull sent without a deadline (a raw PullKV, no gRPC timeout): the
    slot stays held until the pull ends, which is ABORTED naming the 0.5 s bound."""
    pre, dec = pair
    with KVTierClient(pre.address, timeout=60) as p, KVTierClient(dec.address, timeout=60) as d:
        blocker_slots = p.allocate_slots("default", 120 * PS)
        src = p.allocate_slots("default", PS)
        dst = d.allocate_slots("default", PS)
        blocker, ch = _hold_the_stream_slot(pre.address)
        dch = grpc.insecure_channel(dec.address)
        try:
            req = transfer_pb2.PullKVRequest(pool_id="default", peer_address=pre.address, peer_pool_id="default",
                                             src_slots=src.tolist(), dst_slots=dst.tolist(),
                                             transport=transfer_pb2.TRANSPORT_GRPC)
            with pytest.raises(grpc.RpcError) as info:
                transfer_pb2_grpc.TransferServiceStub(dch).PullKV(req)  # no deadline
        finally:
            blocker.cancel()
            ch.close()
            dch.close()
        assert info.value.code() == grpc.StatusCode.ABORTED
        assert "refused as 'retry' for 0.5 s" in info.value.details()
        p.free_slots("default", torch.cat([blocker_slots, src]))


def test_a_pull_from_a_peer_that_is_down_is_retried_and_lands_once_it_is_back():
    """Regression (peer restart): while the peer daemon was down, and for seconds after it was back
    (the decode daemon's kept channel in gRPC's reconnect backoff), PullKV failed ABORTED
    "GetTransferLayout failed: UNAVAILABLE" though nothing had moved, which the client does not
    retry. Now that answer is UNAVAILABLE marked "changed nothing": the client retries it within its
    deadline (so a pull while the peer is down ends DEADLINE_EXCEEDED, naming the peer unreachable,
    with its destination pages kept), and a pull after the peer restarted on the same port lands."""
    from kvtier.client import AbortedError, DeadlineExceededError

    with DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=POOL) as dec:
        pre = DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=POOL)
        try:
            pre.start()
            with KVTierClient(pre.address, timeout=60) as p, KVTierClient(dec.address, timeout=60) as d:
                src = p.allocate_slots("default", PS)
                dst = d.allocate_slots("default", PS)
                d.pull_kv("default", pre.address, "default", src_slots=src, dst_slots=dst, transport="grpc")
            address = pre.address
        finally:
            pre.stop()
            pre.cleanup()
        with KVTierClient(dec.address, timeout=60) as d:
            for _ in range(3):  # the kept channel fails to connect: gRPC backs off reconnecting
                with pytest.raises((DeadlineExceededError, AbortedError)) as info:
                    d.pull_kv("default", address, "default", src_slots=src, dst_slots=dst, transport="grpc", timeout=2)
                assert isinstance(info.value, DeadlineExceededError), f"not retried: {info.value}"
                assert "unreachable" in str(info.value) and "GetTransferLayout" in str(info.value)
            d.read_kv("default", dst, index_layers=[])  # the destination pages are still allocated
            with DaemonProcess(address, allow_unauthenticated=True, extra_args=POOL) as pre2, KVTierClient(pre2.address, timeout=60) as p:
                src = p.allocate_slots("default", PS)
                g = torch.Generator().manual_seed(13)
                latent = {x: torch.randint(0, 256, (PS, 656), dtype=torch.uint8, generator=g) for x in range(8)}
                p.write_kv("default", src, latent=latent)
                r = d.pull_kv("default", address, "default", src_slots=src, dst_slots=dst, transport="grpc", timeout=60)
                assert r.latent_bytes == 8 * PS * 656
                kv = d.read_kv("default", dst, index_layers=[])
                for x in range(8):
                    assert torch.equal(kv.latent[x], latent[x]), f"latent layer {x}"
