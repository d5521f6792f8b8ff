"""A client's bearer token never goes to a unix socket another local user could have put there.

Regressions (class "token to a socket another user controls"):

* a missing ``$XDG_RUNTIME_DIR`` was made with the umask's mode (0777 under umask 000): another uid
  renamed the private ``kvtier/`` directory away and bound its own socket in its place;
* an explicit ``--listen unix:///DIR/kv.sock`` in a 0777 directory was accepted: another uid renamed
  the socket away and bound its own;
* with no daemon running, another uid made ``$TMPDIR/kvtier-0/`` with its own socket: root's client
  sent its token there (it never looked at who owned the directory or the socket).

Now the daemon makes every directory on the way 0700, and daemon and client both refuse a socket whose
way another uid could change (``kvtier.addresses.check_socket_path``). The tests run as root and play
the other user as ``nobody`` (setpriv, as tests/client/test_attach_security.py does), in 0755 or
sticky 1777 directories under /tmp (pytest's own temp root is 0700 and would hide the defects).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.client import KVTierClient
from kvtier.client.attach import open_channel
from kvtier.client.errors import FailedPreconditionError
from kvtier.client.spawn import DaemonProcess

NOBODY = 65534
TOKEN = "S3cret-team-a-token-0123456789"
POOL_ARGS = ["--device", "cpu", "--pool", "glm-5.2:64", "--pool-layers", "2", "--host-memory", "16MiB"]
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

# Run as nobody: make DIR (if given) and bind a stream socket at PATH, listen, say "ready", wait for
# stdin to close, then report whether a connection is waiting in the backlog (never accepted, so the
# answer does not depend on timing: a client's connect would have queued there).
_SQUAT = """
import os, socket, sys, json
d, path, kind = sys.argv[1], sys.argv[2], sys.argv[3]
if d:
    os.mkdir(d, 0o755)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET if kind == "seqpacket" else socket.SOCK_STREAM)
s.bind(path); os.chmod(path, 0o777); s.listen(8); s.setblocking(False)
print("ready", flush=True)
sys.stdin.read()
try:
    c, _ = s.accept(); c.setblocking(True); c.settimeout(5)
    got = c.recv(65536)
    print(json.dumps({"connected": True, "token_seen": b"S3cret" in got}))
except BlockingIOError:
    print(json.dumps({"connected": False, "token_seen": False}))
"""

_RENAME = """
import os, sys, json
try:
    os.rename(sys.argv[1], sys.argv[2]); print(json.dumps(0))
except OSError as e:
    print(json.dumps(e.errno))
"""


def as_nobody(script: str, *args: str, **kw) -> subprocess.Popen[str] | subprocess.CompletedProcess[str]:
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--", PYTHON, "-I", "-c", script, *args]
    if kw.pop("background", False):
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.fixture()
def parent(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A directory under /tmp, mode 0755 (param "open") or 1777 (param "sticky", like /tmp itself)."""
    assert os.getuid() == 0, "these tests start a process as another user"
    p = Path(tempfile.mkdtemp(prefix="kvtier-sock-"))
    os.chmod(p, 0o1777 if getattr(request, "param", "open") == "sticky" else 0o755)
    yield p
    shutil.rmtree(p, ignore_errors=True)


class Squatter:
    """A socket of uid nobody at ``path`` (in a new directory ``made`` of nobody's, if given)."""

    def __init__(self, path: Path, made: Path | None = None, kind: str = "stream") -> None:
        self.proc = as_nobody(_SQUAT, str(made or ""), str(path), kind, background=True)
        assert self.proc.stdout.readline().strip() == "ready", self.proc.stderr.read()

    def result(self) -> dict:
        """What the squatter saw, once its stdin is closed."""
        out = self.proc.stdout.read()
        assert self.proc.wait(timeout=60) == 0, self.proc.stderr.read()
        return json.loads(out)


# ----- a missing $XDG_RUNTIME_DIR ------------------------------------------------------------------
def test_a_missing_runtime_dir_is_made_0700_whatever_the_umask(parent):
    """Under umask 000 the daemon makes the missing $XDG_RUNTIME_DIR (and its kvtier/) 0700: nobody
    cannot rename the private directory away (EACCES), so it cannot put its own socket there."""
    runtime = parent / "run" / "user"
    sock = runtime / "kvtier" / "kvtier.sock"  # the default address under this $XDG_RUNTIME_DIR
    old = os.umask(0)
    try:
        with DaemonProcess(f"unix://{sock}", extra_args=POOL_ARGS, env={"XDG_RUNTIME_DIR": str(runtime)}) as d:
            with KVTierClient(d.address, token=TOKEN) as c:
                assert c.health() == "SERVING"
    finally:
        os.umask(old)
    for p in (parent / "run", runtime, runtime / "kvtier"):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700, p
    assert json.loads(as_nobody(_RENAME, str(runtime / "kvtier"), str(runtime / "moved")).stdout) == 13  # EACCES


