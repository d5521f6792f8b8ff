"""``caller_waits``: the check a state-changing call makes before it changes anything (attack pass 7, A7-5)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.server.service.errors import caller_waits


@pytest.mark.parametrize(("active", "remaining", "wanted"), [
    (True, None, True),     # no deadline
    (True, 0.5, True),
    (True, 0, False),       # past its deadline, not yet cancelled by gRPC: is_active() still said True
    (True, -0.001, False),
    (False, 0.5, False),    # cancelled
])
def test_a_caller_past_its_deadline_is_gone_though_is_active_lags(active, remaining, wanted):
    """Measured on a daemon: CreatePool calls with a 1-30 ms deadline saw ``is_active()`` True with
    ``time_remaining()`` 0 and made their pools, though their callers were told DEADLINE_EXCEEDED
    (1 to 3 of 3-5 such calls in 60 rounds of /tmp/attack7/late_create3.py; 0 with this check)."""
    ctx = SimpleNamespace(is_active=lambda: active, time_remaining=lambda: remaining)
    assert caller_waits(ctx)() is wanted
