"""Module rules: the tiers and the replay core never import grpc or the service layer."""

from __future__ import annotations

import subprocess
import sys


def test_tiers_and_replay_core_do_not_import_grpc():
    code = ("import sys, kvtier.server.tiers, kvtier.server.replay.driver, kvtier.server.replay.belady; "
            "bad = sorted(m for m in sys.modules if m == 'grpc' or m.startswith(('grpc.', 'kvtier.server.service', 'kvtier.v1'))); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
