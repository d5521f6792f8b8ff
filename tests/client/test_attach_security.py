"""Who may attach: the tenant's token (checked as gRPC checks it), the connecting process's uid
(``SO_PEERCRED``), the tenant's own pools only; and what the attach channel does with bad input.

Every refusal of a pool the caller may not see carries exactly the answer an absent pool gets
(NOT_FOUND, ``no pool '<id>'``), so attaching says nothing about other tenants' pools.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvtier.attach_wire import PROTOCOL_VERSION, SESSION_METADATA, recv_message, send_message
from kvtier.client import KVTierClient, NotFoundError, UnauthenticatedError
from kvtier.client.spawn import DaemonProcess

TOKEN_A = "tenant-a-secret-0123456789abcdef"
TOKEN_B = "tenant-b-secret-0123456789abcdef"
NOBODY = 65534
POOL_ARGS = ["--device", "cpu", "--log-level", "INFO", "--pool-memory", "128MiB"]


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attach-tenants")
    tokens = tmp / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = "team-a"\n"{TOKEN_B}" = "team-b"\n')
    os.chmod(tokens, 0o600)
    with DaemonProcess(extra_args=[*POOL_ARGS, "--auth-tokens", str(tokens)]) as d:
        for token in (TOKEN_A, TOKEN_B):
            with KVTierClient(d.address, token=token) as c:
                c.create_pool("glm-5.2", num_layers=2, size_tokens=256, pool_id="p")
        with KVTierClient(d.address, token=TOKEN_A) as c:
            c.create_pool("glm-5.2", num_layers=2, size_tokens=256, pool_id="only-a")
        yield d


def test_a_tenant_attaches_its_own_pool_and_another_tenants_is_not_found(tenants):
    with KVTierClient(tenants.address, token=TOKEN_B) as b:
        with pytest.raises(NotFoundError) as theirs:
            b.attach("only-a")
        with pytest.raises(NotFoundError) as absent:
            b.attach("no-such-pool")
        assert str(theirs.value) == str(absent.value).replace("no-such-pool", "only-a") == "NOT_FOUND: no pool 'only-a'"
        with KVTierClient(tenants.address, token=TOKEN_A) as a, a.attach("p") as pa, b.attach("p") as pb:
            assert pa.tenant == "team-a" and pb.tenant == "team-b"
            assert pa.pool.arena("latent").data_ptr() != pb.pool.arena("latent").data_ptr()
            sa = pa.allocate_slots(64)
            pa.kv_buffer[0][sa] = 3
            sb = pb.allocate_slots(64)
            assert int(pb.kv_buffer[0][sb].sum()) == 0  # two pools named p: two memories
            # a session id means nothing to another tenant, nor an id no session has
            with KVTierClient(tenants.address, token=TOKEN_B, metadata=[(SESSION_METADATA, pa.session_id)]) as forged:
                with pytest.raises(NotFoundError, match="attach session is unknown or has ended"):
                    forged.allocate_slots("p", 64)
            with KVTierClient(tenants.address, token=TOKEN_A, metadata=[(SESSION_METADATA, "0" * 32)]) as forged:
                with pytest.raises(NotFoundError, match="attach session is unknown or has ended"):
                    forged.describe_pool("p")


def test_without_a_known_token_attach_is_unauthenticated(tenants):
    """The attach channel checks tokens with the gRPC interceptor's code: the same answers."""
    path = tenants.address.removeprefix("unix://") + ".attach"
    for token, why in ((None, "no token"), ("not-a-token-but-long-enough", "unknown token")):
        reply = raw_request(path, {"kind": "attach", "version": PROTOCOL_VERSION, "token": token, "pool_id": "p"})
        assert reply["error"]["code"] == "UNAUTHENTICATED" and reply["error"]["message"].startswith(why)
        with KVTierClient(tenants.address, token=token) as c, pytest.raises(UnauthenticatedError, match=why):
            c.attach("p")  # (asks GetStats first, which the interceptor refuses the same way)


RAW_ATTACH = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.send(json.dumps({"kind": "attach", "version": 1, "token": None, "pool_id": "default"}).encode())
data, fds, _, _ = socket.recv_fds(s, 1 << 20, 16)
print(json.dumps({"reply": json.loads(data), "fds": len(fds)}))
"""


def run_as(uid: int, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a process of ``uid`` (a system python: its files are world-readable).

    setpriv sets the uid, not subprocess's ``user=``: with ``user=`` Python forks this process, whose
    gRPC fork handlers then run in the child before it execs (under load such a child once aborted in
    them: pthread_create EAGAIN, "Check failed: wakeup_fd_->Wakeup().ok()"); without it the child is
    a vfork that only execs."""
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
                           python, "-I", "-c", script, *args], capture_output=True, text=True, timeout=60)


