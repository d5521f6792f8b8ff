"""Monitoring calls run on threads of their own, which the data path can never take.

Every other call of the daemon runs on one of the ``--workers`` threads. Those threads can all be
held by the data path at once: KV streams whose peer stopped reading, PullKVs holding a destination
pool exclusive while their peer streams, calls queued on that pool's lock behind them (issue 23,
defect 3: health and ListPools timed out for the length of a pull's deadline). A monitoring call
queued behind them would wait as long, which breaks the promise that monitoring never waits for the
data path. So the calls of :data:`MONITORING_METHODS` -- the standard health check, ``ListPools``,
``GetStats``, ``GetTierStats``, ``GetUnitStats`` -- run on a pool of :data:`MONITOR_WORKERS`
threads (``kvtier-monitor``) that only they use.

Why a dedicated pool and not a semaphore that keeps some workers back from the data path: a
semaphore would have to be taken by every data call (streams, pulls, lock waits) and would turn the
data path's own waiting into refusals at a limit below ``--workers``; a dedicated pool changes
nothing for the data path and is a bound by construction (the monitoring methods take only the
registry's short lock and leaf locks, README "Concurrency", so they never hold a monitor thread
long). gRPC's sync server picks the executor of each call from the method's behavior: a behavior
with an ``experimental_thread_pool`` attribute (a ``concurrent.futures.ThreadPoolExecutor``) runs
there (grpcio's ``_server._select_thread_pool_for_behavior``, present since 1.5x and in 1.85).
:class:`MonitoringDispatch` is the outermost interceptor, so the behavior it returns is the one
gRPC runs. If a gRPC release dropped that hook, the calls would fall back to the shared workers;
``tests/server/service/test_monitoring_threads.py`` blocks every worker and fails then.

Not on the monitor pool: the health service's ``Watch`` (a stream that lives as long as its
watcher: a few watchers would take every monitor thread) and server reflection (a stream); both
stay on the workers, under a few slots of their own (``open_streams.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from kvtier.server.service.interceptors import handler_like

MONITOR_WORKERS = 4
"""Threads for monitoring calls: each call takes microseconds to a few milliseconds (plain counter
reads), so 4 answer many monitors at once; a burst beyond that queues only behind other monitoring calls."""

MONITORING_METHODS: frozenset[str] = frozenset({
    "/grpc.health.v1.Health/Check",
    "/kvtier.v1.PoolService/ListPools",
    "/kvtier.v1.PoolService/GetStats",
    "/kvtier.v1.TierService/GetTierStats",
    "/kvtier.v1.StorageService/GetUnitStats",
})
"""Full method names of the calls that only read counters and metadata (never a pool, cache, store
or index lock); they run on the monitor threads."""

MONITOR_POOL = "kvtier-monitor"
WORKER_POOL = "kvtier-rpc"
"""Names of the two thread pools a call may run on (their threads' name prefixes)."""


def pool_of(method: str) -> str:
    """The thread pool the calls of ``method`` (a full method name) run on."""
    return MONITOR_POOL if method in MONITORING_METHODS else WORKER_POOL


class MonitoringDispatch(grpc.ServerInterceptor):
    """Routes the calls of :data:`MONITORING_METHODS` to a thread pool of their own (module docstring).

    Must be the first (outermost) interceptor of the server. :meth:`close` shuts its pool down at
    shutdown (without waiting: a call still running ends on its own).

    Args:
        workers: threads of the monitoring pool (>= 1).

    Raises:
        ValueError: ``workers`` < 1.
    """

    def __init__(self, workers: int = MONITOR_WORKERS) -> None:
        if workers < 1:
            raise ValueError(f"need at least 1 monitoring thread, got {workers}")
        self.workers = workers
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=MONITOR_POOL)

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in MONITORING_METHODS:
            return handler

        def on_monitor_threads(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                return behavior(request, context)
            call.experimental_thread_pool = self.executor  # type: ignore[attr-defined]
            return call

        return handler_like(handler, on_monitor_threads)

    def close(self) -> None:
        """Stop the monitoring threads (at shutdown, after the server stopped)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
