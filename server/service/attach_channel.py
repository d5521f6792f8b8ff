"""The attach channel: the daemon's side socket for local attach (wire format: ``kvtier.attach_wire``).

gRPC can neither pass file descriptors nor tell who the peer is, so beside its gRPC unix socket the
daemon listens on ``<socket>.attach`` (``AF_UNIX``, ``SOCK_SEQPACKET``, mode 0600 in the same private
directory). Only a daemon on a unix socket has one: over TCP there is no peer on this machine to
map memory into, and a TCP client cannot attach.

Threads: one selector thread (``kvtier-attach``) accepts connections and watches every open one;
it never blocks on a message or a lock. A readable connection is handed to a small worker pool
(``kvtier-attach-work``), which reads its one message (or the EOF), calls the domain
(:class:`~kvtier.server.daemon.attach.AttachService`) and answers without waiting (the sockets are
non-blocking: a peer whose socket buffer is full does not read its replies and is closed); the
connection is then watched again. A connection still in its handshake goes to a pool of its own
(``kvtier-attach-hello``): only an attach handshake waits on a pool's lock, shared, for at most
:data:`~kvtier.server.daemon.attach.POOL_LOCK_SECONDS` (then UNAVAILABLE), and a burst of them never
delays an established session's messages (attack pass 9, A9-8). So a
connection's messages are handled one at a time, in order, and the end of a session (EOF or
ECONNRESET: the worker detached, exited, crashed or was SIGKILLed) is seen at once and handed to
:class:`_SessionEnds` (:meth:`~kvtier.server.daemon.core.Daemon.end_session` in a thread of its pool):
its slots and leases go back as soon as its own pool's lock is free.

Limits: :data:`MAX_CONNECTIONS` open, :data:`MAX_HANDSHAKES` still in their handshake (past it the
oldest idle one is closed for the new one); a connection that has not sent its first message within
:data:`HANDSHAKE_SECONDS` is closed; sessions per tenant are capped by the registry
(``attach_sessions_per_tenant``).

Errors go back as ``{"error": {"code", "message"}}`` with the status code the gRPC side would use
for the same domain error (the one mapping, :func:`kvtier.server.service.errors.status_code_for`).

Metrics: each prefix call (also one refused because another runs on its connection) is timed into
the RPC histogram ``kvtier_rpc_duration_seconds`` like a gRPC call, under the method label of
:data:`ATTACH_METHODS` (``kvtier.attach/LoadPrefix``, ...), its reply's code (``CANCELLED`` when the
reply could not be sent) and the session's tenant; from the request's hand-off to its reply's send.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import selectors
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvtier.addresses import clear_stale_socket
from kvtier.attach_wire import (
    MAX_ERROR_CHARS, PREFIX_KINDS, WireError, peer_credentials, recv_message, send_message,
)
from kvtier.server.daemon.config import MAX_ATTACH_SESSIONS
from kvtier.server.daemon.core import Daemon
from kvtier.server.daemon.errors import InvalidArgument, ResourceExhausted
from kvtier.server.daemon.sessions import AttachSession, PeerCredentials
from kvtier.server.service.errors import status_code_for

log = logging.getLogger("kvtier.attach")

HANDSHAKE_SECONDS = 10.0
MAX_HANDSHAKES = 64
"""Connections still in their handshake (no first message answered yet) at most: past it the oldest
idle one (nothing sent yet) is closed for the new one, so connections that never speak cannot starve
the ones that do."""
MAX_CONNECTIONS = MAX_ATTACH_SESSIONS + MAX_HANDSHAKES
"""Open connections at most (every session plus the handshakes): one more is answered
RESOURCE_EXHAUSTED and closed."""
WORKERS = 4
HELLO_WORKERS = 4
"""Threads that serve connections in their handshake (an attach waits up to 20 ms for its pool's
shared lock, then UNAVAILABLE and the client retries): apart from the :data:`WORKERS` that read established sessions' messages, so a burst of
handshakes to a busy pool never delays another session's prefix call (attack pass 9, A9-8: up to 8 s)."""
CALL_THREADS = 16  # prefix calls of sessions (they wait for pool locks: never on the channel's workers)
LISTEN_BACKLOG = 512  # connections the kernel queues before the selector accepts them
ACCEPTS_PER_ROUND = 32
ATTACH_METHODS = {"load_prefix": "kvtier.attach/LoadPrefix", "store_prefix": "kvtier.attach/StorePrefix",
                  "release_prefix": "kvtier.attach/ReleasePrefix"}
