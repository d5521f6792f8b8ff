"""Client rules: it never imports the server; only idempotent calls are retried, only on UNAVAILABLE
or a CANCELLED the client did not ask for."""

from __future__ import annotations

import subprocess
import sys
import threading

import grpc
import pytest

from kvtier.client import KVTierClient, UnavailableError
from kvtier.client.spawn import DaemonProcess


def test_client_does_not_import_server():
    code = ("import sys, kvtier.client, kvtier.client.spawn; "
            "bad = sorted(m for m in sys.modules if m.startswith('kvtier.server')); print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_change_is_not_retried_read_is(tmp_path):
    """With no daemon yet, allocate_slots fails at once with UNAVAILABLE; describe_pool retries until
    the daemon, started meanwhile, answers."""
    d = DaemonProcess(f"unix://{tmp_path}/late.sock", extra_args=["--device", "cpu", "--pool", "glm-5.2:128", "--pool-layers", "2"])
    try:
        with KVTierClient(d.listen, timeout=60, retries=12) as c:
            with pytest.raises(UnavailableError):
                c.allocate_slots("default", 1)
            starter = threading.Thread(target=d.start)
            starter.start()
            info = c.describe_pool("default")  # fails while the daemon starts, retried with backoff
            starter.join(60)
            assert info.size_tokens == 128
    finally:
        d.stop()
        d.cleanup()


class _Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "CANCELLED"


def test_a_cancelled_the_client_did_not_ask_for_is_retried_for_an_idempotent_call(tmp_path):
    """CI failure: on a loaded machine the daemon cancelled a health check whose message reached its
    thread late (it cancels such calls before reading them), and the soak's monitor saw CANCELLED.
    An idempotent call cancelled so is sent again (within its deadline and ``retries``); a write is
    not; after ``close`` (which cancels calls in flight) nothing is retried."""
    from kvtier.client import CancelledError

    c = KVTierClient(f"unix://{tmp_path}/none.sock", timeout=10, retries=2)
    attempts: list[float] = []

    def cancelled_once(left: float) -> str:
        attempts.append(left)
        if len(attempts) == 1:
            raise _Refused(grpc.StatusCode.CANCELLED)
        return "answer"
    assert c._run(cancelled_once, idempotent=True, timeout=10) == "answer" and len(attempts) == 2
    attempts.clear()
    with pytest.raises(CancelledError):
        c._run(cancelled_once, idempotent=False, timeout=10)
    assert len(attempts) == 1

    def always(left: float) -> str:
        attempts.append(left)
        raise _Refused(grpc.StatusCode.CANCELLED)
    attempts.clear()
    with pytest.raises(CancelledError):
        c._run(always, idempotent=True, timeout=10)
    assert len(attempts) == 3  # the first and 2 retries
    c.close()
    attempts.clear()
    with pytest.raises(CancelledError):
        c._run(cancelled_once, idempotent=True, timeout=10)
    assert len(attempts) == 1


def test_attach_imports_only_the_pool_core_of_the_server(tmp_path):
    """The client imports nothing of ``kvtier.server`` until it attaches, and then only the grpc-free
    pool core (``kvtier.server.pool``, ``kvtier.server.model_config`` and its presets, and the host
    memory the pool copies into, ``kvtier.server.hostmem``)."""
    code = f"""
import sys
from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess
with DaemonProcess(extra_args=["--device", "cpu", "--pool", "glm-5.2:128", "--pool-layers", "2"]) as d:
    assert not [m for m in sys.modules if m.startswith("kvtier.server")]
    with KVTierClient(d.address) as c, c.attach("default") as ap:
        ap.allocate_slots(1)
allowed = ("kvtier.server.pool", "kvtier.server.model_config", "kvtier.server.presets", "kvtier.server.hostmem")
bad = sorted(m for m in sys.modules if m.startswith("kvtier.server") and m != "kvtier.server"
             and not m.startswith(allowed))
print(bad)
sys.exit(1 if bad else 0)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_status_the_daemon_answers_has_its_error_class():
    """Each status code the daemon's one mapping can answer (server/service/errors.py) comes back as
    its own KVTierError subclass on the client, with that code: none is left as a bare KVTierError."""
    import grpc

    from kvtier.client import errors
    from kvtier.server.service.errors import STATUS_CODES

    class Failed(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

        def details(self):
            return "what went wrong"

    for _, code in STATUS_CODES:
        err = errors.from_rpc_error(Failed(code))
        assert type(err) is not errors.KVTierError and err.code == code, code


@pytest.mark.parametrize("bad, position, code", [
    ("tok-en\n", 7, 10), ("a" * 20 + "\x7f", 21, 127), ("t\u00f6ken-123456789012", 2, 246), ("two words here 1234", 4, 32)])
def test_a_token_a_header_cannot_carry_is_refused_before_any_call(monkeypatch, bad, position, code):
    """Attack pass 3, N9: a malformed token (argument or $KVTIER_TOKEN) was sent, and every call failed
    with INTERNAL "Invalid metadata". Now the client refuses it at once, naming where it came from and
    the first bad character, never the token itself."""
    with pytest.raises(ValueError) as e:
        KVTierClient("unix:///nonexistent/kv.sock", token=bad)
    msg = str(e.value)
    assert msg.startswith("token holds") and f"character #{position}, code {code}" in msg and bad not in msg
    monkeypatch.setenv("KVTIER_TOKEN", bad)
    with pytest.raises(ValueError, match=r"^\$KVTIER_TOKEN holds a character a gRPC header cannot carry"):
        KVTierClient("unix:///nonexistent/kv.sock")
    monkeypatch.setenv("KVTIER_TOKEN", "x" * 43)  # a good token still works
    KVTierClient("unix:///nonexistent/kv.sock").close()


def test_close_returns_though_grpcs_close_never_does(tmp_path, caplog):
    """Seen in the suite on a machine out of threads: a call whose gRPC thread could not start
    ("can't start new thread") never ends, and gRPC's channel close waits for every call, so the
    client's close (a fixture's teardown) waited forever. It now returns after ``close_wait_s`` with
    a WARNING, the channel's close going on in the background."""
    import time

    c = KVTierClient(f"unix://{tmp_path}/none.sock", timeout=10)
    real = c._raw_channel
    stuck = threading.Event()

    class NeverCloses:
        def close(self) -> None:
            stuck.wait(60)

    c._raw_channel = NeverCloses()
    c.close_wait_s = 0.3
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="kvtier.client"):
        c.close()
    assert time.monotonic() - t0 < 5
    assert "took more than 0.3 s" in caplog.text
    stuck.set()
    real.close()
