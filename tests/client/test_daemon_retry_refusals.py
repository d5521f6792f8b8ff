"""The client sends again every refusal the daemon marks "changed nothing" (``kvtier-retry:
unchanged``), whatever its status code, within the call's deadline; a refusal without the mark is not.

A real daemon with one KV stream slot (``--max-streams 1``), held by a stalled ReadPages (confirmed
running by its first message) until the daemon's log shows the call under test refused; then the
holder is cancelled, the slot comes back and the retried call lands.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from kvtier.client import KVTierClient, ResourceExhaustedError
from kvtier.client.spawn import DaemonProcess
from kvtier.v1 import transfer_pb2, transfer_pb2_grpc

PS = 64
ARGS = ["--device", "cpu", "--pool", "glm-5.2:8192", "--pool-layers", "8", "--log-level", "INFO",
        "--max-streams", "1", "--stream-idle-seconds", "600"]


@pytest.fixture(scope="module")
def d():
    with DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=ARGS) as dp:
        yield dp


def _while_the_slot_is_held(d, method: str, call):
    """Run ``call()`` in a thread while a stalled ReadPages holds the one stream slot, until the log
    shows ``method`` refused RESOURCE_EXHAUSTED (or ``call`` ended); then free the slot. ``call``'s
    result, or the exception it raised."""
    refusal = f"{method} -> RESOURCE_EXHAUSTED"
    before = d.log_path.read_text(errors="replace").count(refusal)
    runs = [transfer_pb2.PageRun(layer_id=x, component=transfer_pb2.PAGE_COMPONENT_LATENT, first_page=1,
                                 num_pages=120) for x in range(8)]  # 40 MB: beyond the flow-control window
    ch = grpc.insecure_channel(d.address)
    blocker = transfer_pb2_grpc.TransferServiceStub(ch).ReadPages(
        transfer_pb2.ReadPagesRequest(pool_id="default", runs=runs), timeout=300)
    next(blocker)  # it holds the one stream slot now
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except Exception as e:  # noqa: BLE001 - the test reports it
            outcome["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        while d.log_path.read_text(errors="replace").count(refusal) == before and t.is_alive():
            time.sleep(0.05)
    finally:
        blocker.cancel()
        ch.close()
    t.join(60)
    assert not t.is_alive()
    return outcome


def test_write_and_read_refused_for_a_full_stream_limit_are_retried_within_the_deadline(d):
    """Regression: WriteKV and ReadKV refused RESOURCE_EXHAUSTED "--max-streams ... retry when one has
    finished" (marked unchanged) failed at once though their deadline (60 s) was far; now each is
    sent again and lands once the slot is back: the rows written are the rows read."""
    with KVTierClient(d.address, timeout=60) as c:
        c.allocate_slots("default", 120 * PS)  # pages 1..120: the stalled stream's source
        slots = c.allocate_slots("default", PS)
        g = torch.Generator().manual_seed(5)
        latent = {x: torch.randint(0, 256, (PS, 656), dtype=torch.uint8, generator=g) for x in range(8)}
        out = _while_the_slot_is_held(d, "WriteKV", lambda: c.write_kv("default", slots, latent=latent))
        assert "error" not in out, f"write_kv failed: {out.get('error')}"
        out = _while_the_slot_is_held(d, "ReadKV", lambda: c.read_kv("default", slots, index_layers=[]))
        assert "error" not in out, f"read_kv failed: {out.get('error')}"
        for x in range(8):
            assert torch.equal(out["result"].latent[x], latent[x]), f"latent layer {x}"


def test_a_refusal_without_the_mark_is_not_retried(d):
    """RESOURCE_EXHAUSTED for pages the pool does not have changes nothing either, but is not marked
    (retrying cannot help): it comes back as it is, not as a deadline passed while retrying."""
    with KVTierClient(d.address, timeout=60) as c:
        with pytest.raises(ResourceExhaustedError) as info:
            c.allocate_slots("default", 1 << 30)
        assert not info.value.unchanged
