"""Calls whose request message never arrives cannot hold the daemon's threads (``arrival.py``).

Regression (docs "Known limit: calls whose request never arrives"): gRPC Python starts a unary call
on a pool thread before its request message has arrived and waited for it with no time limit, so a
client that sent a call's headers and never its message held one thread a call: 4 such health
checks held every ``kvtier-monitor`` thread, ``--workers`` such data calls every worker.

The daemon tests are structural, not timed: the stalled calls are raw HTTP/2 calls of a unary method
whose request iterator never yields (headers sent, no message), more of them than threads. Before
the fix the monitoring and data calls behind them ran out of their 20 s deadline and the stalled
calls ran to their own; now the arrival deadline (1 s here) cancels the stalled ones (CANCELLED,
never UNKNOWN or INTERNAL) and the calls behind them answer. The watchdog's decisions are checked
on a clock of the test's own.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from stalled import StalledCalls

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess
from kvtier.server.service.arrival import RequestArrival, late_seconds, waiting_cap
from kvtier.server.service.interceptors import handler_like, mark_refusal
from kvtier.server.service.monitoring import MONITOR_WORKERS
from kvtier.v1 import pool_pb2

WORKERS = 4
ARGS = ["--device", "cpu", "--workers", str(WORKERS), "--max-streams", "2", "--request-arrival-seconds", "1",
        "--stream-idle-seconds", "600", "--pool", "glm-5.2:8192", "--pool-layers", "8", "--log-level", "WARNING"]
CHECK = "/grpc.health.v1.Health/Check"
LIST_POOLS = "/kvtier.v1.PoolService/ListPools"
DESCRIBE_POOL = "/kvtier.v1.PoolService/DescribePool"
ALLOCATE_SLOTS = "/kvtier.v1.PoolService/AllocateSlots"
READ_KV = "/kvtier.v1.PoolService/ReadKV"


@pytest.fixture(scope="module")
def d():
    with DaemonProcess(extra_args=ARGS) as dp:
        yield dp


def verify_cancelled(stalled: StalledCalls) -> None:
    codes = stalled.codes()
    assert set(codes) == {grpc.StatusCode.CANCELLED}, codes


def test_monitoring_answers_after_body_less_calls_take_every_monitor_thread(d):
    """Twice as many body-less health checks and ListPools as there are monitor threads: health and
    ListPools still answer (within 20 s: before the fix they queued behind the stalled calls for
    120 s), every stalled call ends CANCELLED, and a normal client is unaffected."""
    stalled = [StalledCalls(d.address, CHECK, MONITOR_WORKERS + 2), StalledCalls(d.address, LIST_POOLS, MONITOR_WORKERS)]
    try:
        time.sleep(0.2)  # the stalled calls reach the daemon first
        with KVTierClient(d.address, timeout=20, retries=0) as c:
            assert c.health() == "SERVING"
            assert [p.pool_id for p in c.list_pools()] == ["default"]
        for s in stalled:
            verify_cancelled(s)
    finally:
        for s in stalled:
            s.close()


def test_data_calls_answer_after_body_less_calls_take_every_worker(d):
    """Twice as many body-less unary and server-streaming data calls as there are workers:
    DescribePool still answers and every stalled call ends CANCELLED."""
    stalled = [StalledCalls(d.address, m, WORKERS) for m in (DESCRIBE_POOL, ALLOCATE_SLOTS, READ_KV)]
    try:
        time.sleep(0.2)
        with KVTierClient(d.address, timeout=20, retries=0) as c:
            assert c.describe_pool("default").pool_id == "default"
        for s in stalled:
            verify_cancelled(s)
    finally:
        for s in stalled:
            s.close()


def test_a_flood_of_body_less_health_checks_drains_and_a_new_health_check_answers(d):
    """Attack pass 3, N2: 300 body-less health checks (no token needed) held a new client's health
    check for 46 s: each held a monitor thread for 0.5-0.75 s before it was cancelled. The monitor
    threads' requests are a few bytes, so such a call is late after 0.05 s (more on a loaded machine,
    at most 0.5 s); the new check answers within its 30 s deadline, and every stalled call ends
    CANCELLED."""
    stalled = [StalledCalls(d.address, CHECK, 50) for _ in range(6)]
    try:
        time.sleep(0.2)
        with KVTierClient(d.address, timeout=30, retries=0) as c:
            assert c.health() == "SERVING"
        for s in stalled:
            verify_cancelled(s)
    finally:
        for s in stalled:
            s.close()


def test_slow_senders_that_keep_no_call_waiting_are_served():
    """Attack pass 3, N6: a request that took longer than 0.5 s to arrive (MiB on a loaded machine)
    was cancelled as late whenever more than a quarter of the workers' calls were late, though no
    call waited for a thread. Three DescribePools whose message comes 1.5 s after their headers
    (arrival deadline 5 s, 4 workers: a cap of 1 late call, and no queue) are all answered."""
    args = [*ARGS]
    args[args.index("--request-arrival-seconds") + 1] = "5"
    with DaemonProcess(extra_args=args) as dp, grpc.insecure_channel(dp.address) as ch:
        call = ch.stream_stream(DESCRIBE_POOL, request_serializer=pool_pb2.DescribePoolRequest.SerializeToString,
                                response_deserializer=pool_pb2.PoolInfo.FromString)

        def slow():
            time.sleep(1.5)
            yield pool_pb2.DescribePoolRequest(pool_id="default")
        answers: list[object] = []

        def one():
            try:
                answers.append([info.pool_id for info in call(slow(), timeout=30)])
            except grpc.RpcError as e:
                answers.append(e.code())
        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert answers == [["default"]] * 3


def test_a_request_sent_after_the_headers_but_in_time_is_served(d):
    """A client that sends its request message 0.1 s after the call's headers (the deadline is 1 s)
    gets its answer; one that half-closes without a message is UNIMPLEMENTED, as gRPC answers it."""
    with grpc.insecure_channel(d.address) as ch:
        call = ch.stream_stream(DESCRIBE_POOL, request_serializer=pool_pb2.DescribePoolRequest.SerializeToString,
                                response_deserializer=pool_pb2.PoolInfo.FromString)

        def slow():
            time.sleep(0.1)
            yield pool_pb2.DescribePoolRequest(pool_id="default")
        assert [info.pool_id for info in call(slow(), timeout=20)] == ["default"]
        with pytest.raises(grpc.RpcError) as e:
            list(call(iter(()), timeout=20))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, e.value.details()


# -- the watchdog's decisions, on the test's clock ---------------------------------------------------

class Aborted(Exception):
    pass


class FakeContext:
    """What the watchdog and the reader use of a servicer context: ``cancel`` and ``abort``."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class NeverArrives:
    """A request stream whose message never comes: ``next`` waits until the call is cancelled, then
    raises ``grpc.RpcError``, as gRPC's request iterator does."""

    def __init__(self, context: FakeContext) -> None:
        self.context = context

    def __iter__(self):
        return self

    def __next__(self):
        assert self.context.cancelled.wait(30), "never cancelled"
        raise grpc.RpcError()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _guard(seconds: float, cap: int, clock: Clock) -> RequestArrival:
    guard = RequestArrival(seconds, {"pool": cap}, lambda _m: "pool", clock=clock)
    guard.close()  # no watchdog thread: the test calls check_now itself
    return guard


