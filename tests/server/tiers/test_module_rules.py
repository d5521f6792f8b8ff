"""Module rules: the tiers, the replay core and the daemon's domain never import grpc or the service layer."""

from __future__ import annotations

import subprocess
import sys


def test_tiers_and_replay_core_do_not_import_grpc():
    code = ("import sys, kvtier.server.tiers, kvtier.server.replay.driver, kvtier.server.replay.belady; "
            "bad = sorted(m for m in sys.modules if m == 'grpc' or m.startswith(('grpc.', 'kvtier.server.service', 'kvtier.v1'))); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_daemon_domain_does_not_import_grpc():
    """Every module of ``kvtier.server.daemon`` imports without grpc, ``kvtier.v1`` or the service layer."""
    code = ("import sys, pkgutil, importlib, kvtier.server.daemon as d; "
            "[importlib.import_module(f'kvtier.server.daemon.{m.name}') for m in pkgutil.iter_modules(d.__path__)]; "
            "bad = sorted(m for m in sys.modules if m == 'grpc' or m.startswith(('grpc.', 'kvtier.server.service', 'kvtier.v1'))); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
