"""The real ``kvtier`` command, run as a user runs it (a subprocess): what goes wrong before the daemon
serves is one line on stderr, exit status 1, no traceback, saying what to do next.

Regressions (issue 8, defects 6 and 8): an unusable ``--disk-path`` (a file, ``/proc``, a read-only
filesystem) ended in a traceback; ``kvtier status --server /path/kv.sock`` (a bare path, also
``KVTIER_SERVER``) ended in a 28-line traceback; a pool larger than memory printed torch's allocator
text; a missing Mooncake library gave a 40-line traceback after the pool was allocated; a socket
directory owned by another user, or a symlink, was accepted and chmod'ed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from small_fs import small_tmpfs

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess

SMALL_POOL = ["--device", "cpu", "--pool", "glm-5.2:64", "--pool-layers", "2"]
SMALL_POOL_TOKENS = 64


def kvtier(*args: str, env: dict[str, str] | None = None, timeout: float = 120, prefix: list[str] | None = None):
    """Run ``python -m kvtier.cli ARGS`` (optionally under ``prefix``, e.g. ``unshare``); returns the result."""
    cmd = [*(prefix or []), sys.executable, "-m", "kvtier.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def one_line_error(r: subprocess.CompletedProcess) -> str:
    """Assert exit 1 and exactly one non-empty stderr line without a traceback; return that line."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert lines[0].startswith("Error: ")
    return lines[0]


def serve(tmp_path: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    return kvtier("serve", "--listen", f"unix://{tmp_path}/kv.sock", *SMALL_POOL, *args, **kw)


# ----- --disk-path -----------------------------------------------------------------------------------
def test_a_disk_path_on_the_daemons_own_socket_path_is_one_line_and_makes_nothing(tmp_path):
    """Attack pass 7: ``--disk-path`` equal to the listen socket's path made the disk directory there,
    then the socket's check refused that very directory and told the user to remove it. Refused
    first now, for the attach socket's path too, and nothing is made."""
    for name in ("kv.sock", "kv.sock.attach"):
        line = one_line_error(serve(tmp_path, "--disk-path", str(tmp_path / name)))
        assert f"--disk-path {tmp_path / name} is the daemon's socket path" in line
        assert not (tmp_path / name).exists()


def test_disk_path_that_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    line = one_line_error(serve(tmp_path, "--disk-path", str(tmp_path / "afile")))
    assert "is not a directory" in line and "--disk-path DIR" in line


@pytest.mark.parametrize("path", ["/proc", "/proc/kvtier-nothing-here"])
def test_disk_path_under_proc(tmp_path, path):
    line = one_line_error(serve(tmp_path, "--disk-path", path))
    assert path in line and ("pseudo filesystem" in line or "cannot be created" in line)


def test_disk_path_on_a_read_only_filesystem(tmp_path):
    ro = tmp_path / "ro"
    with small_tmpfs(ro, "1m", options="ro") as mounted:
        path = ro if mounted else Path("/proc/sys")  # no mount allowed: another filesystem LMDB cannot use
        line = one_line_error(serve(tmp_path, "--disk-path", str(path / "tier") if not mounted else str(path)))
    assert ("read-only filesystem" in line) if mounted else ("--disk-path" in line)


# ----- --server with a bare path ---------------------------------------------------------------------
def test_status_takes_a_bare_socket_path_flag_and_env(tmp_path):
    with DaemonProcess(extra_args=SMALL_POOL) as d:
        path = d.address[len("unix://"):]
        assert kvtier("status", "--server", path, "--json").returncode == 0
        r = kvtier("status", "--json", env={"KVTIER_SERVER": path})
        assert r.returncode == 0 and '"health": "SERVING"' in r.stdout, r.stderr
    line = one_line_error(kvtier("status", "--server", str(tmp_path / "nobody.sock"), "--timeout", "2"))
    assert f"no kvtier daemon answers at unix://{tmp_path}/nobody.sock (start one" in line
    line = one_line_error(kvtier("pools", "--timeout", "2", env={"KVTIER_SERVER": str(tmp_path / "nobody.sock")}))
    assert f"no kvtier daemon answers at unix://{tmp_path}/nobody.sock (start one" in line


# ----- a pool larger than memory -----------------------------------------------------------------------
def test_pool_larger_than_memory_says_how_much_there_is(tmp_path):
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    r = kvtier("serve", "--listen", f"unix://{tmp_path}/kv.sock", "--device", "cpu",
               "--pool", f"glm-5.2:{4 * total // (1 << 30) + 64}GiB")
    line = one_line_error(r)
    assert "bytes available" in line and "kvtier plan --available-bytes" in line
    assert "alloc_cpu" not in line and "DefaultCPUAllocator" not in line


# ----- Mooncake missing ------------------------------------------------------------------------------
def test_missing_mooncake_wheel_is_found_before_any_pool(tmp_path):
    """An (empty) ``mooncake`` package first on the path is what the import sees without the wheel; the
    pool asked for is far larger than memory, so only a check that runs before any pool is allocated
    can name Mooncake."""
    shadow = tmp_path / "shadow" / "mooncake"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    r = kvtier("serve", "--listen", f"unix://{tmp_path}/kv.sock", "--device", "cpu", "--transfer-engine", "mooncake",
               "--pool", f"glm-5.2:{4 * total // (1 << 30) + 64}GiB", env={"PYTHONPATH": str(tmp_path / "shadow")})
    line = one_line_error(r)
    assert "Mooncake Transfer Engine is not available" in line and "mooncake.engine" in line
    assert "pip install 'kvtier[mooncake]'" in line and "libibverbs1" in line


def test_missing_mooncake_debian_library(tmp_path):
    """libibverbs.so.1 hidden in a private mount namespace (a bind mount of /dev/null over it, seen only
    by this command): the real engine fails to load and the daemon says so in one line."""
    lib = Path("/lib/x86_64-linux-gnu/libibverbs.so.1").resolve()
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    assert lib.exists(), "libibverbs1 is a required Debian package (see README)"
    if probe.returncode == 0:
        args = " ".join(["--listen", f"unix://{tmp_path}/kv.sock", *SMALL_POOL, "--transfer-engine", "mooncake"])
        script = f"mount --bind /dev/null {lib} && exec {sys.executable} -m kvtier.cli serve {args}"
        r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120)
        expected = "libibverbs.so.1"
    else:  # no namespaces here: an engine module that fails to load as the real one does without the library
        shadow = tmp_path / "shadow" / "mooncake"
        shadow.mkdir(parents=True)
        (shadow / "__init__.py").write_text("")
        (shadow / "engine.py").write_text(
            "raise ImportError('libibverbs.so.1: cannot open shared object file: No such file or directory')\n")
        r = serve(tmp_path, "--transfer-engine", "mooncake", env={"PYTHONPATH": str(tmp_path / "shadow")})
        expected = "libibverbs.so.1"
    line = one_line_error(r)
    assert "Mooncake Transfer Engine is not available" in line and expected in line


