"""Deadlines a user gives are finite and bounded (attack pass 4, A4-13): NaN, Infinity (JSON allows
both in SGLang's extra config) and 1e308 were accepted by the SGLang backend's settings, KVTierClient
and ``kvtier status --timeout``, and then every call failed at once with DEADLINE_EXCEEDED (the
backend silently turned into "always miss")."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier.client import KVTierClient


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e308, 0, -1])
def test_a_client_refuses_a_deadline_that_is_not_a_finite_day_or_less(bad):
    """(The SGLang backend's ``timeout_s``: tests/integrations/sglang/test_backend_rules.py.)"""
    with pytest.raises(ValueError, match="timeout must be > 0 and at most 86400 seconds"):
        KVTierClient("unix:///nonexistent/kv.sock", timeout=bad)
    KVTierClient("unix:///nonexistent/kv.sock", timeout=86400).close()


@pytest.mark.parametrize("bad", ["inf", "nan", "1e308"])
def test_the_cli_refuses_such_a_timeout_in_one_line(bad):
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "status", "--timeout", bad], capture_output=True, text=True,
                       timeout=60)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert lines[-1].startswith("Error: Invalid value for '--timeout'"), r.stderr


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e308])
def test_a_per_call_timeout_that_is_not_finite_is_refused_before_the_call(bad):
    """Attack pass 5, A5-4: a per-call ``timeout=`` of NaN, inf or 1e308 failed every call at once
    with DEADLINE_EXCEEDED; it is a ValueError before anything is sent."""
    with KVTierClient("unix:///nonexistent/kv.sock") as c, pytest.raises(ValueError, match="at most 86400 seconds"):
        c.list_pools(timeout=bad)


def test_a_client_message_limit_grpc_cannot_take_is_refused():
    """Attack pass 5, A5-4: ``max_message_bytes=5 << 30`` ended in gRPC's OverflowError."""
    with pytest.raises(ValueError, match="max_message_bytes must be 65536..2147483647"):
        KVTierClient("unix:///nonexistent/kv.sock", max_message_bytes=5 << 30)
