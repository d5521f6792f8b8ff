"""KV streams may not take every worker thread: a cap on streams in flight and an idle bound.

gRPC's sync server runs each call on one of ``--workers`` threads until it returns. A stream whose
client stalls (a WriteKV that sends nothing more, a ReadKV whose reader stops reading) would hold its
thread until the client's deadline -- forever without one -- and 16 of them stopped every control
call. :class:`StreamGuard` keeps threads for control calls:

* at most ``max_streams`` streams (WriteKV, ReadKV, ReadPages, PutUnits, GetUnits, and PullKVs
  that ask a peer) run at once (default: half the workers); one more is refused at once with RESOURCE_EXHAUSTED naming the limit (marked "changed
  nothing": :class:`~kvtier.server.daemon.errors.StreamsFull`), so streams never hold more than that
  many threads;
* a tenant may hold at most ``tenant_slots`` of them (``--max-streams-per-tenant``: by default all
  of them on a daemon with one tenant, half of them, rounded up, with more): one more of that tenant
  is refused the same way, so a tenant that trickles its streams just inside the idle bound (or
  pulls from a peer that never answers) keeps its own, never the other tenants' share;
* a stream that moves no message for ``stream_idle_seconds`` is cancelled (the public
  ``RpcContext.cancel``): the blocked receive or send ends, the thread and the slot come back. Its
  client sees CANCELLED; a WriteKV cancelled this way has written nothing.

A PullKV holds its slot with ``idle_bound=False`` (it waits for its peer, bounded by its own
timeouts); one whose peer is this daemon's bound address asks no peer and takes none.

A second guard, with slots of its own, bounds the health ``Watch`` and reflection streams
(``open_streams.py``; a ``Watch`` is held with ``idle_bound=False``).

Lock order: the guard's lock is a leaf (a dict update or a scan of plain values; ``cancel`` and
logging happen after it is released).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvtier.server.daemon.errors import StreamsFull

log = logging.getLogger("kvtier.service")


@dataclass
class _Stream:
    method: str
    context: Any
    last: float
    tenant: str = ""
    idle_bound: bool = True
    cancelled: bool = False


class StreamGuard:
    """Stream slots and the idle watchdog of one server.

    Args:
        max_streams: streams allowed in flight at once (>= 1).
        idle_seconds: a stream with no message moved for this long is cancelled.
        clock: monotonic seconds (tests may pass their own).
        kind: what the streams are, for the refusal's message.
        limit: where the limit comes from, for the refusal's message.
        tenant_slots: streams one tenant may hold at once (1..``max_streams``); None: no cap per tenant.
        tenant_limit: where ``tenant_slots`` comes from, for the refusal's message.
    """

    def __init__(self, max_streams: int, idle_seconds: float, clock: Callable[[], float] = time.monotonic, *,
                 kind: str = "KV streams", limit: str = "--max-streams", tenant_slots: int | None = None,
                 tenant_limit: str = "--max-streams-per-tenant") -> None:
        if max_streams < 1 or idle_seconds <= 0:
            raise ValueError(f"need max_streams >= 1 and idle_seconds > 0, got {max_streams}, {idle_seconds}")
        if tenant_slots is not None and not 1 <= tenant_slots <= max_streams:
            raise ValueError(f"need 1 <= tenant_slots <= max_streams ({max_streams}), got {tenant_slots}")
        self.max_streams = max_streams
        self.tenant_slots = tenant_slots
        self.idle_seconds = idle_seconds
        self.kind = kind
        self.limit = limit
        self.tenant_limit = tenant_limit
        self._clock = clock
        self._lock = threading.Lock()  # leaf
        self._streams: dict[int, _Stream] = {}
        self._held: dict[str, int] = {}  # tenant -> streams it holds (tenants holding none are absent)
        self._ids = itertools.count()
        self.cancelled_idle = 0
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvtier-stream-watchdog", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        """Streams running now."""
        return len(self._streams)

    def held_by(self, tenant: str) -> int:
        """Streams ``tenant`` holds now."""
        return self._held.get(tenant, 0)

    @contextmanager
    def stream(self, context: Any, method: str, *, tenant: str = "",
               idle_bound: bool = True) -> Iterator[Callable[[], None]]:
        """Hold a stream slot for the ``with`` block; yields ``touch()``, to call whenever a message moved
        (and ``touch.daemon_working()``, to call while the daemon, not the client, is the one taking
        time -- a WriteKV's claim of its pages or its commit waiting for the pool -- so the stream is
        not cancelled as idle meanwhile, the client's deadline still bounding it; ``touch.client_turn()``
        ends that).
        ``tenant``: whose call it is (counted against ``tenant_slots``; "" for calls of no tenant).
        ``idle_bound=False``: the stream is never cancelled for being idle (it only holds a slot).

        Raises:
            StreamsFull: every slot is taken, or the tenant holds its share (nothing of the call ran;
                RESOURCE_EXHAUSTED marked "changed nothing", so a caller may retry).
        """
        capped = self.tenant_slots is not None and bool(tenant)
        with self._lock:
            full = len(self._streams) >= self.max_streams
            held = self._held.get(tenant, 0)
            share_full = capped and held >= self.tenant_slots  # type: ignore[operator]
            if full or share_full:
                self.refused += 1
            else:
                sid = next(self._ids)
                entry = _Stream(method, context, self._clock(), tenant, idle_bound)
                self._streams[sid] = entry
                if capped:
                    self._held[tenant] = held + 1
        if share_full:
            raise StreamsFull(f"tenant {tenant!r} holds {held} {self.kind}, its share of the daemon's "
                              f"{self.max_streams} ({self.tenant_limit}); retry when one of them has finished")
        if full:
            raise StreamsFull(f"{self.max_streams} {self.kind} are in flight, the daemon's limit ({self.limit}); "
                              f"retry when one has finished")

        def touch() -> None:
            entry.last = self._clock()  # a plain store: no lock on the data path

        def daemon_working() -> None:
            entry.idle_bound = False  # a plain store, read by the watchdog (attack pass 4, A4-16)

        def client_turn() -> None:  # the client's turn again: the idle bound counts from now
            entry.last = self._clock()
            entry.idle_bound = idle_bound

        touch.daemon_working = daemon_working  # type: ignore[attr-defined]
        touch.client_turn = client_turn  # type: ignore[attr-defined]

        try:
            yield touch
        finally:
            with self._lock:
                self._streams.pop(sid, None)
                if capped:
                    left = self._held[tenant] - 1
                    if left:
                        self._held[tenant] = left
                    else:
                        del self._held[tenant]

    def _idle(self) -> list[_Stream]:
        now = self._clock()
        with self._lock:
            stale = [s for s in self._streams.values()
                     if s.idle_bound and not s.cancelled and now - s.last > self.idle_seconds]
            for s in stale:
                s.cancelled = True
            self.cancelled_idle += len(stale)
        return stale

    def check_now(self) -> int:
        """Cancel the streams idle for too long now; returns how many (the watchdog calls this)."""
        stale = self._idle()
        for s in stale:
            log.warning("%s moved no message for %.0f s: cancelled (its worker thread is free again)", s.method,
                        self.idle_seconds)
            try:
                s.context.cancel()
            except Exception:  # noqa: BLE001 - the call may have ended meanwhile
                log.debug("cancelling an idle %s failed", s.method, exc_info=True)
        return len(stale)

    def _watch(self) -> None:
        period = min(max(self.idle_seconds / 4, 0.05), 1.0)
        while not self._stop.wait(period):
            self.check_now()

    def close(self) -> None:
        """Stop the watchdog (at shutdown)."""
        self._stop.set()