# ----- the socket directory --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["other-owner", "symlink"])
def test_default_socket_dir_of_another_user_or_a_symlink_is_refused(tmp_path, kind):
    """The default socket directory ($XDG_RUNTIME_DIR/kvtier) exists in advance, owned by another
    user (made world-writable by them) or as a symlink: the daemon refuses it and leaves it alone."""
    runtime = tmp_path / "run"
    runtime.mkdir()
    sockdir = runtime / "kvtier"
    if kind == "other-owner":
        sockdir.mkdir()
        os.chmod(sockdir, 0o777)
        os.chown(sockdir, 65534, 65534)
    else:
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        sockdir.symlink_to(tmp_path / "elsewhere")
    r = kvtier("serve", *SMALL_POOL, env={"XDG_RUNTIME_DIR": str(runtime)})
    line = one_line_error(r)
    assert ("owned by uid 65534" in line) if kind == "other-owner" else ("is a symlink" in line)
    if kind == "other-owner":
        st = os.stat(sockdir)
        assert st.st_uid == 65534 and st.st_mode & 0o777 == 0o777 and not (sockdir / "kvtier.sock").exists()
    else:
        assert not (tmp_path / "elsewhere" / "kvtier.sock").exists()


# ----- a socket a running daemon serves --------------------------------------------------------------
def test_a_second_daemon_on_a_served_socket_says_what_to_do():
    """``kvtier serve`` on the socket a running daemon serves: one line naming the socket as in use and
    what to do (stop that daemon, or listen elsewhere); the running daemon keeps serving."""
    with DaemonProcess(extra_args=SMALL_POOL) as d:
        line = one_line_error(kvtier("serve", "--listen", d.address, *SMALL_POOL))
        assert "is in use by a running daemon (stop it, or pass --listen unix:///another/path.sock)" in line
        assert kvtier("status", "--server", d.address, "--json").returncode == 0


