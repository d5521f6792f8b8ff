"""The daemon's tier monitor: probes unhealthy tiers with backoff, on one small background thread.

A tier marks itself unhealthy on the data path (e.g. the disk tier when LMDB meets ENOSPC or EIO,
see :mod:`kvtier.server.tiers.health`); the monitor is what brings it back. Each round it

1. probes every tier whose backoff has passed (:meth:`TierHealth.probe_due`): ``tier.probe()``
   succeeding makes it healthy, an exception counts as one more failure (the wait doubles);
2. tells its listeners about every tier whose health changed since the last round (the daemon sets
   the tier's gRPC health service, ``kvtier.tier.<name>``, SERVING or NOT_SERVING).

Locks: while it waits it holds nothing (an ``Event`` wait); a probe takes only that tier's own locks
for as long as the probe runs; listeners are called with no lock held. A change on the data path
wakes it at once (it listens to every tier's :class:`TierHealth`), so health follows within a
round trip of the thread, not a polling period.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kvtier.server.tiers.base import Tier
from kvtier.server.tiers.health import HealthSnapshot

log = logging.getLogger(__name__)

#: Joins the failure that made a tier unhealthy and the latest failed probe in its health reason.
LAST_PROBE = "; last probe: "
#: Called with a tier's new health after each change the monitor sees.
HealthListener = Callable[[HealthSnapshot], None]


class TierMonitor:
    """Probes unhealthy tiers and reports health changes.

    Args:
        tiers: the tiers to watch (e.g. the daemon's stack: host, disk, mooncake).
        poll_s: the longest sleep between rounds when nothing wakes it.

    Use :meth:`start`/:meth:`stop` for the background thread, or call :meth:`run_once` (tests).
    """

    def __init__(self, tiers: Sequence[Tier], *, poll_s: float = 1.0) -> None:
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        self.tiers = list(tiers)
        self.poll_s = poll_s
        self._listeners: list[HealthListener] = []
        self._reported = {t.name: True for t in self.tiers}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.probes = 0
        for t in self.tiers:
            t.health.add_listener(self._wake.set)

    def add_listener(self, listener: HealthListener) -> None:
        """Call ``listener(snapshot)`` from the monitor's thread after each health change."""
        self._listeners.append(listener)

    def wake(self) -> None:
        """Run a round now."""
        self._wake.set()

    def run_once(self) -> list[HealthSnapshot]:
        """Probe the tiers that are due, then report changes. Returns the snapshots reported."""
        for t in self.tiers:
            if not t.health.probe_due():
                continue
            self.probes += 1
            cause = t.health.snapshot().reason.split(LAST_PROBE)[0]
            try:
                t.probe()
            except Exception as e:  # noqa: BLE001 - any failure keeps the tier unhealthy, with the reason
                t.health.mark_unhealthy(f"{cause}{LAST_PROBE}{' '.join(str(e).split()) or type(e).__name__}")
            else:
                t.health.mark_healthy()
        changed = []
        for t in self.tiers:
            snap = t.health.snapshot()
            if snap.healthy != self._reported[t.name]:
                self._reported[t.name] = snap.healthy
                changed.append(snap)
        for snap in changed:
            for listener in self._listeners:
                try:
                    listener(snap)
                except Exception:  # noqa: BLE001 - a listener's failure must not stop the monitor
                    log.exception("tier health listener failed")
        return changed

    def _next_wait(self) -> float:
        waits = [t.health.snapshot().next_probe_in_s for t in self.tiers if not t.health.healthy]
        return min([self.poll_s, *waits]) if waits else self.poll_s

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._next_wait())
            self._wake.clear()
            if self._stop.is_set():
                return
            self.run_once()

    def start(self) -> None:
        """Start the background thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvtier-tier-monitor", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread and wait up to ``timeout`` seconds for a probe in progress to end."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
