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


def test_byte_settings_grpc_or_the_client_cannot_take_are_refused_at_start():
    """Attack pass 5, A5-4: max_message_bytes 5 GiB, chunk_bytes 1 TiB or 1, chunk_bytes above the
    message limit and staging_bytes 2**62 passed the settings and failed later inside the client
    (gRPC's OverflowError, or a ValueError without the backend's name)."""
    import pytest

    from kvtier.integrations.sglang.settings import BackendSettings

    for extra, words in (({"max_message_bytes": 5 << 30}, "max_message_bytes must be 65536..2147483647"),
                         ({"chunk_bytes": 1 << 40}, "chunk_bytes must be 4096..max_message_bytes - 1024"),
                         ({"chunk_bytes": 1}, "chunk_bytes must be 4096"),
                         ({"staging_bytes": 1 << 62}, "staging_bytes must be at most 1 TiB"),
                         ({"timeout_s": 1e-300}, "timeout_s must be at least 0.001 seconds")):
        with pytest.raises(ValueError, match=f"kvtier backend: {words}"):
            BackendSettings.from_extra_config(extra)
    BackendSettings.from_extra_config({})  # the defaults pass
