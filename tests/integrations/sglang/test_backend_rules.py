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