"""The ``method`` label of each attach-connection prefix call in the RPC metrics (the gRPC methods'
names under ``kvtier.attach``: the same calls, told apart by the way they came)."""


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: PeerCredentials
    deadline: float
    session: AttachSession | None = None
    closed: bool = False
    serving: bool = False  # a worker has it (the selector thread never closes it then)
    calling: bool = False  # a prefix call of it is running (one at a time a connection)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _message_waiting(sock: socket.socket) -> bool:
    """Whether ``sock`` has a message (or its end) to read: the connection is not idle."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:
        return True  # failed: a worker will see its end
    return True


def _valid_id(value: object) -> bool:
    """Whether a prefix call's ``id`` may be echoed: an int64 (not a bool) or None."""
    return value is None or (type(value) is int and -(1 << 63) <= value < 1 << 63)


class _SessionEnds:
    """Ends sessions off the channel's workers: one thread per pool with ends waiting
    (``kvtier-attach-end``), which ends them one after another under that pool's lock. So a session
    end waits only for its own pool's lock, never behind another pool's or another connection's
    work; a storage session (no pool, no pool lock) ends in the thread that saw its end."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self._lock = threading.Lock()  # level 1: dict operations only
        self._waiting: dict[int, tuple[Any, deque[tuple[AttachSession, str]]]] = {}
        self._threads: list[threading.Thread] = []

    def submit(self, session: AttachSession, reason: str) -> None:
        """End ``session`` (its connection closed) as soon as its pool's lock is free."""
        if session.entry is None:
            self._end(session, reason)
            return
        key = id(session.entry)
        with self._lock:
            start = key not in self._waiting
            if start:
                self._waiting[key] = (session.entry, deque())
            self._waiting[key][1].append((session, reason))
            if start:
                t = threading.Thread(target=self._drain, args=(key,), name="kvtier-attach-end", daemon=True)
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
        if start:
            t.start()

    def _drain(self, key: int) -> None:
        while True:
            with self._lock:
                q = self._waiting[key][1]
                if not q:
                    del self._waiting[key]
                    return
                session, reason = q.popleft()
            self._end(session, reason)

    def _end(self, session: AttachSession, reason: str) -> None:
        try:
            self.daemon.end_session(session, reason)
        except Exception:  # noqa: BLE001 - the next session still ends
            log.exception("attach: ending session %d failed", session.number)

    def join(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s in all) for the ends submitted so far."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            if t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))


def error_reply(exc: BaseException) -> dict[str, Any]:
    """The error message for ``exc``: the gRPC status code name the same error maps to."""
    code = status_code_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("attach: internal error", exc_info=exc)
        return {"error": {"code": "INTERNAL", "message": f"internal error: {type(exc).__name__}"}}
    message = str(exc)
    if len(message) > MAX_ERROR_CHARS:  # it may quote the request: the reply must fit in one message
        message = message[:MAX_ERROR_CHARS - 25] + f"... ({len(message)} characters)"
    error: dict[str, Any] = {"code": code.name, "message": message}
    if getattr(exc, "unchanged", False):
        error["unchanged"] = True  # changed nothing: the client may retry (as gRPC's kvtier-retry: unchanged)
    return {"error": error}


