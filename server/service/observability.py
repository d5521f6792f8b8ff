"""Glue between the daemon and :mod:`kvtier.server.observe`: the RPC latency interceptor and the
metrics of one daemon (registry, collector over its state, ``/metrics`` endpoint).

Only translation lives here; what is measured and how it is read is in ``server/observe``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry

from kvtier.server.observe.daemon_metrics import daemon_snapshot, pool_view
from kvtier.server.daemon.tenants import Caller
from kvtier.server.observe.metrics import MetricsEndpoint, RpcMetrics, SnapshotCollector

if TYPE_CHECKING:
    from kvtier.server.daemon.config import DaemonConfig
    from kvtier.server.daemon.core import Daemon


def _code(context: grpc.ServicerContext, failed: bool) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if failed:
        return "CANCELLED" if not context.is_active() else "UNKNOWN"
    return "OK"


def _tenant(context: Any) -> str:
    """The tenant of the call's authenticated caller (``auth.CallerContext``); "" for calls without
    one (health, reflection, a refused token)."""
    caller = getattr(context, "caller", None)
    return caller.tenant if isinstance(caller, Caller) else ""


class RpcMetricsInterceptor(grpc.ServerInterceptor):
    """Times every call (unary and streaming, until its last message) into ``kvtier_rpc_duration_seconds``
    with the call's method (``kvtier.v1.PoolService/WriteKV``), final status code and tenant.

    Installed inside ``auth.AuthInterceptor`` (which hands it the caller's context); the calls auth
    refuses before they reach it are timed through :meth:`time_refusal` (tenant "").
    """

    def __init__(self, rpc: RpcMetrics) -> None:
        self.rpc = rpc

    def _wrap_unary(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            start, failed = time.perf_counter(), True
            try:
                out = behavior(request, context)
                failed = False
                return out
            finally:
                self.rpc.observe(time.perf_counter() - start, method=method, code=_code(context, failed),
                                 tenant=_tenant(context))
        return call

    def _wrap_stream(self, behavior: Callable[..., Iterator[Any]], method: str) -> Callable[..., Iterator[Any]]:
        def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            start, failed = time.perf_counter(), True
            try:
                yield from behavior(request, context)
                failed = False
            finally:
                self.rpc.observe(time.perf_counter() - start, method=method, code=_code(context, failed),
                                 tenant=_tenant(context))
        return call

    def time_refusal(self, refuse: Callable[..., Any], method: str) -> Callable[..., Any]:
        """``refuse`` (a behavior that aborts the call, e.g. UNAUTHENTICATED) timed like any call."""
        return self._wrap_unary(refuse, method.lstrip("/"))

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.lstrip("/")
        kinds = (("unary_unary", grpc.unary_unary_rpc_method_handler, self._wrap_unary),
                 ("stream_unary", grpc.stream_unary_rpc_method_handler, self._wrap_unary),
                 ("unary_stream", grpc.unary_stream_rpc_method_handler, self._wrap_stream),
                 ("stream_stream", grpc.stream_stream_rpc_method_handler, self._wrap_stream))
        for attr, make, wrap in kinds:
            behavior = getattr(handler, attr)
            if behavior:
                return make(wrap(behavior, method), handler.request_deserializer, handler.response_serializer)
        return handler


class DaemonMetrics:
    """The metrics of one daemon: a registry with the snapshot collector over ``state`` and the RPC
    histogram; :meth:`start` serves them on ``config.metrics_host:config.metrics_port``."""

    def __init__(self, config: DaemonConfig, state: Daemon) -> None:
        self.registry = CollectorRegistry()
        tiers = state.tiers
        self.registry.register(SnapshotCollector(lambda: daemon_snapshot(
            tiers.stack, tiers.caches, lambda: [pool_view(e) for e in state.pools.list()])))
        self.rpc = RpcMetrics(self.registry)
        self.interceptor = RpcMetricsInterceptor(self.rpc)
        self.endpoint = MetricsEndpoint(self.registry, config.metrics_host, config.metrics_port or 0,
                                        token=state.metrics_token)

    def start(self) -> str:
        """Serve ``/metrics``; returns its address."""
        return self.endpoint.start()

    def stop(self) -> None:
        self.endpoint.stop()


def build_metrics(config: DaemonConfig, state: Daemon) -> DaemonMetrics | None:
    """The daemon's metrics when ``config.metrics_port`` is set (else None: no interceptor, no cost).

    Raises:
        ValueError: the endpoint would be neither guarded by a token nor opened on purpose
            (:meth:`~kvtier.server.daemon.config.DaemonConfig.check_metrics_auth`).
    """
    config.check_metrics_auth()
    if config.metrics_token_file and not state.metrics_token:
        raise ValueError("metrics_token_file is set but the daemon holds no metrics token")
    return DaemonMetrics(config, state) if config.metrics_port is not None else None
