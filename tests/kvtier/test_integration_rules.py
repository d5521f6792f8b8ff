"""Plain kvtier never imports SGLang: the package, the client, the daemon and the CLI load without it
(``kvtier.integrations.sglang`` is imported only by SGLang's dynamic loader)."""

from __future__ import annotations

import subprocess
import sys


def test_kvtier_never_imports_sglang():
    code = ("import sys, kvtier, kvtier.client, kvtier.cli, kvtier.integrations, kvtier.server.service.server; "
            "bad = sorted(m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')); print(bad); "
            "sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
