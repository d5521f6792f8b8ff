"""The attach channel under abuse: peers that never read, pools held busy, floods of sessions and of
connections that never speak, staging memory, and leases taken in a session (README "Local attach",
"Concurrency": the attach channel never blocks on a peer or waits unboundedly on a pool's lock).

Every bound asserted is the README's (a dead worker's slots back within 2 s) with a wide margin, or
a behaviour (the connection is closed, the answer is RESOURCE_EXHAUSTED); none measures speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvtier.attach_wire import MAX_FDS, MAX_MESSAGE_BYTES, PROTOCOL_VERSION, recv_message, send_message
from kvtier.client import KVTierClient, NotFoundError, ResourceExhaustedError, UnavailableError
from kvtier.client.spawn import DaemonProcess

WORKER = Path(__file__).with_name("attach_worker.py")
PAGE = 64
SESSION_END_BOUND_S = 2.0  # README "Local attach"
MARGIN_S = 3.0  # on top of the bound: a loaded machine (the fault being fixed took 9.8 s and 28.6 s)
TOKEN_A = "tenant-a-secret-0123456789abcdef"
TOKEN_B = "tenant-b-secret-0123456789abcdef"
DAEMON_ARGS = ["--device", "cpu", "--log-level", "INFO", "--pool-memory", "256MiB"]


def start_worker(address: str, pool_id: str, slots: int) -> subprocess.Popen:
    """A worker process that attaches ``pool_id``, allocates ``slots`` and takes a lease, then sleeps."""
    p = subprocess.Popen([sys.executable, str(WORKER), address, pool_id, "hold",
                          json.dumps({"slots": slots, "keys": [os.urandom(16).hex()]})],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line:
        p.kill()
        raise AssertionError(f"worker died: {p.stderr.read()}")
    assert json.loads(line)["ready"]
    return p


def kill_and_time_recovery(c: KVTierClient, pool_id: str, proc: subprocess.Popen, free_before: int) -> float:
    """SIGKILL ``proc`` and return the seconds until ``pool_id`` has ``free_before`` free pages again
    (fails past the README's bound plus the margin)."""
    start = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    while c.describe_pool(pool_id).free_pages != free_before:
        assert time.monotonic() - start < SESSION_END_BOUND_S + MARGIN_S, "the dead worker's slots did not come back"
        time.sleep(0.02)
    return time.monotonic() - start


def raw_connect(path: str) -> socket.socket:
    """A connection to the attach channel (retried while its listen queue is full)."""
    deadline = time.monotonic() + 10
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        try:
            s.connect(path)
            return s
        except BlockingIOError:
            s.close()
            assert time.monotonic() < deadline, "the attach channel accepted no connection"
            time.sleep(0.01)


def raw_session(path: str, token: str | None = None) -> socket.socket:
    s = raw_connect(path)
    send_message(s, {"kind": "storage", "version": PROTOCOL_VERSION, "token": token})
    reply, _ = recv_message(s, accept_fds=True)
    assert "session_id" in reply, reply
    return s


def closed_by_daemon(s: socket.socket, within: float) -> bool:
    """Read ``s`` until the daemon closes it (True) or nothing comes for ``within`` seconds (False)."""
    s.settimeout(within)
    try:
        while True:
            got = recv_message(s, accept_fds=True)
            if got is None:
                return True
    except (TimeoutError, socket.timeout):
        return False
    except OSError:
        return True


def flood_until_dropped(s: socket.socket, request: bytes, within: float) -> bool:
    """Send ``request`` on ``s`` again and again, never reading, until the daemon closes the
    connection (True) or ``within`` seconds pass (False)."""
    s.setblocking(False)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            s.send(request)
        except BlockingIOError:
            time.sleep(0.002)  # the daemon has not read the last ones yet
        except OSError:
            return True  # EPIPE / ECONNRESET: the daemon closed it
    return False


@pytest.fixture()
def daemon():
    with DaemonProcess(extra_args=DAEMON_ARGS) as d:
        yield d


def test_peers_that_never_read_their_replies_are_dropped_and_stall_nothing(daemon):
    """Scenario (issue: adversarial test 02): 8 storage sessions each send a few hundred bad requests
    and never read a reply. Before the fix every reply blocked one of the channel's 4 workers up to
    10 s, so a fresh session took ~9.5 s and a SIGKILLed worker's slots came back after ~9.8 s.
    Now each such peer is closed by the daemon (its socket buffer is full: it does not read), a fresh
    storage session opens, and the dead worker's slots come back within the README's bound."""
    with KVTierClient(daemon.address) as c:
        c.create_pool("glm-5.2", num_layers=4, size_tokens=4096, pool_id="main")
        path = c.attach_socket()
        free = c.describe_pool("main").free_pages
        worker = start_worker(daemon.address, "main", 1024)
        try:
            flooders = [raw_session(path) for _ in range(8)]
            bad = json.dumps({"kind": "nope"}).encode()
            for s in flooders:
                s.setblocking(False)
                for _ in range(3000):
                    try:
                        s.send(bad)
                    except BlockingIOError:
                        break
            time.sleep(0.3)
            kill_and_time_recovery(c, "main", worker, free)
            with c.storage_session(timeout=SESSION_END_BOUND_S + MARGIN_S) as ss:
                assert ss.session_id
            for s in flooders:  # requests go on coming, replies pile up unread: the daemon closes it
                assert flood_until_dropped(s, bad, SESSION_END_BOUND_S + MARGIN_S)
                s.close()
        finally:
            worker.kill()
            worker.wait()
        assert c.stats().attach_sessions == 0


class _StalledPeer:
    """A pull into pool ``dst`` of the daemon at ``address`` from a fake peer whose ReadPages stalls:
    the peer's layout is the daemon's own pool ``src`` (its daemon id left out, so the pull does not
    take it for its own daemon and copy in process), and its ReadPages waits until :meth:`close`.
    The pull holds ``dst`` exclusive from its checks until its deadline (README "Concurrency").
    :attr:`pulls` holds its thread once the pull is inside ReadPages."""

    def __init__(self, address: str, dst: str, src: str, src_pages: list[int], dst_pages: list[int],
                 deadline: float) -> None:
        from concurrent import futures

        import grpc

        from kvtier.v1 import transfer_pb2_grpc

        real = transfer_pb2_grpc.TransferServiceStub(grpc.insecure_channel(address))
        self.release, reading = threading.Event(), threading.Event()
        release = self.release

        class Peer(transfer_pb2_grpc.TransferServiceServicer):
            def GetTransferLayout(self, request, context):
                msg = real.GetTransferLayout(request, timeout=30)
                msg.daemon_id = ""
                return msg

            def ReadPages(self, request, context):
                reading.set()
                release.wait(120)
                return iter(())

        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        transfer_pb2_grpc.add_TransferServiceServicer_to_server(Peer(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

        def pull() -> None:
            try:
                with KVTierClient(address, timeout=deadline) as cc:
                    cc.pull_kv(dst, f"127.0.0.1:{port}", src, src_pages=src_pages, dst_pages=dst_pages, transport="grpc")
            except Exception:  # noqa: BLE001 - it ends by its deadline (ABORTED or DEADLINE_EXCEEDED)
                pass

        self.pulls = [threading.Thread(target=pull, daemon=True)]
        self.pulls[0].start()
        assert reading.wait(60), "the pull never reached the peer's ReadPages"

    def close(self) -> None:
        self.release.set()
        self.server.stop(0)


def test_a_pool_held_busy_delays_neither_other_pools_session_ends_nor_attaches(daemon):
    """Scenario (issue: adversarial test 10): pool X is held exclusive by a PullKV from a peer that
    stalls in ReadPages (until the pull's 15 s deadline, which outlasts the checks below: at most ~11 s
    on a loaded machine; two crossed pulls on one daemon did this before they copied in process) and
    4 attaches to X are sent. Before the fix each of
    them held one of the channel's 4 workers on X's lock, so a SIGKILLed worker of pool C got its
    slots back only when the pulls ended, and every attach waited. Now an attach of a busy pool is
    answered UNAVAILABLE (retryable, naming the pool) after a short bounded wait, C's session ends
    within the README's bound, and an attach of C is answered at once."""
    with KVTierClient(daemon.address, timeout=60) as c:
        c.create_pool("glm-5.2", num_layers=4, size_tokens=4096, pool_id="C")
        for pool in ("X", "Y"):
            c.create_pool("glm-5.2", num_layers=4, size_tokens=2048, pool_id=pool)
        pages = {pool: sorted(set((c.allocate_slots(pool, 16 * PAGE) // PAGE).tolist())) for pool in ("X", "Y")}
        free = c.describe_pool("C").free_pages
        worker = start_worker(daemon.address, "C", 512)
        try:
            peer = _StalledPeer(daemon.address, "X", "Y", pages["Y"][:8], pages["X"][8:], deadline=15.0)
            pulls = peer.pulls
            busy: list[BaseException] = []

            def attach_x() -> None:
                try:
                    with KVTierClient(daemon.address) as cc:
                        cc.attach("X", timeout=2.0).detach()
                except Exception as e:  # noqa: BLE001 - the test checks what came back
                    busy.append(e)

            attaches = [threading.Thread(target=attach_x) for _ in range(4)]
            for t in attaches:
                t.start()
            time.sleep(0.5)
            kill_and_time_recovery(c, "C", worker, free)
            with c.attach("C", timeout=SESSION_END_BOUND_S + MARGIN_S) as ap:
                assert ap.allocate_slots(PAGE).numel() == PAGE
            for t in attaches:
                t.join(30)
            assert pulls[0].is_alive(), "the pull ended early: X was not busy throughout"
            assert len(busy) == 4 and all(isinstance(e, UnavailableError) for e in busy), busy
            assert all("pool 'X' is busy" in str(e) and "retry" in str(e) for e in busy), busy
        finally:
            worker.kill()
            worker.wait()
        for t in pulls:
            t.join(60)
        peer.close()
        with c.attach("X", timeout=10) as ax:  # free again: it attaches
            assert ax.pool_id == "X"
    assert "Bad file descriptor" not in daemon.log_tail(2000)


@pytest.fixture()
def capped(tmp_path):
    """A daemon with two tenants, a per-tenant session cap of 4 and a staging budget of 8 MiB a tenant."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = "team-a"\n"{TOKEN_B}" = "team-b"\n')
    os.chmod(tokens, 0o600)
    config = tmp_path / "config.toml"
    config.write_text('attach_sessions_per_tenant = 4\nattach_staging_bytes = "8MiB"\n'
                      'attach_staging_tenant_bytes = "8MiB"\n')
    with DaemonProcess(extra_args=[*DAEMON_ARGS, "--auth-tokens", str(tokens), "--config", str(config)]) as d:
        with KVTierClient(d.address, token=TOKEN_A) as a:
            a.create_pool("glm-5.2", num_layers=2, size_tokens=256, pool_id="p")
        yield d


def test_one_tenant_cannot_take_every_session(capped):
    """Scenario (issue: adversarial test 13): tenant B opens sessions until refused. Before the fix
    it could open all 1024 of the daemon and tenant A's attach then failed with a silent close. Now
    B's 5th is RESOURCE_EXHAUSTED naming the per-tenant cap, A still attaches and opens a storage
    session, and B's next session opens once one of its own has ended."""
    with KVTierClient(capped.address, token=TOKEN_B) as b, KVTierClient(capped.address, token=TOKEN_A) as a:
        held = [b.storage_session() for _ in range(4)]
        with pytest.raises(ResourceExhaustedError, match="attach_sessions_per_tenant"):
            b.storage_session()
        with a.attach("p") as ap, a.storage_session() as ss:
            assert ap.tenant == "team-a" and ss.session_id
        held.pop().close()
        deadline = time.monotonic() + SESSION_END_BOUND_S + MARGIN_S
        while True:  # the closed session's end is seen by the daemon shortly after
            try:
                held.append(b.storage_session())
                break
            except ResourceExhaustedError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        for s in held:
            s.close()


def test_staging_memory_of_a_tenant_is_budgeted(capped):
    """Scenario (issue: adversarial test 13): every session of a tenant asked for its full staging
    allowance, and the daemon made all of it (unaccounted). Now the tenant's buffers together stay
    within ``attach_staging_tenant_bytes``: past it RESOURCE_EXHAUSTED naming the budget, and the
    bytes come back when a session ends."""
    mib = 1 << 20
    with KVTierClient(capped.address, token=TOKEN_B) as b:
        first, second = b.storage_session(), b.storage_session()
        assert first.buffer(6 * mib).nbytes == 6 * mib
        with pytest.raises(ResourceExhaustedError, match="attach_staging_tenant_bytes"):
            second.buffer(4 * mib)
        assert second.buffer(2 * mib).nbytes == 2 * mib  # what is left of the budget
        first.close()
        deadline = time.monotonic() + SESSION_END_BOUND_S + MARGIN_S
        while True:
            try:
                again = second.buffer(4 * mib)
                break
            except ResourceExhaustedError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert again.nbytes == 4 * mib
        second.close()


def test_connections_that_never_speak_cannot_starve_handshakes(daemon):
    """Scenario (issue: adversarial test 18): with no token a process opens connections that never
    send a first message. Before the fix 1024 of them filled the channel for 10 s each. Now at most
    64 connections wait in their handshake: a new one closes the oldest idle one, so the first idle
    connection is closed by the daemon (long before the 10 s handshake sweep) while a worker still
    attaches."""
    with KVTierClient(daemon.address) as c:
        c.create_pool("glm-5.2", num_layers=2, size_tokens=256, pool_id="p")
        path = c.attach_socket()
        idle = [raw_connect(path) for _ in range(200)]
        try:
            with c.attach("p", timeout=10) as ap:
                assert ap.allocate_slots(PAGE).numel() == PAGE
            assert closed_by_daemon(idle[0], 5.0)  # dropped for a newer one (the sweep would take 10 s)
            assert not closed_by_daemon(idle[-1], 0.2)  # the newest still waits for its first message
        finally:
            for s in idle:
                s.close()


def test_a_sessions_lease_is_its_own(daemon):
    """Scenario (issue: adversarial test 05): session s1 takes a lease (LoadPrefix); another session
    s2 of the same pool and a plain client of the same tenant then stored and released it, freeing
    its fresh pages while s1 still wrote them. Now both get NOT_FOUND with exactly the answer of an
    unknown lease, the lease stays open, and s1 stores and releases it itself."""
    with KVTierClient(daemon.address) as c:
        c.create_pool("glm-5.2", num_layers=2, size_tokens=1024, pool_id="p")
        with c.attach("p") as s1, c.attach("p") as s2:
            keys = [b"k" * 16, b"j" * 16]
            lease = s1.load_prefix(keys)
            with pytest.raises(NotFoundError) as unknown:
                c.release_prefix(dataclasses.replace(lease, lease_id="0" * 32))
            for attempt in (lambda: s2.release_prefix(lease), lambda: c.release_prefix(lease),
                            lambda: s2.store_prefix(lease, keys[:1], lease.slots[:PAGE]),
                            lambda: c.store_prefix(lease, keys[:1], lease.slots[:PAGE])):
                with pytest.raises(NotFoundError) as e:
                    attempt()
                assert str(e.value) == str(unknown.value)
            assert c.tier_stats("p").device["open_leases"] == 1
            assert s1.store_prefix(lease, keys, lease.slots, release=True) == 2
            assert c.tier_stats("p").device["open_leases"] == 0


@pytest.mark.parametrize("bad", [
    '{"kind":"release_prefix","id":1,"pool_id":"p","lease_id":' + "9" * 5000 + '}',  # past Python's 4,300 digits
    '{"kind":"release_prefix","id":1,"pool_id":"p","lease_id":"x","n":-' + "1" * 4301 + '}',
    '{"kind":"release_prefix","id":1,"pool_id":"p","lease_id":NaN}',  # not JSON (Python's json takes it)
    '{"kind":"release_prefix","id":1,"pool_id":"p","lease_id":-Infinity}',
    '{"kind":"release_prefix","id":1,"pool_id":"p","lease_id":"\\ud800"}',  # a lone surrogate: no str
    '{"kind":"release_prefix","id":1,"pool_id":"p","lease_id":"x"',  # cut off
    '\xff\xfe',  # not UTF-8
])
def test_an_attach_message_that_does_not_decode_is_invalid_argument_and_the_session_lives(daemon, bad):
    """Scenario (issue 23, defect 5): a session sends a message whose JSON integer has more than the
    4,300 digits Python converts; the daemon answered nothing, logged an ERROR with a traceback and
    ended the session. Every message that does not decode (Python's own limits, NaN/Infinity,
    a lone surrogate, cut-off JSON, bytes that are not UTF-8) is answered INVALID_ARGUMENT, and the
    same session's next call is answered as usual (a prefix call in a storage session, which has
    no pool: FAILED_PRECONDITION; an ended session would see its connection closed instead)."""
    with KVTierClient(daemon.address) as c:
        path = c.attach_socket()
    s = raw_session(path)
    try:
        s.send(bad.encode("utf-8", "surrogatepass") if not bad.startswith("\xff") else b"\xff\xfe")
        reply, _ = recv_message(s, accept_fds=True)
        assert reply["error"]["code"] == "INVALID_ARGUMENT", reply
        assert "\n" not in reply["error"]["message"]
        send_message(s, {"kind": "release_prefix", "id": 2, "pool_id": "p", "lease_id": "0" * 32})
        reply, _ = recv_message(s, accept_fds=True)
        assert reply["error"]["code"] == "FAILED_PRECONDITION", reply
        assert reply["id"] == 2
    finally:
        s.close()


MAX_ERROR_CHARS = 1024  # docs/guides/attach.md, Limits: an error reply's message at most
BIG = MAX_MESSAGE_BYTES - 200  # a message that fits, but whose every byte an error reply would repeat
SO_SNDBUFFORCE = 32  # Linux: past net.core.wmem_max (needs CAP_NET_ADMIN)


def send_big(s: socket.socket, data: bytes) -> None:
    """Send ``data`` (up to just past :data:`MAX_MESSAGE_BYTES`) as one message: a SOCK_SEQPACKET message
    must fit the sender's buffer, which any user may raise to net.core.wmem_max (4 MiB on many hosts) and
    root past it (SO_SNDBUFFORCE); the suite runs as root, so failing to is a failure, not a skip."""
    for opt in (socket.SO_SNDBUF, SO_SNDBUFFORCE):
        with contextlib.suppress(PermissionError):
            s.setsockopt(socket.SOL_SOCKET, opt, 4 * len(data))
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) > 2 * len(data):
            break
    else:
        pytest.fail("could not raise SO_SNDBUF past net.core.wmem_max: the suite runs as root (CAP_NET_ADMIN, "
                    "as CI does) and needs it")
    s.send(data)


def send_fds_along(s: socket.socket, data: bytes, n: int) -> None:
    r, w = os.pipe()
    try:
        socket.send_fds(s, [data], [r] * n)
    finally:
        os.close(r)
        os.close(w)


MALFORMED = {
    "empty": lambda s: s.send(b""),
    "a descriptor and no bytes": lambda s: send_fds_along(s, b"", 1),
    "a descriptor with a request": lambda s: send_fds_along(
        s, b'{"kind":"release_prefix","id":1,"pool_id":"p","lease_id":"x"}', 1),
    "more descriptors than allowed": lambda s: send_fds_along(s, b"{}", MAX_FDS + 1),
    "longer than allowed": lambda s: send_big(s, b" " * (MAX_MESSAGE_BYTES + 1)),
    "an unknown kind the error would quote": lambda s: send_big(s, json.dumps({"kind": "k" * BIG}).encode()),
    "a staging size the error would quote": lambda s: send_big(s, json.dumps({"kind": "staging",
                                                                              "nbytes": "n" * BIG}).encode()),
    "an id too large to echo": lambda s: send_big(s, json.dumps({"kind": "release_prefix", "id": "i" * BIG,
                                                                 "lease_id": "0" * 32}).encode()),
    "an id that is not an integer": lambda s: send_message(s, {"kind": "release_prefix", "id": [1],
                                                               "lease_id": "0" * 32}),
}


@pytest.fixture(scope="module")
def one_daemon():
    """One daemon for the rows of a table (each row opens a session of its own)."""
    with DaemonProcess(extra_args=DAEMON_ARGS) as d:
        yield d


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_an_empty_or_oversized_attach_message_is_invalid_argument_and_the_session_lives(one_daemon, name):
    """Scenario (security pass: a zero-length datagram): a session sent a message of zero bytes, which
    the daemon took for the connection's close: it answered nothing and ended the session. Its
    siblings: a message of only a descriptor, descriptors along a request, more than 16 descriptors,
    more than 1 MiB, and messages of almost 1 MiB whose error reply quoted them (an unknown kind, a
    bad staging size) or echoed them (a prefix call's id), so the reply did not fit in one message and
    the session ended without one. Each is answered INVALID_ARGUMENT in one line of at most 1,024
    characters, and the same session's next call is answered as usual (a prefix call in a storage
    session: FAILED_PRECONDITION)."""
    with KVTierClient(one_daemon.address) as c:
        path = c.attach_socket()
    s = raw_session(path)
    try:
        MALFORMED[name](s)
        reply, fds = recv_message(s, accept_fds=True)
        assert reply["error"]["code"] == "INVALID_ARGUMENT" and not fds, reply
        message = reply["error"]["message"]
        assert "\n" not in message and len(message) <= MAX_ERROR_CHARS, message[:200]
        assert "id" not in reply or reply["id"] is None
        send_message(s, {"kind": "release_prefix", "id": 2, "pool_id": "p", "lease_id": "0" * 32})
        reply, _ = recv_message(s, accept_fds=True)
        assert reply["error"]["code"] == "FAILED_PRECONDITION", reply
        assert reply["id"] == 2
    finally:
        s.close()


def test_an_empty_first_message_is_invalid_argument_and_the_connection_closes(daemon):
    """The first message of a connection must be an attach or storage request: an empty one is
    answered INVALID_ARGUMENT and the connection closed (as every bad first message), not closed
    without a word; a peer that closes without sending anything is still seen as gone at once."""
    with KVTierClient(daemon.address) as c:
        path = c.attach_socket()
    s = raw_connect(path)
    try:
        s.send(b"")
        reply, _ = recv_message(s, accept_fds=True)
        assert reply["error"]["code"] == "INVALID_ARGUMENT", reply
        assert closed_by_daemon(s, 5.0)
    finally:
        s.close()
