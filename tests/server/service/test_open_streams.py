"""Health ``Watch`` and server reflection streams hold a bounded share of the workers (``open_streams.py``).

Regression (docs "Known limit: calls whose request never arrives"): Watch streams (open, no token)
ran on the workers, were not counted against any limit and were never cancelled, so N of them held N
workers. Structural: with one open-stream slot, the streams beyond it are refused at once with
RESOURCE_EXHAUSTED (before the fix each held a worker, and a data call behind them timed out).
"""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess
from kvtier.server.service.open_streams import open_stream_slots
from kvtier.server.service.streams import StreamGuard

WORKERS = 4  # open stream slots: max(1, 4 // 8) = 1
ARGS = ["--device", "cpu", "--workers", str(WORKERS), "--max-streams", "2", "--stream-idle-seconds", "600",
        "--pool", "glm-5.2:8192", "--pool-layers", "8", "--log-level", "WARNING"]


@pytest.fixture(scope="module")
def d():
    with DaemonProcess(extra_args=ARGS) as dp:
        yield dp


def _retry_until_accepted(open_watch, limit_s: float = 30.0):
    end = time.monotonic() + limit_s
    while True:
        try:
            return open_watch()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > end:
                raise
        time.sleep(0.1)


def test_watch_and_reflection_streams_beyond_their_slots_are_refused(d):
    """One Watch stream holds the one open-stream slot; WORKERS + 2 more Watch streams and a
    reflection stream are refused RESOURCE_EXHAUSTED (before the fix each held a worker, and
    DescribePool then timed out), data calls still get workers, and once the watcher goes away its
    slot serves a new Watch."""
    channels = [grpc.insecure_channel(d.address) for _ in range(WORKERS + 3)]
    watches = []
    try:
        def watch(ch):
            call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=120)
            watches.append(call)
            return next(call).status

        assert watch(channels[0]) == health_pb2.HealthCheckResponse.SERVING
        for ch in channels[1:WORKERS + 3]:
            with pytest.raises(grpc.RpcError) as e:
                watch(ch)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        reflect = reflection_pb2_grpc.ServerReflectionStub(channels[-1]).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30)
        with pytest.raises(grpc.RpcError) as e:
            next(reflect)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        with KVTierClient(d.address, timeout=20, retries=0) as c:
            assert c.describe_pool("default").pool_id == "default"
        watches[0].cancel()
        assert _retry_until_accepted(lambda: watch(channels[1])) == health_pb2.HealthCheckResponse.SERVING
    finally:
        for call in watches:
            call.cancel()
        for ch in channels:
            ch.close()


class FakeContext:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_a_watch_is_never_idle_cancelled_a_reflection_stream_is():
    """The open streams' guard cancels an idle reflection stream, never a Watch (waiting is its job)."""
    now = [0.0]
    guard = StreamGuard(2, 30.0, clock=lambda: now[0])
    guard.close()
    watch, reflect = FakeContext(), FakeContext()
    with guard.stream(watch, "Watch", idle_bound=False), guard.stream(reflect, "ServerReflectionInfo"):
        now[0] = 3600.0
        assert guard.check_now() == 1
    assert reflect.cancelled and not watch.cancelled


def test_open_stream_slots_are_an_eighth_of_the_workers():
    assert [open_stream_slots(n) for n in (1, 4, 8, 16, 64)] == [1, 1, 1, 2, 8]