def test_a_second_daemon_on_a_served_tcp_port_is_refused():
    """``kvtier serve --listen 127.0.0.1:PORT`` on the port a running daemon listens on: refused in one
    line naming the address (gRPC's default SO_REUSEPORT would have let both listen and the kernel
    share connections between them); every client still reaches the first daemon, its one pool."""
    with DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=SMALL_POOL) as d:
        line = one_line_error(kvtier("serve", "--listen", d.address, "--allow-unauthenticated", "--pool", "glm-5.2:64",
                                     "--pool-layers", "2"))
        assert f"could not listen on {d.address}: the port is in use" in line
        for _ in range(4):
            with KVTierClient(d.address, timeout=10) as c:
                assert [p.size_tokens for p in c.list_pools()] == [SMALL_POOL_TOKENS]


# ----- what lies at the socket paths -------------------------------------------------------------------
NOBODY = 65534
ELSEWHERE = "or pass --listen unix:///another/path.sock"


def _dead_socket(path: Path, kind: int) -> None:
    """A socket file nobody listens on, as a daemon killed with SIGKILL leaves it."""
    s = socket.socket(socket.AF_UNIX, kind)
    s.bind(str(path))
    s.close()


@pytest.mark.parametrize("what", ["file", "directory"])
def test_a_file_or_directory_at_the_listen_path_is_left_alone(tmp_path, what):
    """Attack pass 2, F7: ``--listen unix:///DIR/data.txt`` deleted the regular file ``data.txt``, and a
    directory there gave a traceback (IsADirectoryError). Now both are refused in one line saying what
    lies there and what to do, and left as they were."""
    target = tmp_path / "data.txt"
    if what == "file":
        target.write_text("precious")
    else:
        target.mkdir()
    line = one_line_error(kvtier("serve", "--listen", f"unix://{target}", *SMALL_POOL, timeout=60))
    kind = "a regular file" if what == "file" else "a directory"
    assert f"{target} is {kind}, not a socket" in line and ELSEWHERE in line, line
    assert target.read_text() == "precious" if what == "file" else target.is_dir()


def test_entries_at_the_attach_path_other_than_a_stale_socket_of_ours_are_left_alone(tmp_path):
    """F7: ``<socket>.attach`` was unlinked whatever it was: a regular file of uid nobody (a root daemon
    in a sticky /tmp deleted it), a file of the daemon's own user. Now refused in one line, left as it was,
    before the daemon allocates anything (no socket is bound)."""
    attach = tmp_path / "kv.sock.attach"
    attach.write_text("nobody's")
    os.chown(attach, NOBODY, NOBODY)
    line = one_line_error(serve(tmp_path, timeout=60))
    assert f"{attach} is a regular file, not a socket" in line
    assert attach.read_text() == "nobody's" and attach.stat().st_uid == NOBODY
    assert not (tmp_path / "kv.sock").exists()
    attach.unlink()
    _dead_socket(attach, socket.SOCK_SEQPACKET)
    os.chown(attach, NOBODY, NOBODY)  # a stale socket, but another uid's
    line = one_line_error(serve(tmp_path, timeout=60))
    assert f"{attach} is a socket of uid {NOBODY}, not of this daemon's uid" in line and attach.exists()


def test_a_live_attach_socket_of_another_daemon_is_not_taken(tmp_path):
    """F7: a daemon started with ``--listen`` at a running daemon's ``<socket>.attach`` replaced that live
    SEQPACKET socket (the stream probe's EPROTOTYPE was taken for "stale"): the first daemon's attach was
    dead while both ran. Now refused in one line; the first daemon's attach still works."""
    with DaemonProcess(f"unix://{tmp_path}/a.sock", extra_args=SMALL_POOL) as d:
        attach = f"{tmp_path}/a.sock.attach"
        line = one_line_error(kvtier("serve", "--listen", f"unix://{attach}", *SMALL_POOL, timeout=60))
        assert f"{attach} is in use by a running process (a socket of another type" in line, line
        with KVTierClient(d.address, timeout=30) as c, c.attach("default") as ap:
            assert ap.attached


def test_stale_sockets_of_ours_are_replaced(tmp_path):
    """What a daemon killed with SIGKILL leaves -- its gRPC and attach sockets, nobody listening -- is
    still removed at start: the new daemon serves there, attach included."""
    _dead_socket(tmp_path / "kv.sock", socket.SOCK_STREAM)
    _dead_socket(tmp_path / "kv.sock.attach", socket.SOCK_SEQPACKET)
    with DaemonProcess(f"unix://{tmp_path}/kv.sock", extra_args=SMALL_POOL) as d:
        with KVTierClient(d.address, timeout=30) as c, c.attach("default") as ap:
            assert ap.attached


