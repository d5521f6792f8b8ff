"""Small pieces the server's interceptors share: re-wrapping a method handler, and counting calls in flight.

Interceptors of the daemon, outermost first (``create_server``): ``monitoring.MonitoringDispatch``
(which thread pool a call runs on), ``arrival.RequestArrival`` (the request message's arrival
deadline), :class:`CallTracker` (calls in flight, for a bounded shutdown), ``auth.AuthInterceptor``
(who the caller is), the RPC timer (with metrics), ``errors.DomainErrorInterceptor`` (domain errors ->
status codes), ``open_streams.OpenStreams`` (slots of the health Watch and reflection streams).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc


REFUSAL_MARK = "_kvtier_refuses_unread"
"""Attribute of a behavior that refuses its call from the call's headers alone (``auth.py``): it never
looks at the request, so ``arrival.py`` runs it without waiting for the request message."""


def mark_refusal(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``behavior`` as a refusal that needs no request message (returns it)."""
    setattr(behavior, REFUSAL_MARK, True)
    return behavior


def is_refusal(behavior: Callable[..., Any] | None) -> bool:
    """Whether ``behavior`` (or what it wraps, through :func:`handler_like`) is a marked refusal."""
    return bool(getattr(behavior, REFUSAL_MARK, False))


def handler_like(handler: grpc.RpcMethodHandler, make: Callable[[Callable[..., Any]], Callable[..., Any]],
                 *, streaming: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
                 deserializer: Callable[..., Any] | None = None) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind whose behavior is ``make(original behavior)`` (``streaming``
    instead of ``make`` for the kinds whose behavior returns an iterator, when given; ``deserializer``
    instead of the handler's request deserializer, when given)."""
    des, ser = deserializer or handler.request_deserializer, handler.response_serializer
    make = _keeping_refusal(make)
    stream = _keeping_refusal(streaming) if streaming else make
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(make(handler.unary_unary), des, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(make(handler.stream_unary), des, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream), des, ser)
    return grpc.stream_stream_rpc_method_handler(stream(handler.stream_stream), des, ser)


def _keeping_refusal(make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``make``, whose result is marked a refusal when the behavior it wraps is one."""
    def wrapped(behavior: Callable[..., Any]) -> Callable[..., Any]:
        new = make(behavior)
        return mark_refusal(new) if is_refusal(behavior) else new
    return wrapped


class CallTracker(grpc.ServerInterceptor):
    """Counts calls whose behavior is running in a worker thread (a streaming call until its last
    message). At shutdown a count above 0 after the grace period means a worker is stuck."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # leaf
        self.in_flight = 0

    def _enter(self) -> None:
        with self._lock:
            self.in_flight += 1

    def _leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None

        def unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                self._enter()
                try:
                    return behavior(request, context)
                finally:
                    self._leave()
            return call

        def streaming(behavior: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
            def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                self._enter()
                try:
                    yield from behavior(request, context)
                finally:
                    self._leave()
            return call

        return handler_like(handler, unary, streaming=streaming)
