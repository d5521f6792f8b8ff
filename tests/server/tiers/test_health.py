"""TierHealth: unhealthy until a probe succeeds, probes spaced by a doubling backoff."""

from __future__ import annotations

import pytest

from kvtier.server.tiers import HostTier, HostTierConfig
from kvtier.server.tiers.health import TierHealth, health_service_name


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_backoff_doubles_up_to_the_maximum_and_resets_when_healthy():
    clock = Clock()
    h = TierHealth("disk", backoff_initial_s=1.0, backoff_max_s=4.0, clock=clock)
    assert h.healthy and not h.probe_due()
    assert h.mark_unhealthy("ENOSPC") is True
    assert not h.healthy and h.snapshot().reason == "ENOSPC"
    waits = []
    for _ in range(4):  # the first failure, then three failed probes: 1, 2, 4, 4 s
        waits.append(h.snapshot().next_probe_in_s)
        assert not h.probe_due()
        clock.t += waits[-1]
        assert h.probe_due()
        assert h.mark_unhealthy("still ENOSPC") is False
    assert waits == [1.0, 2.0, 4.0, 4.0]
    assert h.snapshot().failures == 5
    assert h.mark_healthy() is True and h.healthy
    snap = h.snapshot()
    assert (snap.reason, snap.failures, snap.next_probe_in_s, snap.since) == ("", 0, 0.0, clock.t)
    assert h.mark_healthy() is False


def test_service_names_and_bad_backoff():
    assert health_service_name("disk") == "kvtier.tier.disk"
    assert HostTier(HostTierConfig(capacity_bytes=1 << 20)).health.service_name == "kvtier.tier.host"
    with pytest.raises(ValueError):
        TierHealth("x", backoff_initial_s=0)
    with pytest.raises(ValueError):
        TierHealth("x", backoff_initial_s=2, backoff_max_s=1)