def test_pool_layers_without_a_pool_is_refused():
    """``--pool-layers`` sets the layers of ``--pool`` pools: alone it used to start a daemon with no pool
    and no word; now a usage error naming what to add, and nothing starts."""
    r = kvtier("serve", "--device", "cpu", "--pool-layers", "20:40", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--pool-layers sets the layers of --pool pools: give --pool too" in r.stderr


# ----- the metrics endpoint ----------------------------------------------------------------------------
METRICS_TOKEN = "metrics-scrape-token-0123456789abcdef"


def test_metrics_without_a_token_or_an_explicit_opt_in_are_refused(tmp_path):
    """Scenario (security pass, D8): ``--metrics-port`` served tenant names, pool ids and per-tenant call
    counts to every local user, without a word. Now it starts only with ``--metrics-token-file`` or the
    explicit ``--metrics-insecure``: alone it stops at once in one line naming both (no daemon serves)."""
    line = one_line_error(serve(tmp_path, "--metrics-port", "0", timeout=60))
    assert "--metrics-port needs --metrics-token-file FILE" in line and "--metrics-insecure" in line
    assert not (tmp_path / "kv.sock").exists()
    token = tmp_path / "metrics.token"
    token.write_text(METRICS_TOKEN)
    os.chmod(token, 0o600)
    line = one_line_error(serve(tmp_path, "--metrics-port", "0", "--metrics-insecure", "--metrics-token-file",
                                str(token), timeout=60))
    assert "contradict each other: give one" in line
    line = one_line_error(serve(tmp_path, "--metrics-token-file", str(token), timeout=60))
    assert "give --metrics-port" in line


@pytest.mark.parametrize("problem", ["mode-0644", "other-owner", "symlink", "short", "two-words", "fifo"])
def test_a_metrics_token_file_others_could_read_or_that_holds_no_token_is_refused(tmp_path, problem):
    """``--metrics-token-file`` is checked like ``--auth-tokens``: a regular file of the daemon's user
    with no group or other permission, not a symlink, holding one token of at least 16 visible
    characters. Anything else stops the daemon before a pool is allocated, in one line saying what to
    fix and never showing the token."""
    token = tmp_path / "metrics.token"
    token.write_text({"short": "short-token", "two-words": f"{METRICS_TOKEN} {METRICS_TOKEN}"}.get(problem, METRICS_TOKEN))
    os.chmod(token, 0o644 if problem == "mode-0644" else 0o600)
    given = token
    if problem == "other-owner":
        os.chown(token, 65534, 65534)  # tests run as root: hand the file to "nobody"
    elif problem == "symlink":
        given = tmp_path / "link.token"
        given.symlink_to(token)
    elif problem == "fifo":  # regression (attack pass 3, N3): opening it waited for a writer, silently, forever
        given = tmp_path / "fifo.token"
        os.mkfifo(given, 0o600)
    line = one_line_error(serve(tmp_path, "--metrics-port", "0", "--metrics-token-file", str(given), timeout=60))
    expected = {"mode-0644": f"mode 0644 lets other users read it; run chmod 600 {token}",
                "other-owner": "owned by uid 65534, not by the daemon's user", "symlink": "not a symlink",
                "short": "shorter than 16 characters", "two-words": "one word of visible ASCII",
                "fifo": "not a regular file"}[problem]
    assert line.startswith(f"Error: --metrics-token-file {given}: ") and expected in line, line
    assert METRICS_TOKEN not in line and "short-token" not in line


# ----- the ready file ----------------------------------------------------------------------------------
# Regression (attack pass F2): the ready file was written only after the daemon served, through a fixed
# FILE.tmp; an unwritable one (a missing directory, FILE.tmp a directory, another user's FILE.tmp in a
# sticky directory: EPERM) ended a serving daemon with a traceback and left its sockets behind.
def huge_pool() -> list[str]:
    """A pool far larger than memory: only a refusal that comes before any pool is allocated names something else."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return ["--device", "cpu", "--pool", f"glm-5.2:{4 * total // (1 << 30) + 64}GiB"]


def no_sockets_left(tmp_path: Path) -> None:
    assert not (tmp_path / "kv.sock").exists() and not (tmp_path / "kv.sock.attach").exists(), os.listdir(tmp_path)


@pytest.mark.parametrize("problem", ["missing-directory", "a-directory", "read-only-directory"])
def test_a_ready_file_that_cannot_be_written_is_refused_before_anything_is_allocated(tmp_path, problem):
    """A ready file in a missing directory, naming a directory (``ready_file`` in the config file: the
    ``--ready-file`` flag refuses a directory itself), or in a directory this user cannot write (a
    read-only filesystem here: the tests run as root) stops ``kvtier serve`` in one line naming the
    path, before the pool is allocated; nothing is served, no socket is left."""
    ready = {"missing-directory": tmp_path / "nowhere" / "ready", "a-directory": tmp_path / "ready.d",
             "read-only-directory": tmp_path / "ro" / "ready"}[problem]
    given = ["--ready-file", str(ready)]
    if problem == "a-directory":
        ready.mkdir()
        (tmp_path / "kvtier.toml").write_text(f'ready_file = "{ready}"\n')
        given = ["--config", str(tmp_path / "kvtier.toml")]
    with small_tmpfs(tmp_path / "ro", "1m", options="ro") as mounted:
        if problem == "read-only-directory" and not mounted:
            pytest.fail("could not mount a read-only tmpfs: the suite runs as root (CI does) and needs it")
        r = kvtier("serve", "--listen", f"unix://{tmp_path}/kv.sock", *huge_pool(), *given)
        line = one_line_error(r)
    expected = {"missing-directory": f"--ready-file {ready}: its directory {ready.parent} does not exist",
                "a-directory": f"--ready-file {ready} is a directory; give the path of a file",
                "read-only-directory": f"--ready-file {ready}: cannot write in {ready.parent} (Read-only file system)"}
    assert line.startswith(f"Error: {expected[problem]}"), line
    no_sockets_left(tmp_path)


@pytest.mark.parametrize("problem", ["char-device", "fifo", "own-socket", "auth-tokens", "config-file", "disk-dir"])
def test_a_ready_file_naming_something_the_daemon_must_not_replace_is_refused_at_start(tmp_path, problem):
    """Attack pass 7, A7-6: ``--ready-file`` replaced whatever non-directory was at the path: a device
    node (a copy of /dev/null made here; as root the real one broke for everyone), a FIFO, the daemon's
    own socket (it served on, unreachable), and, by the same code, its tokens file, its config file or
    a file of its disk tier. Each is refused in one line naming the path and what is there, before the
    (huge) pool is allocated, and left as it was."""
    sock = tmp_path / "kv.sock"
    ready = {"char-device": tmp_path / "null", "fifo": tmp_path / "fifo", "own-socket": sock,
             "auth-tokens": tmp_path / "tokens.toml", "config-file": tmp_path / "kvtier.toml",
             "disk-dir": tmp_path / "disk" / "data.mdb"}[problem]
    extra: list[str] = []
    if problem == "char-device":
        assert os.geteuid() == 0, "mknod needs root: the suite runs as root (as for its tmpfs disks)"
        os.mknod(ready, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    elif problem == "fifo":
        os.mkfifo(ready, 0o600)
    elif problem == "auth-tokens":
        ready.write_text('[tokens]\n"0123456789abcdef0123" = "team-a"\n')
        ready.chmod(0o600)
        extra = ["--auth-tokens", str(ready)]
    elif problem == "config-file":
        ready.write_text('log_level = "INFO"\n')
        ready.chmod(0o600)
        extra = ["--config", str(ready)]
    elif problem == "disk-dir":
        ready.parent.mkdir(mode=0o700)
        extra = ["--disk-path", str(ready.parent)]
    before = os.lstat(ready) if os.path.lexists(ready) else None
    r = kvtier("serve", "--listen", f"unix://{sock}", *huge_pool(), "--ready-file", str(ready), *extra)
    line = one_line_error(r)
    expected = {"char-device": "is a character device, not a regular file", "fifo": "is a FIFO, not a regular file",
                "own-socket": "is the daemon's own --listen socket, which the ready file would replace",
                "auth-tokens": "is the --auth-tokens file, which the ready file would replace",
                "config-file": "is the --config file, which the ready file would replace",
                "disk-dir": f"is in the disk tier's directory {ready.parent} (--disk-path)"}[problem]
    assert line.startswith(f"Error: --ready-file {ready} {expected}"), line
    if before is not None:
        after = os.lstat(ready)
        assert (after.st_ino, after.st_mode, after.st_rdev) == (before.st_ino, before.st_mode, before.st_rdev)
    no_sockets_left(tmp_path)


def test_a_directory_named_like_the_old_temporary_file_is_not_in_the_way():
    """``FILE.tmp`` beside the ready file (a directory here, left by anyone) no longer matters: the ready
    file is written through a temporary file of a random name, mode 0600, and ``FILE.tmp`` is left as it was."""
    d = DaemonProcess(extra_args=SMALL_POOL)
    stale = d.log_path.parent / "ready.tmp"
    stale.mkdir()
    with d:
        ready = d.log_path.parent / "ready"
        assert ready.read_text() == d.address and ready.stat().st_mode & 0o777 == 0o600
        assert stale.is_dir() and sorted(p.name for p in d.log_path.parent.iterdir() if "ready" in p.name) == \
            ["ready", "ready.tmp"]


def test_another_users_tmp_file_in_a_sticky_directory_cannot_stop_a_daemon(tmp_path):
    """A daemon of uid ``nobody`` with its ready file in a shared sticky directory (``/tmp``-like) where
    root made ``ready.tmp`` first: it used to fail to remove it (EPERM) and exit with a traceback after
    it had started serving. Now it serves and writes its ready file (0600, its own)."""
    assert os.getuid() == 0, "this test starts the daemon as another user"
    shared = Path(tempfile.mkdtemp(prefix="kvtier-sticky-"))
    sockdir = Path(tempfile.mkdtemp(prefix="kvtier-nobody-"))
    try:
        os.chmod(shared, 0o1777)
        os.chown(sockdir, 65534, 65534)
        (shared / "ready.tmp").write_text("")  # root's: nobody may neither remove nor write it
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", sys.executable, "-m", "kvtier.cli",
               "serve", "--listen", f"unix://{sockdir}/kv.sock", *SMALL_POOL, "--ready-file", str(shared / "ready")]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 120
            while not (shared / "ready").exists() and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert (shared / "ready").exists(), p.poll()
        finally:
            p.send_signal(signal.SIGTERM)
            out = p.communicate(timeout=60)[0]
        assert p.returncode == 0 and "Traceback" not in out, out
        st = (shared / "ready").stat()
        assert (st.st_uid, st.st_mode & 0o777) == (65534, 0o600)
        assert (shared / "ready").read_text() == f"unix://{sockdir}/kv.sock"
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(sockdir, ignore_errors=True)


def test_another_users_ready_file_in_a_sticky_directory_is_refused_at_start(tmp_path):
    """A ready file path that another uid already took in a sticky directory cannot be replaced by the
    daemon (rename over it is EPERM there): a daemon of uid ``nobody`` stops before its pool is
    allocated, in one line naming the owner and what to do."""
    assert os.getuid() == 0, "this test starts the daemon as another user"
    shared = Path(tempfile.mkdtemp(prefix="kvtier-sticky-"))
    sockdir = Path(tempfile.mkdtemp(prefix="kvtier-nobody-"))
    try:
        os.chmod(shared, 0o1777)
        os.chown(sockdir, 65534, 65534)
        (shared / "ready").write_text("")  # root's
        r = kvtier("serve", "--listen", f"unix://{sockdir}/kv.sock", *huge_pool(), "--ready-file", str(shared / "ready"),
                   prefix=["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        line = one_line_error(r)
        assert line == (f"Error: --ready-file {shared / 'ready'} belongs to uid 0 in the sticky directory {shared}, so "
                        f"this user cannot replace it; remove it or give another path"), line
        assert os.listdir(sockdir) == []
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(sockdir, ignore_errors=True)


_FAIL_READY_WRITE = """
import sys
import kvtier.server.service.server as server
def refuse(path, text, *what):
    raise PermissionError(13, "Permission denied", path)
server.write_private_file = refuse  # checked at start, then unwritable once serving (e.g. the directory was changed)
from kvtier.cli import main
sys.argv[0] = "kvtier"
main()
"""


def test_a_ready_file_that_fails_once_serving_stops_the_daemon_cleanly(tmp_path):
    """Should the ready file fail after the check (its directory changed while the daemon started), the
    daemon stops what it started, removes its gRPC and attach sockets and says so in one line (exit 1),
    without a traceback."""
    r = subprocess.run([sys.executable, "-c", _FAIL_READY_WRITE, "serve", "--listen", f"unix://{tmp_path}/kv.sock",
                        *SMALL_POOL, "--log-level", "WARNING", "--ready-file", str(tmp_path / "ready")],
                       capture_output=True, text=True,
                       timeout=120)
    line = one_line_error(r)
    assert line == f"Error: could not write --ready-file {tmp_path / 'ready'} (Permission denied); stopped", line
    no_sockets_left(tmp_path)


def test_a_metrics_port_in_use_stops_the_daemon_without_leaving_its_sockets(tmp_path):
    """Sibling: the metrics endpoint starts after the gRPC server and the attach channel; a port taken
    by another process stops the daemon in one line, and both sockets go with it (the attach socket
    used to stay behind)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_line_error(serve(tmp_path, "--metrics-port", str(port), "--metrics-insecure", "--log-level", "WARNING",
                                    timeout=120))
    assert f"could not serve metrics on 127.0.0.1:{port}" in line
    no_sockets_left(tmp_path)


@pytest.mark.parametrize("command", ["status", "pools"])
def test_a_token_a_header_cannot_carry_is_one_line_before_any_call(command):
    """Attack pass 3, N9: KVTIER_TOKEN with a newline made every command fail with the daemon's
    INTERNAL "Invalid metadata"; now it is refused before any call, naming the variable."""
    r = kvtier(command, "--server", "unix:///nonexistent/kv.sock", env={"KVTIER_TOKEN": "tok-0123456789abcdef\n"})
    line = one_line_error(r)
    assert "$KVTIER_TOKEN holds a character a gRPC header cannot carry (character #21, code 10)" in line
    assert "tok-0123456789abcdef" not in line


def test_a_loopback_tcp_listen_without_tokens_is_refused_unless_allowed(tmp_path):
    """Attack pass 3, N7: ``--listen 127.0.0.1:PORT`` without ``--auth-tokens`` served every local
    uid (read, overwrite, free every pool's KV) and nothing said so. Now it is refused in one line
    before anything is allocated; ``--allow-unauthenticated`` serves it with a WARNING at start.
    With tokens but without TLS it is refused too (attack pass 6, A6-1)."""
    line = one_line_error(kvtier("serve", "--listen", "127.0.0.1:0", *SMALL_POOL))
    assert "refusing to listen on 127.0.0.1:0 without TLS: any local user" in line
    assert "--allow-unauthenticated" in line and "unix socket" in line
    # attack pass 6, A6-1: a loopback port has no owner, so tokens never go there in plaintext
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[tokens]\n"a-token-of-team-a-0123456789abc" = "a"\n')
    tokens.chmod(0o600)
    for extra in ([], ["--allow-unauthenticated"]):
        line = one_line_error(kvtier("serve", "--listen", "127.0.0.1:0", "--auth-tokens", str(tokens), *extra,
                                     *SMALL_POOL))
        assert "refusing to listen on 127.0.0.1:0 with --auth-tokens but without TLS" in line and "unix socket" in line
    with DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=SMALL_POOL) as d:
        log = d.log_path.read_text()
        assert f"serving {d.address} without --auth-tokens (--allow-unauthenticated): any local user" in log
        with KVTierClient(d.address, timeout=10) as c:
            assert [p.size_tokens for p in c.list_pools()] == [SMALL_POOL_TOKENS]
    with DaemonProcess(extra_args=SMALL_POOL) as d:  # the default unix socket: no flag, no warning
        assert "without --auth-tokens" not in d.log_path.read_text()


