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
