"""The attach channel's wire format, shared by the daemon and the client (no server imports here).

Beside its gRPC unix socket ``<dir>/<name>`` the daemon listens on ``<dir>/<name>.attach``
(:func:`attach_socket_path`; the same private directory, socket mode 0600), an ``AF_UNIX``
``SOCK_SEQPACKET`` socket: every message arrives whole, and file descriptors travel with it
(``SCM_RIGHTS``). gRPC can neither pass descriptors nor tell who the peer is; this socket can
(``SO_PEERCRED``: the connecting process's pid, uid and gid, recorded by the kernel at connect).

A message is one JSON object (UTF-8, at most :data:`MAX_MESSAGE_BYTES`), optionally with up to
:data:`MAX_FDS` descriptors. The client speaks first; every request gets exactly one reply, in order:

* ``{"kind": "attach", "version": 1, "token": <bearer token or null>, "pool_id": <id>}`` -- the
  first message of a connection. Reply: the pool's layout and a session id, with the pool's arena
  descriptors (see ``kvtier.server.daemon.attach``). The connection then *is* the attach session:
  when it closes (the worker detaches, exits, crashes or is killed), the session ends.
* ``{"kind": "storage", "version": 1, "token": <bearer token or null>}`` -- instead, the first message
  of a *storage session*: a session without a pool, for an engine's storage backend on this machine
  (``kvtier.integrations.sglang``). Reply: ``{"version", "session_id", "tenant", "staging_max_bytes",
  "staging_max_buffers"}``; its staging buffers carry the unit store's page bytes
  (``StorageService.PutUnitsStaged`` / ``GetUnitsStaged`` name a buffer and an offset).
* ``{"kind": "staging", "nbytes": N, "id": n}`` -- later, on an attached connection: a fresh staging
  buffer of ``N`` bytes for page transfers (anonymous shared memory of this session alone), its
  descriptor with the reply ``{"staging": {"index": i, "nbytes": N}, "id": n}`` (``id``: an int64
  or null, echoed as a prefix call's is, so the client drops the late reply of a request that timed out).

* ``{"kind": "load_prefix", "id": n, "keys": [hex], "total_tokens": N or null}``,
  ``{"kind": "store_prefix", "id": n, "lease_id": id, "keys": [hex], "slots": b64, "release": bool}``,
  ``{"kind": "release_prefix", "id": n, "lease_id": id}`` -- later, on an attached connection: the
  prefix cache's LoadPrefix / StorePrefix / ReleasePrefix on the attached pool, in the session (the
  same calls and checks as over gRPC, without HTTP/2: a local worker's control path). Each may carry
  ``"timeout_s": seconds`` (a number, finite, above 0 and at most :data:`MAX_TIMEOUT_S`; absent or
  null: no deadline) and ``"sent_at": t`` (the client's ``time.monotonic()`` when it sent the
  message; absent or null: the daemon's receipt), the client's deadline counted from ``sent_at``
  (attack pass 9, A9-1: counted from the receipt, time unread was not counted): like a gRPC deadline,
  a call whose caller gave up by then (or whose connection closed) changes nothing and answers
  CANCELLED (the client raised DeadlineExceededError already); a load then releases its lease. Page keys
  travel as hex strings, slots as base64 of little-endian int64 (:func:`encode_slots`). Replies echo
  ``id`` (an int64 or null; anything else is refused INVALID_ARGUMENT, without an ``id``):
  ``{"id", "lease_id", "slots", "tiers"}``, ``{"id", "stored_pages"}``, ``{"id"}``.

An error reply is ``{"error": {"code": "NOT_FOUND", "message": "..."}}`` with a gRPC status code
name (a message of at most :data:`MAX_ERROR_CHARS` characters, whatever the request held); after
an error in the first message the daemon closes the connection. Later in a session every request
that is not a valid message (empty, not one JSON object, longer than :data:`MAX_MESSAGE_BYTES`,
with descriptors) is answered INVALID_ARGUMENT and the session goes on.

gRPC calls made in a session carry ``x-kvtier-session: <session id>`` metadata (:data:`SESSION_METADATA`).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import select
import socket
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PROTOCOL_VERSION = 1
ATTACH_SUFFIX = ".attach"
SESSION_METADATA = "x-kvtier-session"
MAX_MESSAGE_BYTES = 1 << 20
MAX_FDS = 16
MAX_ERROR_CHARS = 1024  # an error reply's message at most: it may quote the request, which may be ~1 MiB
PREFIX_KINDS = ("load_prefix", "store_prefix", "release_prefix")
MAX_TIMEOUT_S = 1e8
"""The largest ``timeout_s`` of a prefix call (gRPC's own "no deadline" is centuries away): a client
with a longer one sends none."""
KINDS = ("attach", "storage", "staging", *PREFIX_KINDS)
_PEERCRED = struct.Struct("3i")


class WireError(ValueError):
    """A message that is not one JSON object within the limits (or came with too many descriptors)."""


def attach_socket_path(grpc_socket_path: str | Path) -> str:
    """The attach channel's socket beside a daemon's gRPC unix socket: ``<path>.attach``."""
    return str(grpc_socket_path) + ATTACH_SUFFIX


def send_message(sock: socket.socket, message: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    """Send one JSON message (and ``fds``) as one datagram.

    Raises:
        WireError: the message is larger than :data:`MAX_MESSAGE_BYTES` or carries too many descriptors.
        OSError: the socket failed (the peer went away).
    """
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    if len(fds) > MAX_FDS:
        raise WireError(f"{len(fds)} descriptors exceed {MAX_FDS}")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv_message(sock: socket.socket, *, accept_fds: bool = False) -> tuple[dict[str, Any], list[int]] | None:
    """Receive one message: ``(object, descriptors)``, or None when the peer closed the connection.

    Descriptors are received close-on-exec and only with ``accept_fds`` (the daemon never takes any:
    what a client sends along is closed at once). On a :class:`WireError` the descriptors that came
    are closed before it is raised. A zero-length read is the peer's close only when the socket says
    the peer has shut down (:func:`peer_closed`); otherwise it was a zero-length message, which is a
    :class:`WireError` like any other message that is not one JSON object.

    Raises:
        WireError: not one JSON object (an empty message included), cut off (longer than
            :data:`MAX_MESSAGE_BYTES`), or too many descriptors.
        OSError: the socket failed (ECONNRESET when the peer died is reported as None, like a close).
    """
    try:
        data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES + 1, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
    except ConnectionResetError:
        return None
    try:
        if not accept_fds and fds:
            raise WireError("descriptors are not accepted here")
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) > MAX_MESSAGE_BYTES:
            raise WireError(f"message longer than {MAX_MESSAGE_BYTES} bytes or with more than {MAX_FDS} descriptors")
        if not data and not fds:
            if peer_closed(sock):
                return None  # orderly close
            raise WireError("an empty message: a message must be one JSON object")
        obj = decode_json(data)
        if not isinstance(obj, dict):
            raise WireError("a message must be one JSON object")
        return obj, list(fds)
    except WireError:
        _close_all(fds)
        raise


def peer_closed(sock: socket.socket) -> bool:
    """Whether the peer of ``sock`` has closed the connection or shut down its sending side (or this
    side shut down its receiving side): ``POLLRDHUP``/``POLLHUP``, asked without waiting. On a
    ``SOCK_SEQPACKET`` socket a zero-length read is either that or a zero-length message; only this
    tells them apart."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLRDHUP)
    return any(events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL)
               for _, events in poller.poll(0))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def decode_json(data: bytes) -> Any:
    """``data`` (UTF-8 JSON text) as a Python value, held to strict JSON: no ``NaN``/``Infinity``,
    no lone UTF-16 surrogate (``\\ud800``: no Unicode text), and within Python's own limits
    (integers of at most ``sys.get_int_max_str_digits()`` digits, nesting within the recursion limit).

    Raises:
        WireError: any of those, or text that is not UTF-8 or not JSON; one line naming the cause.
    """
    try:
        obj = json.loads(data, parse_constant=_no_constant)
        if _SURROGATE_ESCAPE.search(data):  # only then: a lone surrogate cannot be encoded again
            json.dumps(obj, ensure_ascii=False).encode()
    except RecursionError:
        raise WireError("a message must be one JSON object: it nests too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError/EncodeError, int digit limit, _no_constant
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise WireError(f"a message must be one JSON object: {first}") from None
    return obj


def _close_all(fds: list[int]) -> None:
    import os

    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process that connected ``sock`` (``SO_PEERCRED``, as of its connect)."""
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))


def encode_slots(slots: Sequence[int] | bytes) -> str:
    """Slots (ints, or their little-endian int64 bytes) as base64 text for a message."""
    raw = slots if isinstance(slots, (bytes, bytearray, memoryview)) else struct.pack(f"<{len(slots)}q", *slots)
    return base64.b64encode(raw).decode("ascii")


def decode_slots(text: object, what: str = "slots") -> bytes:
    """The little-endian int64 bytes of base64 ``text`` (see :func:`encode_slots`).

    Raises:
        WireError: not base64 text of whole int64s.
    """
    if not isinstance(text, str):
        raise WireError(f"{what} must be base64 text of little-endian int64s")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise WireError(f"{what} is not valid base64") from None
    if len(raw) % 8:
        raise WireError(f"{what} holds {len(raw)} bytes, not whole int64s")
    return raw


def encode_keys(keys: Sequence[bytes]) -> list[str]:
    """Page keys as hex strings for a message."""
    return [bytes(k).hex() for k in keys]


def decode_keys(value: object) -> list[bytes]:
    """Page keys from a message's list of hex strings.

    Raises:
        WireError: not a list of hex strings.
    """
    if not isinstance(value, list) or not all(isinstance(k, str) for k in value):
        raise WireError("keys must be a list of hex strings")
    try:
        return [bytes.fromhex(k) for k in value]
    except ValueError:
        raise WireError("keys must be a list of hex strings") from None