# ----- an explicit --listen in a directory others can write ---------------------------------------
def serve(listen: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--listen", listen, *POOL_ARGS],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_listen_in_a_directory_others_can_write_is_refused(parent, mode):
    """``--listen unix:///DIR/kv.sock`` with DIR writable by group or others (no sticky bit): one line
    naming the directory and what to do; nothing is bound there."""
    d = parent / "pub"
    d.mkdir()
    os.chmod(d, mode)
    r = serve(f"unix://{d}/kv.sock")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert f"directory {d} (mode {mode:04o}) is writable by group or others" in lines[0] and "chmod go-w" in lines[0]
    assert not (d / "kv.sock").exists()


def test_listen_in_a_directory_of_another_user_is_refused(parent):
    """A socket directory owned by nobody (mode 0755: only nobody writes it) is refused too."""
    d = parent / "theirs"
    d.mkdir()
    os.chmod(d, 0o755)
    os.chown(d, NOBODY, NOBODY)
    r = serve(f"unix://{d}/kv.sock")
    assert r.returncode == 1 and f"directory {d} is owned by uid {NOBODY}" in r.stderr, r.stderr
    assert not (d / "kv.sock").exists()


@pytest.mark.parametrize("parent", ["sticky"], indirect=True)
def test_listen_in_a_sticky_directory_is_refused_and_a_private_one_under_it_serves(parent):
    """Attack pass 6, A6-11 (and A6-9 for PD peers): a sticky world-writable directory (like /tmp)
    was accepted, since nobody may rename or remove the daemon's socket there. But while no socket is
    there (the daemon down, or between its unlink and bind at a restart) nobody may make one, and a
    client's background reconnect reaches it: no check before a call sees that. So the directory
    holding a socket must be writable by nobody else, sticky or not; a 0700 directory under /tmp is
    fine (the way to it may be sticky)."""
    r = serve(f"unix://{parent}/kv.sock")
    assert r.returncode == 1 and f"directory {parent} (mode 1777) is writable by group or others" in r.stderr, r.stderr
    mine = parent / "mine"
    mine.mkdir(mode=0o700)
    with DaemonProcess(f"unix://{mine}/kv.sock", extra_args=POOL_ARGS) as d:
        with KVTierClient(d.address, token=TOKEN) as c:
            assert c.health() == "SERVING"


# ----- the client: a socket another user made -------------------------------------------------------
@pytest.mark.parametrize("parent", ["sticky"], indirect=True)
@pytest.mark.parametrize("where", ["default-dir", "socket", "attach"])
def test_the_client_sends_nothing_to_a_socket_another_user_made(parent, where):
    """No daemon runs. nobody makes $TMPDIR/kvtier-0/ with its socket (the default address), or binds
    a socket in a sticky directory (an explicit address, or the attach channel's path): root's client
    refuses before connecting, naming the path and its owner, and the squatter sees no connection."""
    if where == "default-dir":
        made = parent / f"kvtier-{os.getuid()}"
        path, squat = made / "kvtier.sock", Squatter(made / "kvtier.sock", made=made)
    else:
        made, path = None, parent / "kv.sock"
        squat = Squatter(path, kind="seqpacket" if where == "attach" else "stream")  # attach: as the daemon's
    try:
        if where == "attach":
            with pytest.raises(FailedPreconditionError) as e:
                open_channel(str(path), {"kind": "attach", "token": TOKEN}, timeout=5)
        else:
            env = {"TMPDIR": str(parent)} if where == "default-dir" else {}
            r = subprocess.run([sys.executable, "-m", "kvtier.cli", "status", "--timeout", "5",
                                *([] if where == "default-dir" else ["--server", f"unix://{path}"])],
                               capture_output=True, text=True, timeout=60,
                               env={**{k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"},
                                    **env, "KVTIER_TOKEN": TOKEN})
            lines = [line for line in r.stderr.splitlines() if line.strip()]
            assert r.returncode == 1 and len(lines) == 1, r.stderr
    finally:
        squat.proc.stdin.close()
    message = str(e.value) if where == "attach" else lines[0]
    if made:  # the directory is nobody's
        assert f"refusing unix socket {path}: directory {made} is owned by uid {NOBODY}" in message, message
    else:  # the socket is nobody's, in a sticky directory: the directory alone is reason enough now
        assert f"refusing unix socket {path}: directory {parent} (mode 1777) is writable by group or others" in message

    assert squat.result() == {"connected": False, "token_seen": False}


# ----- a loopback TCP port has no owner --------------------------------------------------------------
def test_no_token_goes_to_a_tcp_address_in_plaintext_loopback_included():
    """Attack pass 6, A6-1: a loopback port has no owner. Another uid that bound it while the daemon
    was down (or took over gRPC's background reconnect, which no check before a call can see: a
    listener check, tried first, was bypassed that way) received every client's bearer token. The
    client now refuses a token over plaintext TCP at all, before it connects."""
    for address in ("127.0.0.1:50051", "localhost:50051", "[::1]:50051"):
        with pytest.raises(ValueError, match=f"refusing to send a token to {re.escape(address)} in plaintext"):
            KVTierClient(address, token=TOKEN)
    KVTierClient("127.0.0.1:50051").close()  # without a token: the caller's own choice (single-user machines)
