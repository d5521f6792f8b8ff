"""A call's request message must arrive within ``--request-arrival-seconds``, and calls still waiting
for theirs take a bounded share of each thread pool.

gRPC Python's sync server hands a call to a pool thread before its request message has arrived: for
a method whose request is one message, the thread starts the receive and waits for it with no time
limit (grpcio's ``_server._unary_request``). A client that sends a call's headers and never its
message -- a frozen process, or any process that reaches a TCP listener, since the health check is
open and even an UNAUTHENTICATED answer waits for the message -- held one thread a call until it went
away: 4 such health checks held every ``kvtier-monitor`` thread, ``--workers`` such data calls every
worker.

:class:`RequestArrival` gets control before the message is read, with public API only: it serves
every method whose request is one message as a method whose request is a stream (a unary call and a
client-streaming call with one message are the same bytes on the wire), reads the one message itself
and hands it to the method. While the read waits, the call is on a watchlist; a thread
(``kvtier-arrival-watchdog``) cancels it (the public ``RpcContext.cancel``: the read ends with an
``RpcError``, the thread is free, the client sees CANCELLED) when

* its message has not arrived ``seconds`` after the call started (the arrival deadline), or
* it has waited longer than its pool's late bound (:func:`late_seconds`: 0.5 s on the workers, whose
  requests may be MiB; 0.05 s on the monitor threads, whose requests are a few bytes) while more
  than :func:`waiting_cap` calls of its thread pool wait that long (the oldest go first) **and**
  calls are queued for a thread of that pool: calls whose message is late hold at most that share of
  a pool for the arrival deadline, the rest at most the late bound, but only while they keep other
  calls from a thread. A slow sender (a large request on a loaded machine) that keeps no call waiting
  has until the arrival deadline (attack pass 3, N6: such requests were cancelled at 0.5 s). A client
  that sends its message with its headers (every unary stub does) is read within milliseconds and
  never counts as late.

Both late bounds are for a daemon that gets the CPU. When it does not (a loaded machine: other
processes on the cores, or many busy threads of its own waiting for the GIL), a message that is
there reaches its thread late too, because gRPC's polling thread and the reading thread wait for the
CPU like every other: on a 2-core machine under a soak of 32 client threads, a health check was
cancelled as late (a CI failure). The watchdog measures that wait on itself -- how much later than
its period it woke -- and every late bound grows by :data:`LAG_FACTOR` times the largest such lag
of the last :data:`LAG_WINDOW_SECONDS` (a message reaches its thread after two or three such waits:
the polling thread's and the reader's). It grows at most to :data:`LATE_SECONDS` on the monitor
threads (a flood of body-less health checks on a loaded machine costs each thread at most what it
cost before N2's fix) and to half the arrival deadline on the workers. A client cannot raise it by
sending slowly: a call that waits costs the daemon no CPU. The client also sends an idempotent call
the daemon cancelled so again (``client/base.py``).

A flood of calls that send nothing (attack pass 3, N2: 300 body-less health checks held a health
check from a new client for 46 s) thus costs each monitor thread 0.05-0.075 s a call, not 0.5-0.75 s.
A call the authentication refuses from its headers alone (no token, an unknown token: its behavior is
marked, ``interceptors.mark_refusal``) is answered at once, without waiting for its message.

A call whose message arrives in time runs as before. A call that ends before sending a message is
answered UNIMPLEMENTED, as gRPC answers it; bytes the method's deserializer refuses, INTERNAL, as
gRPC answers them (the daemon's methods carry a tolerant deserializer, ``errors.py``, that turns
them into INVALID_ARGUMENT).

Methods whose request is a stream are left alone: the KV streams wait under their own idle bound
(``streams.py``), health ``Watch`` and server reflection under theirs (``open_streams.py``).

Lock order: the watchlist's lock is a leaf (dict updates and a scan of plain values; ``cancel`` and
logging happen after it is released).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from kvtier.server.service.interceptors import is_refusal

log = logging.getLogger("kvtier.service")

LATE_SECONDS = 0.5
"""A request message that has not arrived this long after its call started is late (at most half
the arrival deadline): a client sends it with the call's headers, so it is read within milliseconds."""
SMALL_LATE_SECONDS = 0.05
"""The late bound of a thread pool whose methods take requests of a few bytes (the monitor threads)."""

LAG_FACTOR = 4.0
"""The late bound grows by this many times the watchdog's recent scheduling lag (below)."""
LAG_WINDOW_SECONDS = 2.0
"""How long a lag the watchdog measured keeps raising the late bound."""

LOG_EVERY_SECONDS = 10.0
"""At most one warning line this often about cancelled calls (a flood of them must not flood the log)."""


