"""Prometheus metrics: one collector that reads a snapshot at scrape time, an RPC latency histogram,
and the HTTP endpoint (prometheus-client's own WSGI app, behind a bearer-token check).

The data path pays nothing for the metrics it already counts: :class:`SnapshotCollector` calls a
snapshot function when Prometheus scrapes and turns its rows into metric families. Only the RPC
latency histogram is observed on the call path (once per call, after it finished, outside every lock
of the daemon). Label sets come from the rows themselves, so adding a label (e.g. ``tenant``) is a
change in the one place that builds the rows (:mod:`kvtier.server.observe.daemon_metrics`).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

#: A metric's rows: ``[(labels, value), ...]``.
Rows = list[tuple[dict[str, str], float]]
#: What a snapshot function returns: ``{metric name: rows}`` for the names of :data:`METRICS`.
Snapshot = dict[str, Rows]


@dataclass(frozen=True)
class MetricSpec:
    """A metric the collector exports: ``kind`` ``gauge`` or ``counter`` (name without ``_total``)."""

    kind: str
    help: str


METRICS: dict[str, MetricSpec] = {
    "kvtier_tier_used_bytes": MetricSpec("gauge", "Bytes a tier holds (device: allocated pool pages; host/disk: "
                                                  "charged record bytes; mooncake: record bytes of the objects this "
                                                  "daemon put into the shared store)."),
    "kvtier_tier_capacity_bytes": MetricSpec("gauge", "Byte budget of a tier (device: all pool pages; mooncake: the "
                                                      "bound of this daemon's ledger of objects put)."),
    "kvtier_tier_healthy": MetricSpec("gauge", "1 while a tier serves, 0 while it is bypassed (storage failed)."),
    "kvtier_hit_pages": MetricSpec("counter", "Prefix-cache pages loaded, by the tier they came from and tenant."),
    "kvtier_miss_pages": MetricSpec("counter", "Prefix-cache pages asked for and found in no tier, by tenant."),
    "kvtier_moves": MetricSpec("counter", "Records moved between tiers (dst 'gone': dropped; 'mooncake(unhealthy)': "
                                          "a publish skipped while that tier is unhealthy, the page stays)."),
    "kvtier_moved_bytes": MetricSpec("counter", "Record bytes moved between tiers."),
    "kvtier_evictions": MetricSpec("counter", "Entries a tier evicted to stay in budget."),
    "kvtier_checksum_failures": MetricSpec("counter", "Records that failed their checksum or header checks."),
    "kvtier_pool_free_pages": MetricSpec("gauge", "Free pages of a device pool."),
    "kvtier_tier_policy": MetricSpec("gauge", "1 for the eviction policy a tier runs (label policy), e.g. lru."),
}

#: Labels of the RPC histogram (``tenant``: the authenticated caller's; "" for health, reflection and
#: calls refused UNAUTHENTICATED).
RPC_LABELS = ("method", "code", "tenant")
#: Latency buckets, seconds: from a metadata call over a unix socket to a multi-GB stream.
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class SnapshotCollector(Collector):
    """Exports :data:`METRICS` from ``snapshot()``, called once per scrape.

    Args:
        snapshot: returns ``{name: [(labels, value), ...]}``; must take no data-path lock.
    """

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        for name, spec in METRICS.items():
            rows = snap.get(name, [])
            labels = list(rows[0][0]) if rows else []
            family_cls = GaugeMetricFamily if spec.kind == "gauge" else CounterMetricFamily
            family = family_cls(name, spec.help, labels=labels)
            for row_labels, value in rows:
                family.add_metric([row_labels[k] for k in labels], value)
            yield family


class RpcMetrics:
    """The RPC latency histogram ``kvtier_rpc_duration_seconds{method,code,tenant}``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.histogram = Histogram("kvtier_rpc_duration_seconds", "Wall time of an RPC from its start until its "
                                   "last message was handled, by method, status code and tenant.", RPC_LABELS,
                                   registry=registry, buckets=RPC_BUCKETS)

    def observe(self, seconds: float, **labels: str) -> None:
        """Record one finished call (labels: :data:`RPC_LABELS`)."""
        self.histogram.labels(**labels).observe(seconds)


#: Seconds a scrape connection may sit idle (a request never finished) before it is closed.
SCRAPE_IDLE_SECONDS = 10.0
#: Seconds the request line and headers may take in all, however they trickle in (slowloris).
SCRAPE_REQUEST_DEADLINE_SECONDS = 5.0
#: Scrape connections served at once; one beyond is closed at once, before a thread is started.
SCRAPE_MAX_CONNECTIONS = 8