ECHO_DETAILS = type("Details", (), {"method": "/test.Service/Echo", "invocation_metadata": ()})()


def _echo_handler(guard: RequestArrival):
    """The behavior gRPC would run for a call of a unary echo method (one call handed to the pool: its
    first run takes it off the queue)."""
    handler = grpc.unary_unary_rpc_method_handler(lambda request, _context: f"answer to {request}")
    served = guard.intercept_service(lambda _d: handler, ECHO_DETAILS)
    assert served.request_streaming and not served.response_streaming  # read by the guard, not by gRPC
    return served.stream_unary


def _hand_over(guard: RequestArrival, n: int) -> None:
    """``n`` calls handed to the pool that wait for a thread (gRPC ran their interceptors, not yet their behavior)."""
    handler = grpc.unary_unary_rpc_method_handler(lambda request, _context: request)
    for _ in range(n):
        guard.intercept_service(lambda _d: handler, ECHO_DETAILS)


def _start_stalled(call, n: int) -> tuple[list[FakeContext], list[threading.Thread]]:
    contexts, threads = [], []
    for _ in range(n):
        ctx = FakeContext()
        t = threading.Thread(target=lambda c=ctx: pytest.raises(grpc.RpcError, call, NeverArrives(c), c), daemon=True)
        t.start()
        contexts.append(ctx)
        threads.append(t)
    return contexts, threads


