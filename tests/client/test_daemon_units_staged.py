"""The unit store through shared memory against a real daemon: a storage session's staging buffers
carry the page bytes, gRPC only keys and offsets.

Same geometry as ``test_daemon_units.py`` (GLM-5.2 layers 20-27, fp8, live indexer layers 22 and 26).
Expected bytes are the seeded random units written into the buffer; the daemon's own counters say
how the bytes travelled (``put_bytes_stream`` / ``put_bytes_staged`` ...).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest
import torch
from test_attach_security import run_as
from test_daemon_units import SPACE, TOKEN_A, TOKEN_B, unit_bytes

from kvtier.client import (
    FailedPreconditionError, InvalidArgumentError, KVTierClient, NotFoundError, ResourceExhaustedError,
)
from kvtier.attach_wire import recv_message
from kvtier.client.spawn import DaemonProcess

N = SPACE.part_nbytes("both")
SESSION_END_BOUND_S = 2.0  # README "Local attach": the daemon ends a closed connection's session within this
MARGIN_S = 3.0  # on top of the bound: a loaded machine (as in test_attach_channel_limits.py)


@pytest.fixture
def daemon(tmp_path):
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = "team-a"\n"{TOKEN_B}" = "team-b"\n')
    os.chmod(tokens, 0o600)
    args = ["--device", "cpu", "--auth-tokens", str(tokens), "--host-memory", "16MiB", "--disk-path",
            str(tmp_path / "disk"), "--disk-size", "64MiB"]
    with DaemonProcess(f"unix://{tmp_path}/kv.sock", extra_args=args) as d:
        yield d


def client(d, token=TOKEN_A):
    return KVTierClient(d.address, token=token, timeout=60)


def test_staged_parts_apart_become_one_unit_and_no_page_byte_crosses_grpc(daemon):
    keys = [b"s0", b"s1", b"s2"]
    with client(daemon) as c, c.storage_session() as s:
        assert s.tenant == "team-a" and s.staging_max_bytes > 0
        buf = s.buffer(3 * N)
        t = buf.tensor
        t[:3 * SPACE.index_nbytes].copy_(torch.cat([unit_bytes(i, "index") for i in range(3)]))
        r = s.client.put_units_staged(SPACE, keys, "index", buf.index)
        assert r.accepted == [True] * 3 and r.completed == 0 and r.pending == 3
        assert c.exist_units(SPACE, keys) == 0                       # indexer alone: invisible
        off = 4096
        t[off:off + 2 * SPACE.kv_nbytes].copy_(torch.cat([unit_bytes(i, "kv") for i in range(2)]))
        r = s.client.put_units_staged(SPACE, keys[:2], "kv", buf.index, off)
        assert r.completed == 2 and c.exist_units(SPACE, keys) == 2
        t.zero_()
        assert s.client.get_units_staged(SPACE, keys, "both", buf.index) == [True, True, False]
        for i in range(2):
            assert torch.equal(t[i * N:(i + 1) * N], unit_bytes(i))
        assert int(t[2 * N:3 * N].count_nonzero()) == 0                # a miss leaves its bytes as they were
        out = torch.zeros(2 * N, dtype=torch.uint8)                  # the gRPC stream reads the same units
        assert c.get_units(SPACE, keys[:2], "both", out) == [True, True]
        assert torch.equal(out, torch.cat([unit_bytes(0), unit_bytes(1)]))
        st = c.unit_stats()
    assert st.get("put_bytes_stream", 0) == 0                        # not one page byte came in over gRPC
    assert st["put_bytes_staged"] == 3 * SPACE.index_nbytes + 2 * SPACE.kv_nbytes
    assert st["get_bytes_staged"] == 2 * N and st["get_bytes_stream"] == 2 * N


def test_another_tenant_never_sees_staged_units_nor_uses_the_session(daemon):
    with client(daemon) as a, a.storage_session() as s:
        buf = s.buffer(N)
        buf.tensor.copy_(unit_bytes(7))
        assert s.client.put_units_staged(SPACE, [b"t0"], "both", buf.index).completed == 1
        with client(daemon, TOKEN_B) as b, b.storage_session() as sb:
            bb = sb.buffer(N)
            assert b.exist_units(SPACE, [b"t0"]) == 0
            assert sb.client.get_units_staged(SPACE, [b"t0"], "both", bb.index) == [False]
            assert int(bb.tensor.count_nonzero()) == 0
            # tenant B's token with tenant A's session id: an unknown session (NOT_FOUND), nothing read
            with KVTierClient(daemon.address, token=TOKEN_B, metadata=[("x-kvtier-session", s.session_id)]) as mixed:
                with pytest.raises(NotFoundError):
                    mixed.get_units_staged(SPACE, [b"t0"], "both", 0)
        assert s.client.get_units_staged(SPACE, [b"t0"], "both", buf.index) == [True]


def test_bad_staged_calls_are_refused_and_store_nothing(daemon):
    with client(daemon) as c:
        with pytest.raises(FailedPreconditionError, match="attach session"):   # not in a session
            c.put_units_staged(SPACE, [b"b0"], "both", 0)
        with c.storage_session() as s:
            buf = s.buffer(N)
            buf.tensor.copy_(unit_bytes(3))
            with pytest.raises(InvalidArgumentError, match="no buffer 1"):
                s.client.put_units_staged(SPACE, [b"b0"], "both", 1)
            with pytest.raises(InvalidArgumentError, match="do not lie"):
                s.client.put_units_staged(SPACE, [b"b0"], "both", buf.index, 1)      # one byte past the end
            with pytest.raises(InvalidArgumentError, match="do not lie"):
                s.client.get_units_staged(SPACE, [b"b0", b"b1"], "both", buf.index)
            with pytest.raises(InvalidArgumentError, match="do not lie"):
                s.client.put_units_staged(SPACE, [b"b0"], "both", buf.index, 2**64 - 1)
            with pytest.raises(InvalidArgumentError):
                s.client.put_units_staged(SPACE, [b""], "both", buf.index)
            with pytest.raises(InvalidArgumentError, match="repeat"):
                s.client.put_units_staged(SPACE, [b"b0", b"b0"], "kv", buf.index)
            assert c.exist_units(SPACE, [b"b0"]) == 0 and c.unit_stats().get("units_stored", 0) == 0
            assert c.unit_stats()["parts_pending"] == 0
            with pytest.raises(ResourceExhaustedError):
                s.buffer(s.staging_max_bytes)                          # past the session's budget
            sid = s.session_id
        # the session ends with its connection: the daemon's channel thread sees the close and ends it
        # (asynchronously, within the README's bound), then a call naming it is NOT_FOUND
        deadline = time.monotonic() + SESSION_END_BOUND_S + MARGIN_S
        with KVTierClient(daemon.address, token=TOKEN_A, metadata=[("x-kvtier-session", sid)]) as stale:
            while True:
                try:
                    stale.get_units_staged(SPACE, [b"b0"], "both", 0)
                except NotFoundError:
                    break
                assert time.monotonic() < deadline, "the session did not end with its connection"
                time.sleep(0.02)


def test_a_tcp_client_cannot_open_a_storage_session(tmp_path):
    with DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=["--device", "cpu", "--host-memory", "8MiB"]) as d:
        with KVTierClient(d.address) as c, pytest.raises(FailedPreconditionError, match="unix socket"):
            c.storage_session()


def storage_request(path: str, message: dict) -> dict:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    s.send(json.dumps(message).encode())
    got = recv_message(s, accept_fds=True)
    s.close()
    assert got is not None
    return got[0]


def test_storage_handshakes_check_version_and_token(daemon):
    path = daemon.address.removeprefix("unix://") + ".attach"
    cases = [({"kind": "storage", "version": 99, "token": TOKEN_A}, "FAILED_PRECONDITION"),
             ({"kind": "storage", "version": 1, "token": 5}, "INVALID_ARGUMENT"),
             ({"kind": "storage", "version": 1, "token": None}, "UNAUTHENTICATED"),
             ({"kind": "storage", "version": 1, "token": "not-a-token-but-long-enough"}, "UNAUTHENTICATED"),
             ({"kind": "stage", "version": 1, "token": TOKEN_A}, "INVALID_ARGUMENT")]
    for message, code in cases:
        assert storage_request(path, message)["error"]["code"] == code, message
    reply = storage_request(path, {"kind": "storage", "version": 1, "token": TOKEN_A})
    assert reply["tenant"] == "team-a" and len(reply["session_id"]) == 32


RAW_STORAGE = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
out = []
for msg in ({"kind": "storage", "version": 1, "token": None}, {"kind": "staging", "nbytes": 4096}):
    s.send(json.dumps(msg).encode())   # the next request only after an answer: a refused one closes the connection
    data, fds, _, _ = socket.recv_fds(s, 1 << 20, 16)
    out.append({"reply": json.loads(data) if data else None, "fds": len(fds)})
    if not data or "error" in json.loads(data):
        break
print(json.dumps(out))
"""


