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


@pytest.fixture(scope="module")
def pair():
    with DaemonProcess("127.0.0.1:0", extra_args=[*POOL, "--max-streams", "1", "--stream-idle-seconds", "600"]) as pre, \
            DaemonProcess("127.0.0.1:0", extra_args=POOL) as dec:
        yield pre, dec


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
        runs = [transfer_pb2.PageRun(layer_id=x, component=transfer_pb2.PAGE_COMPONENT_LATENT, first_page=1,
                                     num_pages=120) for x in range(8)]  # 40 MB: beyond the flow-control window
        ch = grpc.insecure_channel(pre.address)
        blocker = transfer_pb2_grpc.TransferServiceStub(ch).ReadPages(
            transfer_pb2.ReadPagesRequest(pool_id="default", runs=runs), timeout=300)
        next(blocker)  # it holds the one stream slot now
        outcome: dict[str, object] = {}

        def pull() -> None:
            try:
                outcome["result"] = d.pull_kv("default", pre.address, "default", src_slots=src, dst_slots=dst,
                                              transport="grpc", timeout=120)
            except Exception as e:  # noqa: BLE001 - the test reports it
                outcome["error"] = e

        t = threading.Thread(target=pull, daemon=True)
        t.start()
        try:
            while REFUSAL not in pre.log_path.read_text(errors="replace") and t.is_alive():
                time.sleep(0.05)
        finally:
            blocker.cancel()
            ch.close()
        t.join(120)
        assert not t.is_alive()
        assert "error" not in outcome, f"the pull failed: {outcome.get('error')}"
        r = outcome["result"]
        assert (r.latent_bytes, r.index_bytes) == (8 * 2 * PS * 656, 4 * 2 * 8448)  # 8 layers; 4 own an indexer
        kv = d.read_kv("default", dst, index_layers=[])
        for x in range(8):
            assert torch.equal(kv.latent[x], latent[x]), f"latent layer {x}"
        d.free_slots("default", dst)
        p.free_slots("default", torch.cat([blocker_slots, src]))