class BearerAuth:
    """A WSGI app that passes a request to ``app`` only with ``Authorization: Bearer <token>``;
    anything else is answered 401 with ``WWW-Authenticate: Bearer`` and an empty body.

    The token is compared in constant time (SHA-256 digests, :func:`hmac.compare_digest`), so the
    time an answer takes says nothing about it. The token is never logged or repeated.
    """

    def __init__(self, app: Callable[..., Iterable[bytes]], token: str) -> None:
        if not token:
            raise ValueError("a bearer token is needed")
        self.app = app
        self._digest = hashlib.sha256(token.encode()).digest()

    def allows(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header value carries the token."""
        scheme, _, given = (header or "").strip().partition(" ")
        probe = hashlib.sha256(given.strip().encode("utf-8", "surrogateescape")).digest()
        return hmac.compare_digest(probe, self._digest) and scheme.lower() == "bearer"

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if self.allows(environ.get("HTTP_AUTHORIZATION")):
            return self.app(environ, start_response)
        start_response("401 Unauthorized", [("WWW-Authenticate", 'Bearer realm="kvtier metrics"'),
                                            ("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", "0")])
        return [b""]


class _DeadlineReader(io.RawIOBase):
    """Reads a socket with each recv's timeout shrunk to what is left of a total ``deadline``
    (``time.monotonic()``); past it a read raises :class:`TimeoutError`. The socket's timeout is put
    back to ``idle`` after each recv, so the answer's writes keep the per-send idle timeout."""

    def __init__(self, sock: socket.socket, deadline: float, idle: float) -> None:
        self._sock = sock
        self._deadline = deadline
        self._idle = idle

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("scrape request past its deadline")
        self._sock.settimeout(min(left, self._idle))
        try:
            return self._sock.recv_into(b)
        finally:
            self._sock.settimeout(self._idle)


class _QuietHandler(WSGIRequestHandler):
    """Logs no request (a scrape every few seconds), closes a connection idle past
    :data:`SCRAPE_IDLE_SECONDS` and one whose request (line and headers) took longer than
    :data:`SCRAPE_REQUEST_DEADLINE_SECONDS` in all."""

    timeout = SCRAPE_IDLE_SECONDS
    request_deadline = SCRAPE_REQUEST_DEADLINE_SECONDS

    def setup(self) -> None:
        super().setup()
        deadline = time.monotonic() + self.request_deadline
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline, self.timeout))

    def handle(self) -> None:
        try:
            super().handle()
        except (TimeoutError, ConnectionError):
            self.close_connection = True  # too slow or gone: close quietly, no traceback

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


class _CappedServer(ThreadingWSGIServer):
    """prometheus-client's thread-per-connection server serving at most ``max_connections`` at once:
    a connection beyond is closed at once, before a thread is started for it."""

    max_connections = SCRAPE_MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots_lock = threading.Lock()
        self.active_connections = 0
        self.refused_connections = 0
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._slots_lock:
            if self.active_connections >= self.max_connections:
                self.refused_connections += 1
                full = True
            else:
                self.active_connections += 1
                full = False
        if full:
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release()  # no thread started; the caller closes the request
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._slots_lock:
            self.active_connections -= 1


class MetricsEndpoint:
    """``/metrics`` over HTTP on ``host:port`` (port 0: a free one) for ``registry``: prometheus-client's
    WSGI app (:func:`~prometheus_client.make_wsgi_app`) on its threading WSGI server, behind
    :class:`BearerAuth` when ``token`` is given (None: open to whoever reaches the port).

    Attributes:
        address: ``http://HOST:PORT/metrics`` once started.
    """

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self.address = ""
        self._token = token
        self._server: ThreadingWSGIServer | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"MetricsEndpoint({self.address or f'{self.host}:{self.port}'}, token={'yes' if self._token else 'no'})"

    def start(self) -> str:
        """Start serving; returns :attr:`address`. Raises OSError if the port cannot be bound."""
        app = make_wsgi_app(self.registry)
        if self._token:
            app = BearerAuth(app, self._token)

        class Server(_CappedServer):
            address_family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][0]

        self._server = make_server(self.host, self.port, app, Server, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvtier-metrics", daemon=True)
        self._thread.start()
        port = self._server.server_port
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.address = f"http://{host}:{port}/metrics"
        log.info("metrics on %s (%s)", self.address, "bearer token required" if self._token else "no token")
        return self.address

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