def test_a_disk_size_below_what_the_disk_path_holds_is_one_line(tmp_path):
    """Attack pass 4, A4-2: ``kvtier serve`` on a disk path that holds more than ``--disk-size`` started,
    then failed every Drop with INTERNAL. It is refused at start in one line."""
    disk = tmp_path / "disk"
    with DaemonProcess(extra_args=[*SMALL_POOL, "--disk-path", str(disk), "--disk-size", "64MiB", "--write-through"]) as d, \
            KVTierClient(d.address, timeout=30) as c:
        for i in range(12):  # ~200 KB a one-page copy: some 2.4 MB on disk
            slots = c.allocate_slots("default", 64)
            c.offload("default", f"copy-{i}", slots, free_slots=True)
    line = one_line_error(serve(tmp_path, "--disk-path", str(disk), "--disk-size", "1MiB"))
    assert "--disk-size 1,048,576 bytes is too small for the" in line and "bytes the disk tier already holds in" in line


def test_tls_files_that_are_not_pem_are_one_line_before_anything_is_allocated(tmp_path):
    """Attack pass 4, A4-4: a --tls-cert/--tls-key that is not PEM gave gRPC's C-core errors and a
    traceback blaming the address ("Failed to bind"); the files are now loaded first."""
    bad = tmp_path / "bad.pem"
    bad.write_text("not pem\n")
    bad.chmod(0o600)  # (a key others could read is refused before it is loaded)
    line = one_line_error(serve(tmp_path, "--tls-cert", str(bad), "--tls-key", str(bad)))
    assert f"--tls-cert {bad} and --tls-key {bad} cannot be loaded (OpenSSL refused them: not PEM" in line
    assert not (tmp_path / "kv.sock").exists()
    line = one_line_error(serve(tmp_path, "--peer-tls-ca", str(bad)))  # was accepted, failing at the first pull
    assert f"--peer-tls-ca {bad} cannot be loaded (OpenSSL refused them: not PEM CA certificates)" in line