class AttachChannel:
    """The listening attach socket of one daemon and its sessions' connections.

    Args:
        daemon: the daemon domain.
        path: where to listen (``<grpc socket>.attach``); only a stale socket of this uid there is
            replaced (:func:`~kvtier.addresses.clear_stale_socket`), anything else refused.

    Raises:
        SocketPathInUseError: something else lies at ``path``.
        OSError: the socket cannot be bound.
    """

    def __init__(self, daemon: Daemon, path: str | Path) -> None:
        self.daemon = daemon
        self.path = Path(path)
        clear_stale_socket(self.path, socket.SOCK_SEQPACKET)  # ``serve`` checked it before allocating anything
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)
        try:
            self._listener.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self._listener.listen(LISTEN_BACKLOG)
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._rewatch: queue.SimpleQueue[_Conn] = queue.SimpleQueue()
        self._conns: set[_Conn] = set()
        self._handshaking: dict[_Conn, None] = {}  # connections without a session yet, oldest first
        self._conns_lock = threading.Lock()  # level 1: set operations only
        self._refusal_logged = -1e9
        self._ends = _SessionEnds(daemon)
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kvtier-attach-work")
        self._hello = ThreadPoolExecutor(HELLO_WORKERS, thread_name_prefix="kvtier-attach-hello")
        self._calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="kvtier-attach-call")
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
            try:
                self._round()
            except Exception:  # noqa: BLE001 - the listener outlives any one connection's failure
                log.exception("attach: the channel's selector round failed; going on")
                self._stop.wait(0.1)

    def _round(self) -> None:
        """One selector round: accept, hand connections that spoke to workers, watch served ones again."""
        for key, _ in self._sel.select(timeout=1.0):
            if key.data == "listen":
                self._accept()
            elif key.data == "wake":
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            else:
                conn: _Conn = key.data
                self._sel.unregister(conn.sock)
                conn.serving = True
                # a handshake may wait for a pool's lock: on threads of its own (A9-8)
                (self._pool if conn.session is not None else self._hello).submit(self._serve, conn)
        while True:
            try:
                conn = self._rewatch.get_nowait()
            except queue.Empty:
                break
            if not conn.closed:
                try:
                    self._sel.register(conn.sock, selectors.EVENT_READ, conn)
                except (KeyError, ValueError, OSError):  # closed meanwhile: end it as a closed one
                    log.info("attach: pid %d's connection could not be watched again; ended", conn.peer.pid)
                    self._ended(conn, "its connection failed")
        now = time.monotonic()
        with self._conns_lock:
            late = [c for c in self._handshaking if c.deadline < now and not c.serving]
        for conn in late:
            log.info("attach: pid %d sent no attach request within %.0f s; closed", conn.peer.pid, HANDSHAKE_SECONDS)
            self._drop_idle(conn)

    def _accept(self) -> None:
        """Accept what the listen queue holds, at most :data:`ACCEPTS_PER_ROUND` (then the selector
        serves the connections that have spoken: a flood of connects cannot starve them)."""
        for _ in range(ACCEPTS_PER_ROUND):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("attach: accept failed: %s", e)
                return
            sock.setblocking(False)  # a worker never waits on a peer: a reply that does not fit ends the peer
            with self._conns_lock:
                full = len(self._conns) >= MAX_CONNECTIONS
                handshaking = list(self._handshaking) if len(self._handshaking) >= MAX_HANDSHAKES else []
            if full:
                self._refuse(sock, f"the attach channel has {MAX_CONNECTIONS} connections open (its cap); retry "
                                   f"when sessions have ended")
                continue
            if handshaking:
                idle = next((c for c in handshaking if not c.serving and not _message_waiting(c.sock)), None)
                if idle is None:
                    self._refuse(sock, f"{MAX_HANDSHAKES} attach handshakes are in progress (the channel's cap); retry",
                                 unchanged=True)  # a handshake ends (or times out) within HANDSHAKE_SECONDS
                    continue
                log.info("attach: %d connections in their handshake; closed the oldest idle one (pid %d)",
                         MAX_HANDSHAKES, idle.peer.pid)
                self._drop_idle(idle)
            pid, uid, gid = peer_credentials(sock)
            conn = _Conn(sock, PeerCredentials(pid, uid, gid), time.monotonic() + HANDSHAKE_SECONDS)
            with self._conns_lock:
                self._conns.add(conn)
                self._handshaking[conn] = None
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _refuse(self, sock: socket.socket, message: str, unchanged: bool = False) -> None:
        """Answer a connection the channel has no room for RESOURCE_EXHAUSTED (marked "changed
        nothing" when ``unchanged``: the client retries it) and close it."""
        now = time.monotonic()
        if now - self._refusal_logged >= 10.0:  # a flood logs once per 10 s
            self._refusal_logged = now
            log.warning("attach: refusing connections: %s", message)
        with contextlib.suppress(OSError, WireError):
            refusal = ResourceExhausted(message)
            refusal.unchanged = unchanged
            send_message(sock, error_reply(refusal))
        # Closing with the peer's request unread would make the peer read ECONNRESET instead of the
        # answer: stop it sending (SHUT_RD: its sends fail EPIPE), drop what it sent, then close.
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RD)
        with contextlib.suppress(OSError):
            while sock.recv(1, socket.MSG_DONTWAIT):
                pass
        sock.close()

    def _drop_idle(self, conn: _Conn) -> None:
        """(Selector thread.) Close a connection still in its handshake that no worker has."""
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        self._close(conn)

    # ----- workers --------------------------------------------------------------------------
    def _serve(self, conn: _Conn) -> None:
        """Read and answer one message of ``conn`` (or see its end); then watch it again."""
        try:
            try:
                msg = recv_message(conn.sock)
            except BlockingIOError:
                return  # nothing to read after all
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
            conn.serving = False
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
        with conn.lock:  # a connection closed meanwhile (the daemon stopping) never gets a session
            alive = not conn.closed
            if alive:
                conn.session = grant.session
        with self._conns_lock:
            self._handshaking.pop(conn, None)
        if not alive:
            self._ends.submit(grant.session, "its connection closed during the handshake")
            return
        grant.session.close_hook = lambda: self._close_later(conn)
        if not self._send(conn, grant.reply, grant.fds):
            self._ended(conn, "its connection failed")

    def _request(self, conn: _Conn, request: dict[str, Any]) -> None:
        assert conn.session is not None
        kind = request.get("kind")
        if kind == "staging":
            rid = request.get("id")
            if not _valid_id(rid):  # echoed in the reply: never one that would not fit
                self._answer(conn, error_reply(InvalidArgument("id must be an integer (int64) or null")))
                return
            echo = {} if rid is None else {"id": rid}
            try:
                reply, shm = self.daemon.attach.staging(conn.session, request)
            except Exception as e:  # noqa: BLE001
                self._answer(conn, {**error_reply(e), **echo})
                return
            reply = {**reply, **echo}  # matched by the client: a late reply is never taken for a newer request's
            if not self._send(conn, reply, [shm.fd]):
                self._ended(conn, "its connection failed")
            return
        if kind in PREFIX_KINDS:
            start = time.perf_counter()
            if not _valid_id(request.get("id")):  # echoed in the reply: never one that would not fit
                self._answer(conn, error_reply(InvalidArgument("id must be an integer (int64) or null")))
                self._observe(kind, "INVALID_ARGUMENT", conn.session, start)
                return
            with conn.lock:
                busy, conn.calling = conn.calling, True
            if busy:
                self._answer(conn, {**error_reply(ResourceExhausted("one prefix call at a time on an attach "
                                                                    "connection; wait for the reply")),
                                    "id": request.get("id")})
                self._observe(kind, "RESOURCE_EXHAUSTED", conn.session, start)
                return
            self._calls.submit(self._prefix_call, conn, request, start, time.monotonic())
            return
        self._answer(conn, error_reply(InvalidArgument(f"unknown request kind {kind!r} on an attached connection; "
                                                       f"known: 'staging', {', '.join(repr(k) for k in PREFIX_KINDS)}")))

    def _prefix_call(self, conn: _Conn, request: dict[str, Any], start: float, received: float) -> None:
        """(A call thread.) Run one prefix call of ``conn``'s session and send its reply. The
        connection is watched by the selector meanwhile, so this thread never closes it: a failed
        send shuts it down and the selector's worker ends the session (:meth:`_close_later`). The
        call checks its caller as a gRPC call does: its connection still open, its ``timeout_s``
        (counted from ``received``, the hand-off) not run out."""
        session = conn.session
        assert session is not None
        code = "CANCELLED"  # the reply never reached the peer (unless set below)
        try:
            try:
                reply = self.daemon.attach.prefix_call(session, request, received=received,
                                                       connected=lambda: not conn.closed)
            except Exception as e:  # noqa: BLE001 - mapped to a code like a gRPC call's error
                reply = {**error_reply(e), "id": request.get("id")}
            with conn.lock:
                conn.calling = False
            try:
                send_message(conn.sock, reply)
                code = reply["error"]["code"] if "error" in reply else "OK"
                return
            except (OSError, WireError) as e:
                too_big = isinstance(e, WireError) or getattr(e, "errno", None) == errno.EMSGSIZE
            self.daemon.attach.abandon(session, reply)  # a lease nobody was told of: released now
            if too_big:  # the session goes on; the client makes such calls over gRPC
                small = {**error_reply(ResourceExhausted("the reply is larger than the attach connection carries in one "
                                                         "message; make this call over gRPC")), "id": request.get("id")}
                with contextlib.suppress(OSError, WireError):
                    send_message(conn.sock, small)
                    code = "RESOURCE_EXHAUSTED"
                    return
            self._close_later(conn)
        except Exception:  # noqa: BLE001 - one connection's failure never stops the channel
            log.exception("attach: a prefix call of pid %d failed", conn.peer.pid)
            self._close_later(conn)
        finally:
            self._observe(str(request.get("kind")), code, session, start)

    def _observe(self, kind: str, code: str, session: AttachSession | None, start: float) -> None:
        """Time one prefix call into the RPC histogram (when the daemon has metrics): after its reply,
        outside every lock."""
        metrics = self.daemon.metrics
        if metrics is not None:
            metrics.rpc.observe(time.perf_counter() - start, method=ATTACH_METHODS[kind], code=code,
                                tenant=session.tenant if session is not None else "")

    def _send(self, conn: _Conn, reply: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> bool:
        """Send ``reply`` without waiting: False if the connection failed, or if its socket buffer is
        full (the peer does not read its replies: one reply per request, so a client that reads
        never has one waiting)."""
        try:
            send_message(conn.sock, reply, fds)
        except BlockingIOError:
            log.info("attach: pid %d does not read its replies; its connection is closed", conn.peer.pid)
            return False
        except (OSError, WireError):
            return False
        return True

    def _answer(self, conn: _Conn, reply: dict[str, Any], *, close: bool = False) -> None:
        if not self._send(conn, reply) or close:
            self._ended(conn, "refused")

    def _ended(self, conn: _Conn, reason: str) -> None:
        """Close ``conn`` and end its session (off the workers, see :class:`_SessionEnds`)."""
        session = conn.session
        self._close(conn)
        if session is not None:
            self._ends.submit(session, reason)

    def _close(self, conn: _Conn) -> None:
        with conn.lock:
            if conn.closed:
                return
            conn.closed = True
        with self._conns_lock:
            self._conns.discard(conn)
            self._handshaking.pop(conn, None)
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
        self._hello.shutdown(wait=True)
        self._calls.shutdown(wait=True, cancel_futures=True)
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            session = conn.session
            self._close(conn)
            if session is not None:
                self.daemon.end_session(session, "the daemon is stopping")
        self._ends.join(5.0)
        for s in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                s.close()
        self._sel.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.daemon.attach_socket = ""
