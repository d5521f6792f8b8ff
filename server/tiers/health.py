"""Health of a tier: healthy, or unhealthy (with the reason) until a probe succeeds.

A tier that fails in a way that is not the caller's fault (ENOSPC or EIO under LMDB, a distributed
store whose master went away) is marked unhealthy and bypassed by the stack: its lookups are misses,
records that would go down to it are dropped and counted, and nothing is read from it. The daemon
probes it again with exponential backoff (``backoff_initial_s`` doubling up to ``backoff_max_s``);
the first probe that succeeds makes it healthy again.

Lock order: :class:`TierHealth` has one leaf lock. Nothing else is locked, called or logged while it
is held, so any component may update a tier's health while holding its own locks, and monitoring
reads (:attr:`TierHealth.healthy`, :meth:`TierHealth.snapshot`) never wait for the data path.
Listeners (:meth:`TierHealth.add_listener`) are called after the lock is released, on the thread
that changed the state, possibly inside the caller's data-path locks: they must only wake someone
(e.g. set a ``threading.Event``), never block or take a lock of the daemon.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

HEALTH_SERVICE_PREFIX = "kvtier.tier."


def health_service_name(tier: str) -> str:
    """The gRPC health service name of a tier: ``kvtier.tier.<tier>`` (e.g. ``kvtier.tier.disk``)."""
    return HEALTH_SERVICE_PREFIX + tier


@dataclass(frozen=True)
class HealthSnapshot:
    """A tier's health at one moment.

    Attributes:
        tier: the tier's name.
        healthy: False while the tier is bypassed.
        reason: why it is unhealthy ("" when healthy).
        since: ``time.monotonic()`` of the last change of state.
        failures: consecutive failures (the first one plus failed probes) since it was last healthy.
        next_probe_in_s: seconds until the next probe is due (0 when healthy or due now).
    """

    tier: str
    healthy: bool
    reason: str
    since: float
    failures: int
    next_probe_in_s: float

    @property
    def service_name(self) -> str:
        """``kvtier.tier.<tier>``."""
        return health_service_name(self.tier)


class TierHealth:
    """Health state of one tier, thread-safe.

    Args:
        tier: the tier's name (``host``, ``disk``, ``mooncake``).
        backoff_initial_s: seconds from the first failure to the first probe.
        backoff_max_s: the longest wait between two probes.
        clock: a monotonic clock in seconds (tests pass their own).

    Raises:
        ValueError: a non-positive backoff, or a maximum below the initial backoff.
    """

    def __init__(self, tier: str, *, backoff_initial_s: float = 1.0, backoff_max_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise ValueError(f"backoff must satisfy 0 < initial <= max, got {backoff_initial_s}, {backoff_max_s}")
        self.tier = tier
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._clock = clock
        self._lock = threading.Lock()  # leaf lock: nothing is called while it is held
        self._healthy = True
        self._reason = ""
        self._since = clock()
        self._failures = 0
        self._next_probe = 0.0
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every change of state (see the module docstring: it must not block)."""
        self._listeners.append(listener)

    def _notify(self) -> None:
        for listener in list(self._listeners):
            listener()

    @property
    def healthy(self) -> bool:
        """Whether the tier serves (a plain read; never waits)."""
        return self._healthy

    @property
    def service_name(self) -> str:
        """``kvtier.tier.<tier>``."""
        return health_service_name(self.tier)

    def _backoff(self, failures: int) -> float:
        return min(self.backoff_initial_s * 2 ** max(failures - 1, 0), self.backoff_max_s)

    def mark_unhealthy(self, reason: str) -> bool:
        """Record a failure; the tier is bypassed until a probe succeeds.

        Returns:
            True if the tier was healthy until now (the caller may log or count the change).
        """
        now = self._clock()
        with self._lock:
            changed = self._healthy
            self._failures += 1
            self._reason = reason
            if changed:
                self._healthy = False
                self._since = now
            self._next_probe = now + self._backoff(self._failures)
        if changed:
            log.warning("%s tier is unhealthy and bypassed: %s", self.tier, reason)
            self._notify()
        return changed

    def mark_healthy(self) -> bool:
        """The tier serves again (a probe succeeded). Returns True if it was unhealthy until now."""
        now = self._clock()
        with self._lock:
            changed = not self._healthy
            self._healthy, self._reason, self._failures, self._next_probe = True, "", 0, 0.0
            if changed:
                self._since = now
        if changed:
            log.warning("%s tier is healthy again", self.tier)
            self._notify()
        return changed

    def probe_due(self) -> bool:
        """True when the tier is unhealthy and its backoff has passed."""
        with self._lock:
            return not self._healthy and self._clock() >= self._next_probe

    def snapshot(self) -> HealthSnapshot:
        """The current state (a copy)."""
        now = self._clock()
        with self._lock:
            wait = 0.0 if self._healthy else max(self._next_probe - now, 0.0)
            return HealthSnapshot(self.tier, self._healthy, self._reason, self._since, self._failures, wait)
