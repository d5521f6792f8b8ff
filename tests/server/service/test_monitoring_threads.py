"""Monitoring calls never wait for the data path: with every worker thread held by the data path,
the health check, ListPools, GetStats, GetTierStats and GetUnitStats still answer (issue 23, defect 3).

Structural, not timed: the daemon has 4 workers and 3 stream slots (``--max-streams`` must be below
``--workers``: attack pass 7, A7-11); 3 ReadPages streams, each confirmed running by its first
message, whose reader then stops reading, and one AllocateSlots whose request message never comes
(``--request-arrival-seconds 600``) hold all 4 workers (each stream is 42 MB, far beyond gRPC's
flow-control window, and the idle bound is 600 s). Before the
fix the monitoring calls queued behind them and ran out of their deadline.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from stalled import StalledCalls

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess
from kvtier.v1 import transfer_pb2, transfer_pb2_grpc

WORKERS = 4
ARGS = ["--device", "cpu", "--workers", str(WORKERS), "--max-streams", str(WORKERS - 1), "--stream-idle-seconds", "600",
        "--request-arrival-seconds", "600",
        "--pool", "glm-5.2:8192", "--pool-layers", "8", "--log-level", "WARNING"]


@pytest.fixture(scope="module")
def d():
    with DaemonProcess(extra_args=ARGS) as dp:
        yield dp


def test_monitoring_answers_while_every_worker_is_held(d):
    """3 stalled 42 MB ReadPages streams and a stalled AllocateSlots hold the 4 workers; health, ListPools, GetStats, tier stats
    (with and without a pool) and unit stats answer meanwhile (a deadline of 30 s each: they must not
    queue behind the streams). Once the streams are cancelled, a data call is served again."""
    with KVTierClient(d.address, timeout=60) as c:
        c.allocate_slots("default", 127 * 64)  # pages 1..127
    runs = [transfer_pb2.PageRun(layer_id=x, component=transfer_pb2.PAGE_COMPONENT_LATENT, first_page=1, num_pages=127)
            for x in range(8)]  # 8 x 127 x 64 x 656 bytes = 42.7 MB a stream
    channels = [grpc.insecure_channel(d.address) for _ in range(WORKERS - 1)]
    streams = []
    stalled = None
    try:
        for ch in channels:
            call = transfer_pb2_grpc.TransferServiceStub(ch).ReadPages(
                transfer_pb2.ReadPagesRequest(pool_id="default", runs=runs), timeout=300)
            next(call)  # the stream runs on a worker now; its reader stops reading here
            streams.append(call)
        stalled = StalledCalls(d.address, "/kvtier.v1.PoolService/AllocateSlots", 1)  # the last worker
        time.sleep(0.5)
        with KVTierClient(d.address, timeout=30, retries=0) as c:
            assert c.health() == "SERVING"
            assert [p.pool_id for p in c.list_pools()] == ["default"]
            assert c.stats().pools[0].pool_id == "default"
            assert c.tier_stats("default") is not None and c.tier_stats() is not None
            assert isinstance(c.unit_stats(), dict)
    finally:
        if stalled is not None:
            stalled.close()
        for call in streams:
            call.cancel()
        for ch in channels:
            ch.close()
    with KVTierClient(d.address, timeout=60) as c:  # the workers came back
        assert c.describe_pool("default").pool_id == "default"