def _wait_waiting(guard: RequestArrival, n: int) -> None:
    end = time.monotonic() + 30
    while guard.waiting != n:
        assert time.monotonic() < end, f"{guard.waiting} waiting, expected {n}"
        time.sleep(0.01)


def _stalled_in_order(guard: RequestArrival, call, n: int) -> tuple[list[FakeContext], list[threading.Thread]]:
    """``n`` calls whose message never comes, started one at a time (the watchlist is oldest first)."""
    contexts, threads = [], []
    for _ in range(n):
        c, t = _start_stalled(call, 1)
        contexts += c
        threads += t
        _wait_waiting(guard, len(contexts))
    return contexts, threads


def test_late_calls_beyond_the_cap_go_at_once_the_rest_at_the_deadline():
    """3 calls wait for a message that never comes, the cap is 1: nothing is cancelled before they
    are late, nor while they keep no other call from a thread (attack pass 3, N6: a slow sender was
    cancelled at 0.5 s though no call waited); once late with a call queued for a thread, the 2
    oldest are cancelled (the pool keeps its share); the last one at the arrival deadline. A request
    that is there is read and answered, and a stream that ends without a message is UNIMPLEMENTED."""
    clock = Clock()
    guard = _guard(10.0, 1, clock)
    call = _echo_handler(guard)
    assert call(iter(["ping"]), FakeContext()) == "answer to ping"
    with pytest.raises(Aborted, match="UNIMPLEMENTED"):
        call(iter(()), FakeContext())
    contexts, threads = _stalled_in_order(guard, call, 3)
    clock.now = late_seconds(10.0) - 0.01
    assert guard.check_now() == 0
    clock.now = late_seconds(10.0) + 0.01
    assert guard.queued("pool") == 0 and guard.check_now() == 0  # late, but nobody waits for a thread
    _hand_over(guard, 1)
    assert guard.queued("pool") == 1 and guard.check_now() == 2
    assert [c.cancelled.is_set() for c in contexts] == [True, True, False]
    clock.now = 10.01
    assert guard.check_now() == 1 and contexts[2].cancelled.is_set()
    for t in threads:
        t.join(30)
    assert guard.waiting == 0 and guard.cancelled == {"deadline": 1, "late": 2}


def test_the_cap_is_a_quarter_of_a_pool_and_late_is_at_most_half_the_deadline():
    assert [waiting_cap(n) for n in (1, 4, 16, 64)] == [1, 1, 4, 16]
    assert late_seconds(5.0) == 0.5 and late_seconds(0.4) == 0.2
    assert late_seconds(5.0, small=True) == 0.05 and late_seconds(0.06, small=True) == 0.03


def test_a_small_pool_counts_a_call_late_after_50_ms():
    """The monitor threads' requests are a few bytes: their calls count as late after 0.05 s, not 0.5 s."""
    clock = Clock()
    guard = RequestArrival(10.0, {"monitor": 1}, lambda _m: "monitor", clock=clock,
                           small_pools=frozenset({"monitor"}))
    guard.close()
    call = _echo_handler(guard)
    contexts, threads = _stalled_in_order(guard, call, 2)
    _hand_over(guard, 1)
    clock.now = 0.04
    assert guard.check_now() == 0
    clock.now = 0.06
    assert guard.check_now() == 1 and [c.cancelled.is_set() for c in contexts] == [True, False]
    clock.now = 10.01
    assert guard.check_now() == 1
    for t in threads:
        t.join(30)


