"""The open streams -- health ``Watch`` and server reflection -- hold a small, bounded share of the workers.

Both services answer without a token, and both are streams that hold their worker thread for as
long as the client keeps them open: a ``Watch`` waits for the next health change, a reflection
stream for the next question. Uncounted, N of them held N workers. :class:`OpenStreams` gives them
slots of their own, a :class:`~kvtier.server.service.streams.StreamGuard` of
:func:`open_stream_slots` slots (kept apart from ``--max-streams``: an open stream needs no token,
so it must not be able to take the KV streams' slots):

* one more open stream than that is refused at once with RESOURCE_EXHAUSTED (``StreamsFull``,
  "changed nothing": retry when one has finished);
* a reflection stream that moves no message for ``--stream-idle-seconds`` is cancelled, like a KV
  stream; a ``Watch`` is not (waiting for a change that may never come is its job), so a watcher
  keeps its slot until it goes away.

Their request's arrival is bounded like every call's (``arrival.py``; a reflection stream's first
message, by the idle bound).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from kvtier.server.service.interceptors import handler_like
from kvtier.server.service.streams import StreamGuard

WATCH_METHOD = f"/{health.SERVICE_NAME}/Watch"
REFLECTION_METHOD = f"/{reflection.SERVICE_NAME}/ServerReflectionInfo"
OPEN_STREAM_METHODS: frozenset[str] = frozenset({WATCH_METHOD, REFLECTION_METHOD})
"""Full method names of the open streams (no token needed, open as long as their client likes)."""


def open_stream_slots(workers: int) -> int:
    """Open streams allowed in flight at once on ``workers`` worker threads: an eighth, at least 1."""
    return max(1, workers // 8)


def open_stream_guard(workers: int, idle_seconds: float) -> StreamGuard:
    """The slots and the idle watchdog of the open streams of a server with ``workers`` workers."""
    return StreamGuard(open_stream_slots(workers), idle_seconds, kind="health Watch and reflection streams",
                       limit="an eighth of --workers")


def _touching(requests: Iterator[Any], touch: Callable[[], None]) -> Iterator[Any]:
    for request in requests:
        touch()
        yield request


class OpenStreams(grpc.ServerInterceptor):
    """Holds a slot of ``guard`` around every call of :data:`OPEN_STREAM_METHODS` (module docstring).

    Must sit inside the interceptor that maps domain errors to status codes (``errors.py``): its
    refusal is a ``StreamsFull``.

    Args:
        guard: the open streams' slots (:func:`open_stream_guard`).
    """

    def __init__(self, guard: StreamGuard) -> None:
        self.guard = guard

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in OPEN_STREAM_METHODS:
            return handler
        name = method.rpartition("/")[2]

        def counted(behavior: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
            def call(request_or_iterator: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                with self.guard.stream(context, name, idle_bound=method != WATCH_METHOD) as touch:
                    if handler.request_streaming:
                        request_or_iterator = _touching(request_or_iterator, touch)
                    for response in behavior(request_or_iterator, context):
                        touch()
                        yield response
            return call

        return handler_like(handler, counted)
