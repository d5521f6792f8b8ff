"""Module rules: host memory never imports grpc, the wire contract, the pools or the service layer."""

from __future__ import annotations

import subprocess
import sys


def test_hostmem_imports_nothing_above_it():
    code = ("import sys, kvtier.server.hostmem; "
            "bad = sorted(m for m in sys.modules if m == 'grpc' or m.startswith(('grpc.', 'kvtier.server.service', "
            "'kvtier.v1', 'kvtier.server.pool', 'kvtier.server.tiers'))); print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