def test_a_daemon_waiting_for_the_cpu_counts_calls_late_only_after_four_times_its_lag():
    """CI failure (a soak on 2 cores): a health check whose message was there, but reached its thread
    only after the daemon's threads had waited for the CPU, was cancelled as late at 0.05 s. Once the
    watchdog measured a 30 ms lag on itself, a monitor call is late after 0.05 + 4 x 0.03 = 0.17 s,
    not 0.05 s; 2 s after the lag (no lag since), after 0.05 s again; the bound never passes 0.5 s
    on the monitor threads (a flood costs a thread no more than before N2's fix), half the arrival
    deadline on the workers."""
    clock = Clock()
    guard = RequestArrival(10.0, {"monitor": 1, "workers": 1}, lambda _m: "monitor", clock=clock,
                           small_pools=frozenset({"monitor"}))
    guard.close()
    assert guard.late_bound("monitor") == pytest.approx(0.05)
    guard.note_lag(0.03)
    assert guard.late_bound("monitor") == pytest.approx(0.17) and guard.late_bound("workers") == pytest.approx(0.62)
    call = _echo_handler(guard)
    contexts, threads = _stalled_in_order(guard, call, 2)
    _hand_over(guard, 1)
    clock.now = 0.16
    assert guard.check_now() == 0  # 0.16 s waited: late before the lag, not now
    guard.note_lag(0.001)  # a smaller lag does not lower the bound within the window
    clock.now = 0.18
    assert guard.check_now() == 1 and [c.cancelled.is_set() for c in contexts] == [True, False]
    clock.now = 2.5  # the 30 ms lag is 2.5 s old; the 1 ms one too (it was not recorded)
    assert guard.late_bound("monitor") == pytest.approx(0.05)
    guard.note_lag(100.0)  # a stall: the bounds stop at 0.5 s (monitor) and half the arrival deadline
    assert guard.late_bound("monitor") == pytest.approx(0.5) and guard.late_bound("workers") == pytest.approx(5.0)
    clock.now = 10.01
    assert guard.check_now() == 1
    for t in threads:
        t.join(30)


def test_a_refusal_from_the_headers_is_answered_without_waiting_for_the_message():
    """A behavior the authentication marked as a refusal (no token) never looks at its request: the
    guard runs it at once, so a client without a token that sends no message holds no thread."""
    guard = _guard(10.0, 1, Clock())
    refused = []

    def refuse(_request, context):
        refused.append(True)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "no token")
    handler = handler_like(grpc.unary_unary_rpc_method_handler(lambda r, _c: r), lambda _b: mark_refusal(refuse))
    wrapped = handler_like(handler, lambda b: (lambda r, c: b(r, c)))  # an interceptor between keeps the mark
    served = guard.intercept_service(lambda _d: wrapped, ECHO_DETAILS)
    ctx = FakeContext()
    with pytest.raises(Aborted, match="UNAUTHENTICATED"):
        served.stream_unary(NeverArrives(ctx), ctx)  # NeverArrives would wait 30 s and fail if read
    assert refused == [True] and guard.waiting == 0 and guard.queued("pool") == 0 and not ctx.cancelled.is_set()


def test_body_less_calls_without_a_token_are_refused_at_once(tmp_path):
    """A daemon with tokens refuses a call without one from its headers: it answers UNAUTHENTICATED
    at once instead of holding a worker until the message arrives or the call is cancelled (before:
    every one of these calls ended CANCELLED after holding a worker)."""
    token = "tok-arrival-0123456789"
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{token}" = "default"\n')  # the tenant of the --pool pools
    tokens.chmod(0o600)
    with DaemonProcess(extra_args=[*ARGS, "--auth-tokens", str(tokens)]) as dp:
        stalled = [StalledCalls(dp.address, m, 2 * WORKERS) for m in (DESCRIBE_POOL, READ_KV)]
        try:
            for s in stalled:
                assert set(s.codes()) == {grpc.StatusCode.UNAUTHENTICATED}
        finally:
            for s in stalled:
                s.close()
        with KVTierClient(dp.address, timeout=20, retries=0, token=token) as c:
            assert c.describe_pool("default").pool_id == "default"