def late_seconds(arrival_seconds: float, small: bool = False) -> float:
    """How long a call waits for its message before it counts as late (module docstring); ``small``:
    a pool whose requests are a few bytes."""
    return min(SMALL_LATE_SECONDS if small else LATE_SECONDS, arrival_seconds / 2)


def waiting_cap(threads: int) -> int:
    """Late calls of a thread pool of ``threads`` that may wait on to the arrival deadline: a quarter, at least 1."""
    return max(1, threads // 4)


@dataclass
class _Waiting:
    method: str
    pool: str
    context: Any
    since: float
    why: str = ""  # set (under the lock) once the watchdog took the call off the list to cancel it


class RequestArrival(grpc.ServerInterceptor):
    """The arrival deadline and the per-pool cap on late calls (module docstring).

    Must sit outside every interceptor that wraps a method's behavior (they keep seeing the one
    request message), inside the one that picks the call's thread pool (``monitoring.py``).

    Args:
        seconds: a call whose request message has not arrived this long after it started is cancelled.
        caps: thread pool name -> late calls that pool may hold (:func:`waiting_cap` of its threads).
        pool_of: the name of the thread pool a method's calls run on (a key of ``caps``).
        clock: monotonic seconds (tests may pass their own).
        small_pools: names of the pools whose requests are a few bytes (their late bound is
            :data:`SMALL_LATE_SECONDS`).

    Raises:
        ValueError: ``seconds`` <= 0, or a cap < 1.
    """

    def __init__(self, seconds: float, caps: dict[str, int], pool_of: Callable[[str], str],
                 clock: Callable[[], float] = time.monotonic, small_pools: frozenset[str] = frozenset()) -> None:
        if seconds <= 0 or any(c < 1 for c in caps.values()):
            raise ValueError(f"need seconds > 0 and caps >= 1, got {seconds}, {caps}")
        self.seconds = seconds
        self.late = late_seconds(seconds)
        self.lates = {pool: late_seconds(seconds, pool in small_pools) for pool in caps}
        self.ceilings = {pool: late_seconds(seconds) if pool in small_pools else seconds / 2 for pool in caps}
        self.caps = dict(caps)
        self._queued = dict.fromkeys(caps, 0)  # calls handed to a pool whose behavior has not started yet
        self._pool_of = pool_of
        self._clock = clock
        self._lock = threading.Lock()  # leaf
        self._waiting: dict[int, _Waiting] = {}  # insertion order: oldest first
        self._ids = itertools.count()
        self.cancelled = {"deadline": 0, "late": 0}  # calls cancelled, by reason (tests, logs)
        self._unlogged = {"deadline": 0, "late": 0}  # cancelled since the last warning line (watchdog thread only)
        self._unlogged_methods: set[str] = set()
        self._logged_at = -LOG_EVERY_SECONDS
        self._lag = 0.0  # the largest scheduling lag the watchdog measured lately (seconds), and when
        self._lag_at = -LAG_WINDOW_SECONDS
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvtier-arrival-watchdog", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Calls whose request message is being waited for now."""
        return len(self._waiting)

    def queued(self, pool: str) -> int:
        """Calls of ``pool`` handed to it whose behavior has not started yet (waiting for a thread)."""
        return self._queued.get(pool, 0)

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        # runs on gRPC's polling thread, when the call's headers are in; its behavior runs later, on a
        # thread of its pool
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        pool = self._pool_of(method)
        des = handler.request_deserializer
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if is_refusal(behavior):  # refused from its headers alone: answered without its message
            if handler.response_streaming:
                def refuse_stream(_requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                    yield from behavior(None, context)
                return grpc.stream_stream_rpc_method_handler(refuse_stream, None, handler.response_serializer)
            return grpc.stream_unary_rpc_method_handler(lambda _requests, context: behavior(None, context), None,
                                                        handler.response_serializer)
        with self._lock:
            self._queued[pool] = self._queued.get(pool, 0) + 1

        def receive(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            return self._receive(requests, context, method, pool, des)

        if handler.response_streaming:
            def stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                yield from behavior(receive(requests, context), context)
            return grpc.stream_stream_rpc_method_handler(stream, None, handler.response_serializer)

        def call(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            return behavior(receive(requests, context), context)
        return grpc.stream_unary_rpc_method_handler(call, None, handler.response_serializer)

    def _receive(self, requests: Iterator[Any], context: grpc.ServicerContext, method: str, pool: str,
                 des: Callable[[bytes], Any] | None) -> Any:
        """The call's one request message, deserialized; waits on the watchlist (raises ``grpc.RpcError``
        when the call was cancelled meanwhile, by the watchdog or its client)."""
        entry = _Waiting(method, pool, context, self._clock())
        with self._lock:
            self._queued[pool] = max(0, self._queued.get(pool, 0) - 1)  # it has its thread now
            key = next(self._ids)
            self._waiting[key] = entry
        try:
            raw = next(requests, None)
        finally:
            with self._lock:
                self._waiting.pop(key, None)
        if entry.why:  # arrived just as the watchdog cancelled it: the cancel is on its way
            context.abort(grpc.StatusCode.CANCELLED, f"the request message arrived too late ({entry.why})")
        if raw is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, f'"{method}" requires exactly one request message.')
        if des is None:
            return raw
        try:
            return des(raw)
        except Exception:  # noqa: BLE001 - the client's bytes; gRPC's own answer for them
            log.info("%s: the request message cannot be deserialized", method, exc_info=True)
            context.abort(grpc.StatusCode.INTERNAL, "Exception deserializing request!")

    def note_lag(self, lag: float) -> None:
        """Record that the watchdog woke ``lag`` seconds later than it asked to (the daemon waited for
        the CPU that long); the late bounds grow with the largest lag of the last
        :data:`LAG_WINDOW_SECONDS` (module docstring). The watchdog calls this on every scan."""
        now = self._clock()
        with self._lock:
            if lag >= self._lag or now - self._lag_at > LAG_WINDOW_SECONDS:
                self._lag, self._lag_at = max(lag, 0.0), now

    def late_bound(self, pool: str) -> float:
        """Seconds a call of ``pool`` may wait for its message now before it counts as late: its
        pool's bound plus :data:`LAG_FACTOR` times the recent scheduling lag, at most
        :data:`LATE_SECONDS` on a small pool, half the arrival deadline on the others."""
        with self._lock:
            return self._late_bound(pool, self._clock())

    def _late_bound(self, pool: str, now: float) -> float:
        base = self.lates.get(pool, self.late)
        lag = self._lag if now - self._lag_at <= LAG_WINDOW_SECONDS else 0.0
        return max(base, min(base + LAG_FACTOR * lag, self.ceilings.get(pool, self.seconds / 2)))

    def _due(self) -> list[_Waiting]:
        """Take the calls to cancel now off the watchlist and mark them (the deadline first, then the cap)."""
        now = self._clock()
        due: list[_Waiting] = []
        with self._lock:
            late_by_pool: dict[str, list[_Waiting]] = {}
            for w in self._waiting.values():
                if now - w.since > self.seconds:
                    w.why = "deadline"
                    due.append(w)
                elif now - w.since > self._late_bound(w.pool, now):
                    late_by_pool.setdefault(w.pool, []).append(w)
            for pool, late in late_by_pool.items():
                if not self._queued.get(pool, 0):  # they keep no call from a thread: left to the deadline
                    continue
                for w in late[:max(0, len(late) - self.caps.get(pool, 1))]:  # oldest first
                    w.why = "late"
                    due.append(w)
            for w in due:
                self.cancelled[w.why] += 1
            if due:
                self._waiting = {k: w for k, w in self._waiting.items() if not w.why}
        return due

    def check_now(self) -> int:
        """Cancel the calls due now (module docstring); returns how many (the watchdog calls this)."""
        due = self._due()
        for w in due:
            try:
                w.context.cancel()
            except Exception:  # noqa: BLE001 - the call may have ended meanwhile
                log.debug("cancelling %s failed", w.method, exc_info=True)
        self._log(due)
        return len(due)

    def _log(self, due: list[_Waiting]) -> None:
        for w in due:
            self._unlogged[w.why] += 1
            self._unlogged_methods.add(w.method)
        n = sum(self._unlogged.values())
        now = self._clock()
        if not n or now - self._logged_at < LOG_EVERY_SECONDS:
            return
        methods = sorted(self._unlogged_methods)
        log.warning("cancelled %d call%s whose request message did not arrive in time (%d past "
                    "--request-arrival-seconds %.1f, %d late beyond their thread pool's share): %s%s",
                    n, "" if n == 1 else "s", self._unlogged["deadline"], self.seconds, self._unlogged["late"],
                    ", ".join(methods[:5]), f" and {len(methods) - 5} more" if len(methods) > 5 else "")
        self._unlogged = {"deadline": 0, "late": 0}
        self._unlogged_methods = set()
        self._logged_at = now

    def _watch(self) -> None:
        period = min(max(min(self.lates.values(), default=self.late) / 2, 0.02), 1.0)
        asked = time.monotonic() + period
        while not self._stop.wait(period):
            self.note_lag(time.monotonic() - asked)
            self.check_now()
            asked = time.monotonic() + period

    def close(self) -> None:
        """Stop the watchdog (at shutdown)."""
        self._stop.set()