def test_a_ready_file_in_a_directory_another_user_owns_is_refused(tmp_path):
    """Attack pass 4, A4-10: ``--ready-file DIR/ready`` with DIR owned by uid 65534 was accepted; that
    user replaced the file with an address of its own, and a launcher reading it would have sent its
    bearer token there. The way to the ready file now gets the socket paths' check."""
    theirs = tmp_path / "nobodys"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    line = one_line_error(serve(tmp_path, "--ready-file", str(theirs / "ready")))
    assert f"refusing --ready-file {theirs / 'ready'}: directory {theirs} is owned by uid 65534" in line
    assert not (theirs / "ready").exists() and not (tmp_path / "kv.sock").exists()


def test_tls_files_another_user_could_swap_or_read_are_refused(tmp_path):
    """Attack pass 5, A5-2: a --tls-client-ca in a directory of uid 65534 was trusted; that user put
    its own CA there and its client certificates then called the daemon (every pool's KV). The TLS
    files now get the --config checks (the key: the --auth-tokens checks)."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server" / "service"))
    from pki import make_pki

    pki = make_pki(tmp_path)
    theirs = tmp_path / "nobodys"
    theirs.mkdir()
    shutil.copy(pki["ca.pem"], theirs / "client-ca.pem")
    os.chown(theirs, 65534, 65534)
    tls = ["--tls-cert", str(pki["server.pem"]), "--tls-key", str(pki["server.key"])]
    line = one_line_error(serve(tmp_path, *tls, "--tls-client-ca", str(theirs / "client-ca.pem")))
    assert f"refusing --tls-client-ca {theirs / 'client-ca.pem'}: directory {theirs} is owned by uid 65534" in line
    pki["server.key"].chmod(0o644)
    line = one_line_error(serve(tmp_path, *tls))
    assert f"--tls-key {pki['server.key']}: mode 0644 lets other users read it; run chmod 600" in line


def test_a_host_tier_the_machine_cannot_map_is_one_line(tmp_path):
    """Attack pass 5, A5-5: ``--host-memory 1000000000GiB`` ended in an mmap traceback."""
    line = one_line_error(serve(tmp_path, "--host-memory", "1000000000GiB"))
    assert "--host-memory 1,073,741,824,000,000,000 bytes cannot be mapped (out of memory)" in line


# ----- files that are not regular files ----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["char-device", "fifo"])
def test_a_config_that_is_not_a_regular_file_is_one_line_at_once(tmp_path, kind, make_node):
    """Attack pass 9, A9-9: ``kvtier serve --config /dev/zero`` read the device until the host ran
    out of memory (1 GB/s), and ``--config FIFO`` hung in open(): the serve flags' ``[tiers]`` check read
    the file with a plain open before the daemon's own check. It now reads it through that check: one
    line, at once. (Our own device node, a copy of /dev/zero's numbers, and our own FIFO.)"""
    node = make_node(kind)
    r = serve(tmp_path, "--config", str(node), timeout=30)
    assert one_line_error(r) == f"Error: --config {node}: not a regular file"


@pytest.mark.parametrize("kind", ["char-device", "fifo"])
def test_a_client_tls_file_that_is_not_a_regular_file_is_one_line_at_once(kind, make_node):
    """A9-9's client sibling: ``KVTIER_TLS_CA=/dev/zero kvtier status`` read the device to 4 GB."""
    node = make_node(kind)
    r = kvtier("status", "--server", "127.0.0.1:1", "--timeout", "1", env={"KVTIER_TLS_CA": str(node)}, timeout=30)
    assert one_line_error(r) == f"Error: tls_root_cert {node}: not a regular file"