def attach_as(uid: int, path: str) -> dict:
    """Attach request from a process running as ``uid``."""
    r = run_as(uid, RAW_ATTACH, path)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("allowed", [False, True])
def test_a_foreign_uid_is_refused_unless_the_tenant_names_it(tmp_path, request, allowed):
    """The test runs as root and starts the worker as ``nobody`` (the socket directory is opened up
    for it): the daemon answers by its uid. Refused, it gets an absent pool's answer and no memory;
    named in ``[tenants.default] attach_uids``, it gets the session and the arenas."""
    assert os.getuid() == 0, "this test starts a process as another user"
    sockdir = Path(tempfile.mkdtemp(prefix="kvtier-uid-"))  # under /tmp: pytest's own tmp dirs are private
    request.addfinalizer(lambda: shutil.rmtree(sockdir, ignore_errors=True))
    os.chmod(sockdir, 0o711)
    config = tmp_path / "kvtier.toml"
    config.write_text(f"[tenants.default]\nattach_uids = [{NOBODY}]\n" if allowed else "")
    args = [*POOL_ARGS, "--config", str(config), "--pool", "glm-5.2:256", "--pool-layers", "2"]
    with DaemonProcess(f"unix://{sockdir}/kv.sock", extra_args=args) as d:
        path = f"{sockdir}/kv.sock.attach"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        os.chmod(path, 0o666)  # reachable by nobody: now only the daemon's uid check stands in the way
        got = attach_as(NOBODY, path)
        if allowed:
            assert got["reply"]["pool_id"] == "default" and got["fds"] == 2
        else:
            assert got == {"reply": {"error": {"code": "NOT_FOUND", "message": "no pool 'default'"}}, "fds": 0}
        with KVTierClient(d.address) as c:  # the daemon's own uid may attach either way
            with c.attach("default") as ap:
                assert ap.pool_id == "default"
        if not allowed:
            assert "uid 65534 may not attach" in d.log_tail(50)


def raw_request(path: str, message: bytes | dict, fds: list[int] = ()) -> dict | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    data = message if isinstance(message, bytes) else json.dumps(message).encode()
    if fds:
        socket.send_fds(s, [data], fds)
    else:
        s.send(data)
    got = recv_message(s, accept_fds=True)
    rest = recv_message(s, accept_fds=True) if got is not None and "error" in got[0] else None
    s.close()
    assert rest is None  # after a refused first message the daemon closes the connection
    return None if got is None else got[0]


def test_bad_first_messages_are_refused_and_the_channel_keeps_serving(tmp_path):
    with DaemonProcess(extra_args=[*POOL_ARGS, "--pool", "glm-5.2:256", "--pool-layers", "2"]) as d:
        path = d.address.removeprefix("unix://") + ".attach"
        cases = [
            (b"not json", "INVALID_ARGUMENT"),
            (b"[1, 2]", "INVALID_ARGUMENT"),
            ({"kind": "staging", "nbytes": 4096}, "INVALID_ARGUMENT"),
            ({"kind": "attach", "version": 99, "pool_id": "default"}, "FAILED_PRECONDITION"),
            ({"kind": "attach", "version": 1, "pool_id": ""}, "INVALID_ARGUMENT"),
            ({"kind": "attach", "version": 1, "pool_id": "default", "token": 5}, "INVALID_ARGUMENT"),
            ({"kind": "attach", "version": 1, "pool_id": "x" * 200}, "INVALID_ARGUMENT"),
            ({"kind": "attach", "version": 1, "pool_id": "nope"}, "NOT_FOUND"),
        ]
        for message, code in cases:
            reply = raw_request(path, message)
            assert reply is not None and reply["error"]["code"] == code, (message, reply)
        r, w = os.pipe()
        try:  # descriptors sent to the daemon are never taken
            reply = raw_request(path, {"kind": "attach", "version": 1, "pool_id": "default"}, [r])
            assert reply["error"]["code"] == "INVALID_ARGUMENT"
        finally:
            os.close(r)
            os.close(w)
        with KVTierClient(d.address) as c, c.attach("default") as ap:
            assert ap.allocate_slots(64).numel() == 64
            assert c.stats().attach_sessions == 1
        assert "Traceback" not in d.log_tail(200)


def test_the_attach_socket_is_private_and_removed_at_exit(tmp_path):
    d = DaemonProcess(extra_args=[*POOL_ARGS])
    d.start()
    try:
        path = Path(d.address.removeprefix("unix://") + ".attach")
        assert stat.S_ISSOCK(os.stat(path).st_mode) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    finally:
        assert d.stop() == 0
    assert not path.exists()
    d.cleanup()
