"""The SGLang backend is client-side code: it reaches the daemon through ``kvtier.client`` only and
never imports the daemon (``kvtier.server``)."""

from __future__ import annotations

import subprocess
import sys


def test_backend_does_not_import_the_daemon():
    code = ("import sys, kvtier.integrations.sglang; "
            "bad = sorted(m for m in sys.modules if m.startswith('kvtier.server')); print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_a_timeout_that_is_not_a_finite_day_or_less_is_refused_at_start():
    """Attack pass 4, A4-13: ``timeout_s`` NaN, Infinity (json.loads accepts both) or 1e308 passed the
    settings check, and then every daemon call failed at once: the backend silently missed everything."""
    import json

    import pytest

    from kvtier.integrations.sglang.settings import BackendSettings

    for bad in ("NaN", "Infinity", "1e308", "0"):
        with pytest.raises(ValueError, match="timeout_s must be > 0 and at most 86400 seconds"):
            BackendSettings.from_extra_config(json.loads(f'{{"timeout_s": {bad}}}'))
    assert BackendSettings.from_extra_config({"timeout_s": 0.5}).timeout_s == 0.5
