"""The attach channel: the daemon's side socket for local attach (wire format: ``kvtier.attach_wire``).

gRPC can neither pass file descriptors nor tell who the peer is, so beside its gRPC unix socket the
daemon listens on ``<socket>.attach`` (``AF_UNIX``, ``SOCK_SEQPACKET``, mode 0600 in the same private
directory). Only a daemon on a unix socket has one: over TCP there is no peer on this machine to
map memory into, and a TCP client cannot attach.

Threads: one selector thread (``kvtier-attach``) accepts connections and watches every open one;
it never blocks on a message or a lock. A readable connection is handed to a small worker pool
(``kvtier-attach-work``), which reads its one message (or the EOF), calls the domain
(:class:`~kvtier.server.daemon.attach.AttachService`, :meth:`~kvtier.server.daemon.core.Daemon.end_session`)
and answers; the connection is then watched again. So a connection's messages are handled one at
a time, in order, and the end of a session (EOF or ECONNRESET: the worker detached, exited,
crashed or was SIGKILLed) is seen at once; its slots and leases go back as soon as its pool's lock
is free. A connection that has not sent its first message within :data:`HANDSHAKE_SECONDS` is closed.

Errors go back as ``{"error": {"code", "message"}}`` with the status code the gRPC side would use
for the same domain error (the one mapping, :func:`kvtier.server.service.errors.status_code_for`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvtier.attach_wire import WireError, peer_credentials, recv_message, send_message
from kvtier.server.daemon.core import Daemon
from kvtier.server.daemon.errors import InvalidArgument
from kvtier.server.daemon.sessions import AttachSession, PeerCredentials
from kvtier.server.service.errors import status_code_for

log = logging.getLogger("kvtier.attach")

HANDSHAKE_SECONDS = 10.0
SEND_TIMEOUT_SECONDS = 10.0
MAX_CONNECTIONS = 1024
WORKERS = 4


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: PeerCredentials
    deadline: float
    session: AttachSession | None = None
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def error_reply(exc: BaseException) -> dict[str, Any]:
    """The error message for ``exc``: the gRPC status code name the same error maps to."""
    code = status_code_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("attach: internal error", exc_info=exc)
        return {"error": {"code": "INTERNAL", "message": f"internal error: {type(exc).__name__}"}}
    return {"error": {"code": code.name, "message": str(exc)}}


class AttachChannel:
    """The listening attach socket of one daemon and its sessions' connections.

    Args:
        daemon: the daemon domain.
        path: where to listen (``<grpc socket>.attach``); a stale socket there is replaced, a live one refused.

    Raises:
        OSError: the socket cannot be bound.
    """

    def __init__(self, daemon: Daemon, path: str | Path) -> None:
        self.daemon = daemon
        self.path = Path(path)
        if self.path.exists() or self.path.is_symlink():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                probe.connect(str(self.path))
            except OSError:
                self.path.unlink()
            else:
                raise OSError(f"{self.path} is in use by a running daemon")
            finally:
                probe.close()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)
        try:
            self._listener.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._rewatch: queue.SimpleQueue[_Conn] = queue.SimpleQueue()
        self._conns: set[_Conn] = set()
        self._conns_lock = threading.Lock()  # level 1: set operations only
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kvtier-attach-work")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-attach", daemon=True)
        daemon.attach_socket = str(self.path)

    def start(self) -> None:
        """Start accepting attaches."""
        self._thread.start()

    # ----- selector thread ------------------------------------------------------------------
    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=1.0):
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                else:
                    conn: _Conn = key.data
                    self._sel.unregister(conn.sock)
                    self._pool.submit(self._serve, conn)
            while True:
                try:
                    conn = self._rewatch.get_nowait()
                except queue.Empty:
                    break
                if not conn.closed:
                    self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            now = time.monotonic()
            with self._conns_lock:
                late = [c for c in self._conns if c.session is None and c.deadline < now and not c.closed]
            for conn in late:
                with contextlib.suppress(KeyError, ValueError):
                    self._sel.unregister(conn.sock)
                log.info("attach: pid %d sent no attach request within %.0f s; closed", conn.peer.pid, HANDSHAKE_SECONDS)
                self._close(conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("attach: accept failed: %s", e)
                return
            with self._conns_lock:
                full = len(self._conns) >= MAX_CONNECTIONS
            if full:
                log.warning("attach: %d connections open; refusing another", MAX_CONNECTIONS)
                sock.close()
                continue
            pid, uid, gid = peer_credentials(sock)
            sock.settimeout(SEND_TIMEOUT_SECONDS)
            conn = _Conn(sock, PeerCredentials(pid, uid, gid), time.monotonic() + HANDSHAKE_SECONDS)
            with self._conns_lock:
                self._conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)

    # ----- workers --------------------------------------------------------------------------
    def _serve(self, conn: _Conn) -> None:
        """Read and answer one message of ``conn`` (or see its end); then watch it again."""
        try:
            try:
                msg = recv_message(conn.sock)
            except (WireError, OSError) as e:
                msg = None if isinstance(e, OSError) else e
            if msg is None:
                self._ended(conn, "its connection closed")
                return
            if isinstance(msg, WireError):
                self._answer(conn, error_reply(InvalidArgument(str(msg))), close=conn.session is None)
                return
            request, _ = msg
            if conn.session is None:
                self._handshake(conn, request)
            else:
                self._request(conn, request)
        except Exception:  # noqa: BLE001 - one connection's failure never stops the channel
            log.exception("attach: serving pid %d failed", conn.peer.pid)
            self._ended(conn, "the channel failed serving it")
        finally:
            if not conn.closed:
                self._rewatch.put(conn)
                self._wake()

    def _handshake(self, conn: _Conn, request: dict[str, Any]) -> None:
        kind = request.get("kind", "attach")
        if kind not in ("attach", "storage"):
            self._answer(conn, error_reply(InvalidArgument("the first message of a connection must be an attach or a "
                                                           "storage request")), close=True)
            return
        try:
            if kind == "attach":
                grant = self.daemon.attach.attach(conn.peer, request)
            else:
                grant = self.daemon.attach.open_storage(conn.peer, request)
        except Exception as e:  # noqa: BLE001 - mapped to a code like a gRPC call's error
            self._answer(conn, error_reply(e), close=True)
            return
        conn.session = grant.session
        grant.session.close_hook = lambda: self._close_later(conn)
        try:
            send_message(conn.sock, grant.reply, grant.fds)
        except (OSError, WireError) as e:
            log.info("attach: could not answer pid %d (%s)", conn.peer.pid, e)
            self._ended(conn, "its connection failed")

    def _request(self, conn: _Conn, request: dict[str, Any]) -> None:
        assert conn.session is not None
        kind = request.get("kind")
        if kind == "staging":
            try:
                reply, shm = self.daemon.attach.staging(conn.session, request)
            except Exception as e:  # noqa: BLE001
                self._answer(conn, error_reply(e))
                return
            try:
                send_message(conn.sock, reply, [shm.fd])
            except (OSError, WireError):
                self._ended(conn, "its connection failed")
            return
        self._answer(conn, error_reply(InvalidArgument(f"unknown request kind {kind!r} on an attached connection; "
                                                       f"known: 'staging'")))

    def _answer(self, conn: _Conn, reply: dict[str, Any], *, close: bool = False) -> None:
        try:
            send_message(conn.sock, reply)
        except (OSError, WireError):
            close = True
        if close:
            self._ended(conn, "refused")

    def _ended(self, conn: _Conn, reason: str) -> None:
        session = conn.session
        self._close(conn)
        if session is not None:
            self.daemon.end_session(session, reason)

    def _close(self, conn: _Conn) -> None:
        with conn.lock:
            if conn.closed:
                return
            conn.closed = True
        with self._conns_lock:
            self._conns.discard(conn)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _close_later(self, conn: _Conn) -> None:
        """The daemon ended the session itself (its pool was deleted): close the connection (the
        worker sees it end), from whichever thread asked."""
        with conn.lock:
            if conn.closed:
                return
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)  # the selector sees EOF and closes it

    # ----- shutdown -------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop accepting, end every session (their slots are freed, leases released), close the
        sockets and remove the socket file."""
        self._stop.set()
        self._wake()
        self._thread.join(5.0)
        self._pool.shutdown(wait=True)
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            self._ended(conn, "the daemon is stopping")
        for s in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                s.close()
        self._sel.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.daemon.attach_socket = ""
