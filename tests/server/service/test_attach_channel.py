"""The attach channel in process: its connection caps answer RESOURCE_EXHAUSTED, and a handshake whose
connection closed meanwhile leaves no session behind (README "Local attach", "Limits").

A real in-process ``Daemon`` (CPU) and a real ``AttachChannel`` on a unix socket in a temporary
directory; the caps are lowered for the test (module constants the channel reads at each accept).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time

import pytest

from kvtier.attach_wire import PROTOCOL_VERSION, recv_message, send_message
from kvtier.client.errors import ResourceExhaustedError
from kvtier.server.daemon.config import DaemonConfig
from kvtier.server.daemon.core import Daemon
from kvtier.server.daemon.sessions import PeerCredentials
from kvtier.server.service import attach_channel
from kvtier.server.service.attach_channel import AttachChannel, _Conn


@pytest.fixture()
def channel(tmp_path):
    os.chmod(tmp_path, 0o700)
    d = Daemon(DaemonConfig(device="cpu"))
    ch = AttachChannel(d, tmp_path / "kvtier.sock.attach")
    ch.start()
    try:
        yield ch
    finally:
        ch.stop()
        d.close()


def connect(ch: AttachChannel) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(str(ch.path))
    return s


def storage_session(ch: AttachChannel) -> socket.socket:
    s = connect(ch)
    send_message(s, {"kind": "storage", "version": PROTOCOL_VERSION, "token": None})
    reply, _ = recv_message(s)
    assert "session_id" in reply, reply
    return s


def test_a_connection_past_the_cap_is_answered_resource_exhausted(channel, monkeypatch):
    """Scenario (issue: adversarial test 13): every connection the channel may hold is open. Before
    the fix one more was closed without an answer (the client saw UNAVAILABLE "closed the attach
    connection without an answer"); now it reads RESOURCE_EXHAUSTED naming the cap, then the close."""
    from kvtier.client.attach import open_channel  # the client's own handshake

    monkeypatch.setattr(attach_channel, "MAX_CONNECTIONS", 3)
    held = [storage_session(channel) for _ in range(3)]
    with pytest.raises(ResourceExhaustedError, match="3 connections open"):  # as a client opens a session
        open_channel(str(channel.path), {"kind": "storage", "version": PROTOCOL_VERSION, "token": None}, 10)
    extra = connect(channel)  # the answer comes whether or not the peer's request went in first
    with contextlib.suppress(BrokenPipeError):
        send_message(extra, {"kind": "storage", "version": PROTOCOL_VERSION, "token": None})
    reply, _ = recv_message(extra)
    assert reply["error"]["code"] == "RESOURCE_EXHAUSTED"
    assert recv_message(extra) is None  # then closed
    for s in held + [extra]:
        s.close()


def test_handshakes_past_their_cap_close_the_oldest_idle_connection(channel, monkeypatch):
    """Scenario (issue: adversarial test 18): connections that never send a first message. Past the
    handshake cap the oldest idle one is closed for the new one; a connection that speaks still
    gets its session."""
    monkeypatch.setattr(attach_channel, "MAX_HANDSHAKES", 2)
    idle = [connect(channel) for _ in range(2)]
    time.sleep(0.2)  # accepted
    speaker = storage_session(channel)  # the third handshake: the oldest idle one makes room
    assert recv_message(idle[0]) is None  # closed by the daemon
    idle[1].settimeout(0.2)
    with pytest.raises(TimeoutError):
        recv_message(idle[1])  # still waits for its first message
    for s in idle + [speaker]:
        s.close()


def test_a_handshake_whose_connection_closed_meanwhile_leaves_no_session(channel):
    """Scenario (issue: adversarial test 10, side effect): the connection of a handshake in progress
    was closed (before the fix: by the 10 s handshake sweep while a worker served it) and the
    session was still created on the closed socket, never to end. Now it is ended at once."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn = _Conn(a, PeerCredentials(os.getpid(), os.getuid(), os.getgid()), time.monotonic() + 10)
    conn.closed = True
    channel._handshake(conn, {"kind": "storage", "version": PROTOCOL_VERSION, "token": None})
    deadline = time.monotonic() + 10
    while len(channel.daemon.sessions) or channel.daemon.sessions.started == 0:
        assert time.monotonic() < deadline, "the session of a closed connection was not ended"
        time.sleep(0.01)
    assert conn.session is None and channel.daemon.sessions.ended == 1
    a.close()
    b.close()


def test_a_connection_past_the_handshake_cap_is_retried_by_the_client(channel, monkeypatch):
    """Regression (the "handshakes in progress; retry" refusal): with every handshake slot taken by a
    handshake a worker is serving, one more connection is refused RESOURCE_EXHAUSTED. It changed
    nothing, so the reply now says so (``unchanged``) and ``open_channel`` retries it within its
    timeout: once the held handshake ends, the session opens. Before: ResourceExhaustedError at once."""
    import threading

    from kvtier.client.attach import open_channel

    monkeypatch.setattr(attach_channel, "MAX_HANDSHAKES", 1)
    serving, release, refused = threading.Event(), threading.Event(), threading.Event()
    handshake, refuse = channel._handshake, channel._refuse

    def held_handshake(conn, request):
        if not serving.is_set():  # the first one is held until the refusal was sent
            serving.set()
            release.wait(30)
        handshake(conn, request)

    def noted_refuse(sock, message, *args, **kwargs):
        refuse(sock, message, *args, **kwargs)
        refused.set()

    monkeypatch.setattr(channel, "_handshake", held_handshake)
    monkeypatch.setattr(channel, "_refuse", noted_refuse)
    first = connect(channel)
    send_message(first, {"kind": "storage", "version": PROTOCOL_VERSION, "token": None})
    assert serving.wait(10)
    outcome: dict[str, object] = {}

    def second() -> None:
        try:
            outcome["reply"] = open_channel(str(channel.path), {"kind": "storage", "version": PROTOCOL_VERSION,
                                                                "token": None}, 30)
        except Exception as e:  # noqa: BLE001 - the test reports it
            outcome["error"] = e

    t = threading.Thread(target=second, daemon=True)
    t.start()
    try:
        assert refused.wait(10) or not t.is_alive(), "the second connection was never refused"
    finally:
        release.set()
    t.join(30)
    assert not t.is_alive()
    assert "error" not in outcome, f"open_channel failed: {outcome.get('error')}"
    sock, reply, fds = outcome["reply"]
    assert "session_id" in reply, reply
    assert fds == []
    first_reply, _ = recv_message(first)
    assert "session_id" in first_reply, first_reply
    assert first_reply["session_id"] != reply["session_id"]
    for s in (first, sock):
        s.close()


def test_the_handshake_cap_refusal_says_it_changed_nothing():
    """The reply the channel sends for the handshake cap is marked ``unchanged``; the connection cap's
    (sessions last long) and other errors are not."""
    from kvtier.server.daemon.errors import Busy, ResourceExhausted

    marked = ResourceExhausted("handshakes")
    marked.unchanged = True
    assert attach_channel.error_reply(marked) == {"error": {"code": "RESOURCE_EXHAUSTED", "message": "handshakes",
                                                           "unchanged": True}}
    assert attach_channel.error_reply(ResourceExhausted("full")) == {"error": {"code": "RESOURCE_EXHAUSTED",
                                                                               "message": "full"}}
    assert attach_channel.error_reply(Busy("claimed"))["error"]["unchanged"] is True


# ----- the caller check of prefix calls (attack pass 8, A8-6) -------------------------------------

POOL_PAGES = 8


@pytest.fixture()
def attached(tmp_path):
    """An in-process daemon with pool ``p`` (8 pages of 64 tokens), its attach channel, and a raw
    attached connection to ``p``."""
    from kvtier.server.daemon.pools import PoolRequest
    from kvtier.server.daemon.tenants import Caller

    os.chmod(tmp_path, 0o700)
    d = Daemon(DaemonConfig(device="cpu"))
    caller = Caller("default")
    d.pools.create(caller, PoolRequest(pool_id="p", preset="glm-5.2", num_layers=2, size_tokens=POOL_PAGES * 64))
    ch = AttachChannel(d, tmp_path / "kvtier.sock.attach")
    ch.start()
    s = connect(ch)
    try:
        send_message(s, {"kind": "attach", "version": PROTOCOL_VERSION, "token": None, "pool_id": "p"})
        reply, fds = recv_message(s, accept_fds=True)
        for fd in fds:
            os.close(fd)  # the pool's memory: not needed here
        assert "session_id" in reply, reply
        yield d, caller, s
    finally:
        s.close()
        ch.stop()
        d.close()


def _keys(n: int, seed: int) -> list[bytes]:
    from kvtier.page_keys import page_keys
    return page_keys(list(range(seed * 10000, seed * 10000 + n * 64)), 64)


def _call(s: socket.socket, message: dict) -> dict:
    send_message(s, message)
    reply, _ = recv_message(s)
    return reply


def _free_pages(d, caller) -> int:
    with d.pools.locked(caller, "p", exclusive=False) as e:
        return e.allocator.free_pages


def _while_the_pool_is_held(d, caller, s: socket.socket, message: dict, hold_s: float) -> dict:
    """Send ``message`` while the test holds pool ``p``'s lock for ``hold_s`` seconds (past the
    message's ``timeout_s``); returns the reply, read once the lock is free."""
    with d.pools.locked(caller, "p", exclusive=True):
        send_message(s, message)
        time.sleep(hold_s)
    reply, _ = recv_message(s)
    return reply


def test_a_store_prefix_whose_timeout_ran_out_while_it_waited_stores_nothing(attached):
    """Attack pass 8, A8-6: a store_prefix(release=True) told DeadlineExceededError by the client was
    applied once the pool was free (its keys cached, its lease released: a retry was NOT_FOUND).
    Its message now carries the client's timeout: the call answers CANCELLED, the 2 keys are not
    cached, and the lease is still open (a store of it then adopts its 2 pages)."""
    from kvtier.attach_wire import encode_keys

    d, caller, s = attached
    keys = _keys(2, seed=1)
    load = _call(s, {"kind": "load_prefix", "id": 1, "keys": encode_keys(keys), "total_tokens": None})
    assert "lease_id" in load, load
    late = _while_the_pool_is_held(d, caller, s, {"kind": "store_prefix", "id": 2, "lease_id": load["lease_id"],
                                                  "keys": encode_keys(keys), "slots": load["slots"],
                                                  "release": True, "timeout_s": 0.2}, hold_s=0.6)
    assert late["error"]["code"] == "CANCELLED" and late["id"] == 2, late
    assert d.tiers.lookup(caller, "p", keys).tiers == []
    again = _call(s, {"kind": "store_prefix", "id": 3, "lease_id": load["lease_id"], "keys": encode_keys(keys),
                      "slots": load["slots"], "release": True})
    assert again == {"stored_pages": 2, "id": 3}


def test_a_load_prefix_whose_timeout_ran_out_while_it_waited_leaves_no_lease(attached):
    """A8-6, load: a load_prefix told DeadlineExceededError by the client took a lease of fresh
    pages that nobody knew of until the session ended. Now it answers CANCELLED and all 8 pages of
    the pool stay free; the session holds no lease."""
    from kvtier.attach_wire import encode_keys

    d, caller, s = attached
    assert _free_pages(d, caller) == POOL_PAGES
    late = _while_the_pool_is_held(d, caller, s, {"kind": "load_prefix", "id": 1, "keys": encode_keys(_keys(4, 2)),
                                                  "total_tokens": None, "timeout_s": 0.2}, hold_s=0.6)
    assert late["error"]["code"] == "CANCELLED", late
    assert _free_pages(d, caller) == POOL_PAGES
    (session,) = d.sessions.all()
    assert session.leases == set()


def test_a_release_prefix_whose_timeout_ran_out_while_it_waited_keeps_the_lease(attached):
    """A8-6, release: a release_prefix past its timeout leaves the lease open (a later release ends it)."""
    from kvtier.attach_wire import encode_keys

    d, caller, s = attached
    load = _call(s, {"kind": "load_prefix", "id": 1, "keys": encode_keys(_keys(3, 3)), "total_tokens": None})
    assert _free_pages(d, caller) == POOL_PAGES - 3
    late = _while_the_pool_is_held(d, caller, s, {"kind": "release_prefix", "id": 2, "lease_id": load["lease_id"],
                                                  "timeout_s": 0.2}, hold_s=0.6)
    assert late["error"]["code"] == "CANCELLED", late
    assert _free_pages(d, caller) == POOL_PAGES - 3
    assert _call(s, {"kind": "release_prefix", "id": 3, "lease_id": load["lease_id"]}) == {"id": 3}
    assert _free_pages(d, caller) == POOL_PAGES


@pytest.mark.parametrize("raw", [b'"2"', b"true", b"0", b"-1", b"1e400", b"-1e400", b"100000000.5", b"[1]"])
def test_a_bad_timeout_is_invalid_argument_and_the_session_lives(attached, raw):
    """A8-6: ``timeout_s`` must be a finite number of seconds above 0 and at most 1e8 (JSON's 1e400
    reads as infinity); anything else is INVALID_ARGUMENT, nothing changes, and the session goes on
    (a load without a timeout, as an older client sends it, then works)."""
    from kvtier.attach_wire import encode_keys

    d, caller, s = attached
    s.send(b'{"kind": "load_prefix", "id": 1, "keys": ["00"], "total_tokens": null, "timeout_s": ' + raw + b"}")
    reply, _ = recv_message(s)
    assert reply["error"]["code"] == "INVALID_ARGUMENT" and "timeout_s" in reply["error"]["message"], reply
    assert _free_pages(d, caller) == POOL_PAGES
    ok = _call(s, {"kind": "load_prefix", "id": 2, "keys": encode_keys(_keys(1, 4)), "total_tokens": None})
    assert "lease_id" in ok and _free_pages(d, caller) == POOL_PAGES - 1


def test_a_store_prefix_counts_its_timeout_from_when_the_client_sent_it(attached):
    """Attack pass 9, A9-1: the daemon counted ``timeout_s`` from when a worker read the message, so
    a store_prefix that waited unread (behind handshakes holding the channel's workers) past the
    client's timeout was applied seconds after the client was told DeadlineExceededError. The client
    now sends ``sent_at`` (its monotonic clock, the daemon's too on one host): a message sent 5 s ago
    with a 2 s timeout is CANCELLED at once, stores nothing and keeps its lease; the same store sent
    now is applied."""
    import time

    from kvtier.attach_wire import encode_keys

    d, caller, s = attached
    keys = _keys(2, seed=9)
    load = _call(s, {"kind": "load_prefix", "id": 1, "keys": encode_keys(keys), "total_tokens": None})
    store = {"kind": "store_prefix", "lease_id": load["lease_id"], "keys": encode_keys(keys), "slots": load["slots"],
             "release": True, "timeout_s": 2.0}
    late = _call(s, {**store, "id": 2, "sent_at": time.monotonic() - 5.0})
    assert late["error"]["code"] == "CANCELLED" and late["id"] == 2, late
    assert d.tiers.lookup(caller, "p", keys).tiers == []
    assert _call(s, {**store, "id": 3, "sent_at": time.monotonic()}) == {"stored_pages": 2, "id": 3}


def test_call_deadline_reads_sent_at_on_the_daemons_clock_only_when_it_can_be():
    """``sent_at`` shortens the deadline when it lies on the daemon's clock; one that cannot (after
    the receipt: another clock) is ignored; a bad one is INVALID_ARGUMENT."""
    from kvtier.server.daemon.attach import SENT_AT_SLACK_S, call_deadline
    from kvtier.server.daemon.errors import InvalidArgument

    received = 1000.0
    assert call_deadline({"timeout_s": 2.0}, received) == 1002.0
    assert call_deadline({"timeout_s": 2.0, "sent_at": 999.5}, received) == 1001.5
    assert call_deadline({"timeout_s": 2.0, "sent_at": 997.5}, received) == 999.5  # passed before it was read
    assert call_deadline({"timeout_s": 2.0, "sent_at": 1000.0 + 2 * SENT_AT_SLACK_S}, received) == 1002.0
    assert call_deadline({"timeout_s": 2.0, "sent_at": 990.0}, received) == 992.0  # waited 10 s unread
    for bad in ("x", True, float("inf"), float("nan"), [1], 10**400, -(2**1030)):  # (A10-3: ints past a float)
        with pytest.raises(InvalidArgument, match="sent_at"):
            call_deadline({"timeout_s": 2.0, "sent_at": bad}, received)