@pytest.mark.parametrize("allowed", [False, True])
def test_a_foreign_uid_gets_no_storage_session_unless_the_tenant_names_it(tmp_path, request, allowed):
    """As for attach: a process of another uid (``nobody``, started by the root test) is refused,
    and gets no staging buffer, unless ``[tenants.default] attach_uids`` names it."""
    assert os.getuid() == 0, "this test starts a process as another user"
    sockdir = Path(tempfile.mkdtemp(prefix="kvtier-uid-"))
    request.addfinalizer(lambda: shutil.rmtree(sockdir, ignore_errors=True))
    os.chmod(sockdir, 0o711)
    config = tmp_path / "kvtier.toml"
    config.write_text("[tenants.default]\nattach_uids = [65534]\n" if allowed else "")
    with DaemonProcess(f"unix://{sockdir}/kv.sock", extra_args=["--device", "cpu", "--config", str(config)]) as d:
        os.chmod(f"{sockdir}/kv.sock.attach", 0o666)
        r = run_as(65534, RAW_STORAGE, f"{sockdir}/kv.sock.attach")
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        if allowed:
            assert got[0]["reply"]["tenant"] == "default" and got[1] == {"reply": {"staging": {"index": 0, "nbytes": 4096}},
                                                                        "fds": 1}
        else:
            assert got[0]["reply"]["error"]["code"] == "NOT_FOUND" and got[0]["fds"] == 0 and len(got) == 1
            assert "uid 65534 may not attach" in d.log_tail(50)
