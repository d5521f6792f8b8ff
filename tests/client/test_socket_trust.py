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
def test_listen_in_a_sticky_directory_serves_and_a_squatted_name_is_refused(parent):
    """A sticky world-writable directory (like /tmp) is accepted: nobody may not rename or remove the
    daemon's socket there (EPERM), and the client talks to it with its token. A name nobody took first
    is refused by the daemon (and by the client)."""
    with DaemonProcess(f"unix://{parent}/kv.sock", extra_args=POOL_ARGS) as d:
        with KVTierClient(d.address, token=TOKEN) as c:
            assert c.health() == "SERVING"
        assert json.loads(as_nobody(_RENAME, str(parent / "kv.sock"), str(parent / "moved")).stdout) == 1  # EPERM
    squat = Squatter(parent / "taken.sock")
    try:
        r = serve(f"unix://{parent}/taken.sock")
        assert r.returncode == 1 and f"socket {parent}/taken.sock is owned by uid {NOBODY}" in r.stderr, r.stderr
    finally:
        squat.proc.stdin.close()
    assert squat.result() == {"connected": False, "token_seen": False}


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
    owned = f"directory {made}" if made else f"socket {path}"
    assert f"refusing unix socket {path}: {owned} is owned by uid {NOBODY}" in message, message
    assert squat.result() == {"connected": False, "token_seen": False}


# ----- a loopback TCP port another user took ----------------------------------------------------------
# Run as nobody: listen on HOST:0, say the port, wait for stdin to close, then report whether a
# connection is waiting in the backlog (as _SQUAT).
_SQUAT_TCP = """
import json, socket, sys
host = sys.argv[1]
s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
s.bind((host, 0)); s.listen(8); s.setblocking(False)
print(s.getsockname()[1], flush=True)
sys.stdin.read()
try:
    c, _ = s.accept(); c.setblocking(True); c.settimeout(5)
    got = c.recv(65536)
    print(json.dumps({"connected": True, "token_seen": b"S3cret" in got}))
except BlockingIOError:
    print(json.dumps({"connected": False, "token_seen": False}))
"""


class TcpSquatter(Squatter):
    """A TCP listener of uid nobody on ``host`` (a port the kernel picks: :attr:`port`)."""

    def __init__(self, host: str) -> None:
        self.proc = as_nobody(_SQUAT_TCP, host, background=True)
        line = self.proc.stdout.readline().strip()
        assert line.isdigit(), self.proc.stderr.read()
        self.port = int(line)


@pytest.mark.parametrize("host, address", [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "localhost"), ("::", "[::1]")])
def test_the_client_sends_nothing_to_a_loopback_port_another_user_took(host, address):
    """Attack pass 5, the TCP twin of A4-14: a loopback port has no owner, so while the daemon is down
    another uid may listen on it (on the address itself or a wildcard one) and receive the token of
    every client that dials it, and answer with bytes of its choosing. The client, on plaintext
    loopback TCP, now asks the kernel (/proc/net/tcp, tcp6) who listens there before every call:
    refused in one line naming the owner, and the squatter sees no connection."""
    squat = TcpSquatter(host)
    target = f"{address}:{squat.port}"
    try:
        r = subprocess.run([sys.executable, "-m", "kvtier.cli", "status", "--timeout", "5", "--server", target],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "KVTIER_TOKEN": TOKEN})
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 1 and len(lines) == 1, r.stderr
        assert f"refusing {target}: the port is listened on by uid {NOBODY}" in lines[0], lines[0]
        with pytest.raises(FailedPreconditionError):  # without a token too: its answers are not trusted either
            with KVTierClient(target, timeout=5) as c:
                c.health()
    finally:
        squat.proc.stdin.close()
    assert squat.result() == {"connected": False, "token_seen": False}


def test_loopback_listeners_reads_the_kernels_tables():
    """:func:`kvtier.addresses.loopback_listeners` against listeners of known owners: root's on
    127.0.0.1 and on ``::`` (a dual-stack wildcard takes IPv4 loopback too), nobody's on 127.0.0.2
    (not where 127.0.0.1 lands); nothing on a port nobody listens on."""
    from kvtier.addresses import check_loopback_listener, loopback_listeners

    mine = socket.socket()
    mine.bind(("127.0.0.1", 0))
    mine.listen()
    wild = socket.socket(socket.AF_INET6)
    wild.bind(("::", 0))
    wild.listen()
    other = TcpSquatter("127.0.0.2")
    free = socket.socket()
    free.bind(("127.0.0.1", 0))  # bound, not listening: its port is free of listeners
    try:
        p, w = mine.getsockname()[1], wild.getsockname()[1]
        assert loopback_listeners(f"127.0.0.1:{p}") == [0] and check_loopback_listener(f"localhost:{p}") is True
        assert loopback_listeners(f"127.0.0.1:{w}") == [0] and loopback_listeners(f"[::1]:{w}") == [0]
        assert loopback_listeners(f"127.0.0.1:{other.port}") == []
        assert loopback_listeners(f"127.0.0.2:{other.port}") == [NOBODY]
        assert check_loopback_listener(f"127.0.0.1:{free.getsockname()[1]}") is False
        with pytest.raises(ValueError, match="not a loopback TCP address"):
            loopback_listeners("10.1.2.3:80")
    finally:
        other.proc.stdin.close()
        other.result()
        for s in (mine, wild, free):
            s.close()
