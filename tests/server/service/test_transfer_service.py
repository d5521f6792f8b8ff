"""PD transfer between two real daemon processes on 127.0.0.1: PullKV over Mooncake and gRPC.

Pools are GLM-5.2 cut to 8 layers (full 0, 1, 2, 6; skip 3, 4, 5, 7), 2048 tokens (32 pages).
The Mooncake Transfer Engine is required: a daemon started with ``--transfer-engine mooncake``
exits when it is missing, and these tests fail.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from kvtier.client import DaemonProcess, FailedPreconditionError, InvalidArgumentError, KVTierClient, KVTierError

LIVE, SKIP = (0, 1, 2, 6), (3, 4, 5, 7)
POOL = ["--pool", "glm-5.2:2048", "--pool-layers", "8", "--device", "cpu"]
PS = 64


def _daemon(engine: str, env: dict[str, str] | None = None) -> DaemonProcess:
    d = DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=[*POOL, "--transfer-engine", engine], env=env)
    d.start()
    return d


@pytest.fixture(scope="module")
def daemons():
    """prefill, decode (both with the engine), failing (engine, 2nd batch fails), plain (no engine)."""
    started = []
    try:
        for engine, env in (("mooncake", None), ("mooncake", None), ("mooncake", {"KVTIER_TRANSFER_FAIL_BATCH": "2"}),
                            ("none", None)):
            started.append(_daemon(engine, env))
        yield dict(zip(("prefill", "decode", "failing", "plain"), started))
    finally:
        codes = []
        for d in started:
            codes.append(d.stop())
            d.cleanup()
        assert codes == [0] * len(started), f"daemons with a transfer engine must exit 0 on SIGTERM, got {codes}"


def random_kv(n: int, seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    latent = {x: torch.randint(0, 256, (n, 656), dtype=torch.uint8, generator=g) for x in range(8)}
    index = {x: (torch.randint(0, 256, (n, 128), dtype=torch.uint8, generator=g),
                 torch.rand(n, generator=g, dtype=torch.float32)) for x in LIVE}
    return latent, index


def pages_of(slots: torch.Tensor) -> list[int]:
    return (slots[::PS] // PS).tolist()


def verify_same_kv(client: KVTierClient, slots: torch.Tensor, latent: dict, index: dict) -> None:
    """Every layer's latent rows and every live layer's keys and scales equal what was written."""
    kv = client.read_kv("default", slots)
    assert sorted(kv.latent) == list(range(8)) and sorted(kv.index_k) == list(LIVE)
    for x in range(8):
        assert torch.equal(kv.latent[x], latent[x]), f"latent layer {x}"
    for x in LIVE:
        assert torch.equal(kv.index_k[x], index[x][0]), f"index_k layer {x}"
        assert torch.equal(kv.index_scale[x], index[x][1]), f"scale layer {x}"


def written_request(prefill: KVTierClient, n_pages: int, seed: int):
    slots = prefill.allocate_slots("default", n_pages * PS)
    latent, index = random_kv(slots.numel(), seed)
    prefill.write_kv("default", slots, latent=latent, index=index)
    return slots, latent, index


@pytest.mark.parametrize("transport", ["mooncake", "grpc"])
def test_pull_is_byte_identical_and_skip_aware(daemons, transport):
    """4 pages written on the prefill side, pulled onto other (reversed) pages of the decode side."""
    with KVTierClient(daemons["prefill"].address) as pre, KVTierClient(daemons["decode"].address) as dec:
        src, latent, index = written_request(pre, 4, seed=11)
        pad = dec.allocate_slots("default", 3 * PS)  # so destination page ids differ from the source's
        dst = dec.allocate_slots("default", 4 * PS)
        src_pages, dst_pages = pages_of(src), pages_of(dst)[::-1]
        assert src_pages != dst_pages
        r = dec.pull_kv("default", daemons["prefill"].address, "default", src_pages=src_pages, dst_pages=dst_pages,
                        transport=transport)
        dst_slots = torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in dst_pages])
        verify_same_kv(dec, dst_slots, latent, index)
        assert r.transport == transport and r.num_pages == 4
        assert r.index_bytes == len(LIVE) * 4 * 8448
        assert r.latent_bytes == 8 * 4 * 656 * 64
        assert r.total_bytes == r.latent_bytes + r.index_bytes
        for layer in r.layers:
            if layer.layer_id in SKIP:
                assert (layer.index_bytes, layer.index_requests) == (0, 0)
            else:
                assert layer.index_bytes == 4 * 8448 and layer.index_requests == 4  # reversed: nothing coalesces
        assert r.index_requests == len(LIVE) * 4 and r.latent_requests == 8 * 4
        pre.free_slots("default", src)
        dec.free_slots("default", pad)
        dec.free_slots("default", dst)


def test_adjacent_pages_coalesce_and_slot_mappings_work(daemons):
    with KVTierClient(daemons["prefill"].address) as pre, KVTierClient(daemons["decode"].address) as dec:
        src, latent, index = written_request(pre, 3, seed=12)
        dst = dec.allocate_slots("default", 3 * PS)
        r = dec.pull_kv("default", daemons["prefill"].address, "default", src_slots=src, dst_slots=dst)
        verify_same_kv(dec, dst, latent, index)
        assert (r.latent_requests, r.index_requests) == (8, len(LIVE))  # one run per layer and component
        assert r.index_bytes == len(LIVE) * 3 * 8448
        with pytest.raises(InvalidArgumentError, match="not page-aligned"):
            dec.pull_kv("default", daemons["prefill"].address, "default", src_slots=src[1:65], dst_slots=dst[:64])
        pre.free_slots("default", src)
        dec.free_slots("default", dst)


@pytest.mark.parametrize("peer_pool", [dict(role="draft"), dict(page_size=32)], ids=["draft-skip-mask", "page-size-32"])
def test_mismatched_peer_is_refused_before_any_transfer(daemons, peer_pool):
    """A draft pool of the same model (indexer on every layer) or another page size: FAILED_PRECONDITION,
    and the destination pages keep their bytes and stay allocated."""
    with KVTierClient(daemons["prefill"].address) as pre, KVTierClient(daemons["decode"].address) as dec:
        pool_id = "peer-" + "-".join(f"{k}{v}" for k, v in peer_pool.items())
        pre.create_pool("glm-5.2", size_tokens=2048, num_layers=8, pool_id=pool_id, device="cpu", **peer_pool)
        ps = peer_pool.get("page_size", PS)
        src = pre.allocate_slots(pool_id, 2 * ps)
        dst = dec.allocate_slots("default", 2 * PS)
        latent, index = random_kv(dst.numel(), seed=13)
        dec.write_kv("default", dst, latent=latent, index=index)
        expected = "skip masks differ" if "role" in peer_pool else "page sizes differ: 64 tokens here, 32 on the peer"
        for transport in ("mooncake", "grpc"):
            with pytest.raises(FailedPreconditionError, match=expected):
                dec.pull_kv("default", daemons["prefill"].address, pool_id, src_pages=(src[::ps] // ps).tolist(),
                            dst_pages=pages_of(dst), transport=transport)
        verify_same_kv(dec, dst, latent, index)
        assert dec.free_slots("default", dst) == 2  # still allocated
        pre.free_slots(pool_id, src)
        pre.delete_pool(pool_id)


@pytest.mark.parametrize("transport", ["mooncake", "grpc"])
def test_injected_failure_leaves_no_slot_valid(daemons, transport):
    """KVTIER_TRANSFER_FAIL_BATCH=2 with one-item batches: batch 1 moves, batch 2 fails. The call is
    ABORTED and the destination pages are freed: none of them can be read or freed as valid."""
    with KVTierClient(daemons["prefill"].address) as pre, KVTierClient(daemons["failing"].address) as dec:
        src, _, _ = written_request(pre, 2, seed=14)
        before = dec.describe_pool("default").used_pages
        dst = dec.allocate_slots("default", 2 * PS)
        with pytest.raises(KVTierError) as err:
            dec.pull_kv("default", daemons["prefill"].address, "default", src_pages=pages_of(src), dst_pages=pages_of(dst),
                        transport=transport, max_batch_items=1)
        assert err.value.code == grpc.StatusCode.ABORTED
        assert "injected failure in batch 2" in err.value.details and "were freed" in err.value.details
        assert dec.describe_pool("default").used_pages == before
        with pytest.raises(InvalidArgumentError, match="not allocated"):
            dec.read_kv("default", dst)
        with pytest.raises(InvalidArgumentError, match="not allocated"):
            dec.free_slots("default", dst)
        pre.free_slots("default", src)


def test_daemon_without_engine(daemons):
    """No engine: transport mooncake is refused (FAILED_PRECONDITION); the gRPC fallback works either way."""
    with KVTierClient(daemons["prefill"].address) as pre, KVTierClient(daemons["plain"].address) as plain:
        src, latent, index = written_request(pre, 2, seed=15)
        dst = plain.allocate_slots("default", 2 * PS)
        with pytest.raises(FailedPreconditionError, match="without a transfer engine"):
            plain.pull_kv("default", daemons["prefill"].address, "default", src_pages=pages_of(src), dst_pages=pages_of(dst))
        r = plain.pull_kv("default", daemons["prefill"].address, "default", src_pages=pages_of(src),
                          dst_pages=pages_of(dst), transport="grpc")
        verify_same_kv(plain, dst, latent, index)
        assert r.index_bytes == len(LIVE) * 2 * 8448
        plain.free_slots("default", dst)
        pre.free_slots("default", src)


def test_unallocated_pages_are_refused(daemons):
    with KVTierClient(daemons["prefill"].address) as pre, KVTierClient(daemons["decode"].address) as dec:
        dst = dec.allocate_slots("default", PS)
        with pytest.raises(InvalidArgumentError, match="not allocated"):  # on the peer: checked in GetTransferLayout
            dec.pull_kv("default", daemons["prefill"].address, "default", src_pages=[30], dst_pages=pages_of(dst))
        src = pre.allocate_slots("default", PS)
        with pytest.raises(InvalidArgumentError, match="destination pages contains page 31, which is not allocated"):
            dec.pull_kv("default", daemons["prefill"].address, "default", src_pages=pages_of(src), dst_pages=[31])
        with pytest.raises(InvalidArgumentError, match="would pull from itself"):
            dec.pull_kv("default", daemons["decode"].address, "default", src_pages=pages_of(dst), dst_pages=pages_of(dst),
                        transport="grpc")
        layout = dec.transfer_layout("default")
        assert [i.item_len for i in layout.index] == [0 if x in SKIP else 8448 for x in range(8)]
        assert layout.engine_endpoint.startswith("127.0.0.1:") and len(layout.registered) == 2
        dec.free_slots("default", dst)
        pre.free_slots("default", src)


def test_a_layout_the_caller_holds_is_not_sent_again_and_pages_are_still_checked(daemons):
    """GetTransferLayout with the digest of the layout the caller holds answers `unchanged` without the
    layout's body (what a second PullKV from the same peer pool gets); another digest gets the whole
    layout; the source pages are checked either way, also on a pull after one that cached the layout."""
    with KVTierClient(daemons["prefill"].address) as pre, KVTierClient(daemons["decode"].address) as dec:
        full = pre.transfer_layout("default")
        assert len(full.layout_digest) == 32 and not full.unchanged and len(full.latent) == 8
        same = pre.transfer_layout("default", known_digest=full.layout_digest)
        assert same.unchanged and same.layout_digest == full.layout_digest
        assert not same.latent and not same.index and not same.registered and not same.engine_endpoint
        other = pre.transfer_layout("default", known_digest="0" * 32)
        assert not other.unchanged and other == full
        with pytest.raises(InvalidArgumentError, match="not allocated"):
            pre.transfer_layout("default", check_pages=[29], known_digest=full.layout_digest)
        src, latent, index = written_request(pre, 2, seed=41)
        dst = dec.allocate_slots("default", 2 * PS)
        for _ in range(2):  # the second pull uses the layout the first one fetched
            dec.pull_kv("default", daemons["prefill"].address, "default", src_slots=src, dst_slots=dst)
            verify_same_kv(dec, dst, latent, index)
        with pytest.raises(InvalidArgumentError, match="not allocated"):
            dec.pull_kv("default", daemons["prefill"].address, "default", src_pages=[29, 30], dst_pages=pages_of(dst))
        pre.free_slots("default", src)
        dec.free_slots("default", dst)


def test_concurrent_pulls_are_each_byte_identical(daemons):
    """Four pulls at once into one decode pool (serialised on its lock), over both transports."""
    from concurrent.futures import ThreadPoolExecutor

    with KVTierClient(daemons["prefill"].address) as pre, KVTierClient(daemons["decode"].address) as dec:
        requests = [written_request(pre, 2, seed=20 + i) for i in range(4)]
        dsts = [dec.allocate_slots("default", 2 * PS) for _ in requests]

        def pull(i: int):
            with KVTierClient(daemons["decode"].address) as c:
                return c.pull_kv("default", daemons["prefill"].address, "default", src_slots=requests[i][0],
                                 dst_slots=dsts[i], transport="mooncake" if i % 2 else "grpc")

        with ThreadPoolExecutor(4) as ex:
            results = list(ex.map(pull, range(4)))
        for (src, latent, index), dst, r in zip(requests, dsts, results):
            verify_same_kv(dec, dst, latent, index)
            assert r.index_bytes == len(LIVE) * 2 * 8448
            pre.free_slots("default", src)
            dec.free_slots("default", dst)


def test_deleted_pools_are_unregistered(daemons):
    """A pool registered with the engine, deleted and created again under the same id (its memory may
    be reused): the new pool registers and transfers fine; the old ranges are gone."""
    with KVTierClient(daemons["prefill"].address) as pre, KVTierClient(daemons["decode"].address) as dec:
        for round_ in range(3):
            pre.create_pool("glm-5.2", size_tokens=1024, num_layers=8, pool_id="again", device="cpu")
            layout = pre.transfer_layout("again")
            assert len(layout.registered) == 2
            assert sorted((r.ptr, r.nbytes) for r in layout.registered) == sorted(
                [(layout.latent[0].data_ptr, 8 * layout.latent[0].data_len),
                 (layout.index[0].data_ptr, len(LIVE) * layout.index[0].data_len)])
            src = pre.allocate_slots("again", PS)
            latent, index = random_kv(PS, seed=30 + round_)
            pre.write_kv("again", src, latent=latent, index=index)
            dst = dec.allocate_slots("default", PS)
            dec.pull_kv("default", daemons["prefill"].address, "again", src_slots=src, dst_slots=dst)
            verify_same_kv(dec, dst, latent, index)
            dec.free_slots("default", dst)
            pre.delete_pool("again", force=True)


def test_a_stalled_peer_holds_the_destination_pool_no_longer_than_the_callers_deadline(daemons):
    """Regression: PullKV held the destination pool's lock while a peer stalled in ReadPages, for up
    to 600 s after the caller's deadline had passed, blocking every call on that pool. The pull is now
    bounded by the caller's deadline; its destination pages are freed (never presented as valid)."""
    import threading
    import time
    from concurrent import futures

    from kvtier.v1 import transfer_pb2_grpc

    real = transfer_pb2_grpc.TransferServiceStub(grpc.insecure_channel(daemons["prefill"].address))
    release = threading.Event()

    class StalledPeer(transfer_pb2_grpc.TransferServiceServicer):
        def GetTransferLayout(self, request, context):
            return real.GetTransferLayout(request)

        def ReadPages(self, request, context):
            release.wait(60)
            return iter(())

    server = grpc.server(futures.ThreadPoolExecutor(4))
    transfer_pb2_grpc.add_TransferServiceServicer_to_server(StalledPeer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with KVTierClient(daemons["prefill"].address) as p, KVTierClient(daemons["decode"].address) as d:
            src = p.allocate_slots("default", PS)
            dst = d.allocate_slots("default", PS)
            with pytest.raises(KVTierError):
                d.pull_kv("default", f"127.0.0.1:{port}", "default", src_pages=pages_of(src),
                          dst_pages=pages_of(dst), transport="grpc", timeout=2)
            start = time.monotonic()
            d.describe_pool("default", timeout=10)  # the pool is not held by the abandoned pull
            assert time.monotonic() - start < 5
            with pytest.raises(InvalidArgumentError, match="not allocated"):
                d.read_kv("default", dst[:1])  # the destination pages were freed, not left half-filled
            p.free_slots("default", src)
    finally:
        release.set()
        server.stop(0)
