"""A daemon thread that probes unhealthy tiers with their backoff and reports health changes.

Every ``interval_s`` it calls :meth:`TierStack.probe_due` (an unhealthy tier whose backoff passed is
probed; a success makes it healthy again), then hands each tier whose health differs from what it
last reported to ``on_change(service_name, healthy)`` (e.g. the gRPC health service's ``set``), so
a tier that failed on the data path shows up as NOT_SERVING within one interval, and comes back by
itself once its probe succeeds.

Lock order: it takes no lock of its own while calling probes or ``on_change``; the probes take the
tiers' own locks (and make store calls) like any data-path call, never a pool or cache lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvtier.server.tiers.stack import TierStack

log = logging.getLogger(__name__)

HealthCallback = Callable[[str, bool], None]


class TierMonitor:
    """Probes and reports the health of a stack's tiers.

    Args:
        stack: the tiers to watch.
        interval_s: seconds between two rounds.
    """

    def __init__(self, stack: TierStack, *, interval_s: float = 0.5) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        self.stack = stack
        self.interval_s = interval_s
        self._callbacks: list[HealthCallback] = []
        self._reported: dict[str, bool] = {}
        self._cb_lock = threading.Lock()  # leaf: guards the callbacks and what was reported
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, on_change: HealthCallback) -> None:
        """Call ``on_change(service_name, healthy)`` now for every tier, and on every later change."""
        now = {t.health.service_name: t.health.healthy for t in self.stack.tiers}
        with self._cb_lock:
            self._callbacks.append(on_change)
            self._reported.update(now)
        for name, ok in now.items():
            on_change(name, ok)

    def run_once(self) -> dict[str, bool]:
        """One round: probe due tiers, report changes. Returns ``{service name: healthy}`` reported."""
        self.stack.probe_due()
        now = {t.health.service_name: t.health.healthy for t in self.stack.tiers}
        with self._cb_lock:
            changed = {name: ok for name, ok in now.items() if self._reported.get(name) != ok}
            self._reported.update(changed)
            callbacks = list(self._callbacks)
        if changed:
            for name, ok in changed.items():
                for cb in callbacks:
                    try:
                        cb(name, ok)
                    except Exception:  # noqa: BLE001 - a broken observer must not stop the probes
                        log.exception("tier health callback failed for %s", name)
        return changed

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvtier-tier-monitor", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except Exception:  # noqa: BLE001 - keep watching
                log.exception("tier monitor round failed")

    def stop(self) -> None:
        """Stop the thread and wait for its round to end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
