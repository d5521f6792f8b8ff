"""Storage sessions: shared-memory staging buffers with a daemon on this machine, for page transfers.

``KVTierClient.storage_session()`` (this module's :class:`StagingMixin`) opens a *storage session*
on the daemon's attach channel (``<socket>.attach``, ``kvtier.attach_wire``): the attach handshake
without a pool (``{"kind": "storage"}``), authenticated with the client's token and the process's uid
like an attach. The session then hands out staging buffers: anonymous shared memory (a memfd the
daemon makes for this session alone and passes by ``SCM_RIGHTS``; never the host tier's memory,
which holds every tenant's records) mapped by both processes. The unit store's staged calls
(``StorageService.PutUnitsStaged`` / ``GetUnitsStaged``, made through :attr:`StagingSession.client`,
which carries the session) name a buffer and an offset; the page bytes never travel in gRPC messages.

Ordering: write a buffer completely before the call that reads it (PutUnitsStaged); what the daemon
writes (GetUnitsStaged) is in place when the call returns. One call at a time per buffer.

When the session ends -- :meth:`StagingSession.close`, the process exiting or being killed -- the
daemon drops its buffers; this side revokes its mappings first (stale tensors read zeros).
"""

from __future__ import annotations

import socket
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from kvtier.attach_wire import PROTOCOL_VERSION, SESSION_METADATA
from kvtier.client.attach import HANDSHAKE_TIMEOUT_S, AttachMixin, _close_fds, open_channel, request_staging
from kvtier.client.errors import KVTierError, UnavailableError


@dataclass(frozen=True)
class StagingBuffer:
    """One staging buffer of a session.

    Attributes:
        index: its number in the session (what staged calls name).
        nbytes: its size. tensor: ``(nbytes,)`` uint8 over the shared memory (no copy).
    """

    index: int
    nbytes: int
    tensor: Any


def _release(buffers: list[Any], sock: socket.socket, client: Any) -> None:
    """Revoke every mapping (stale tensors read zeros), then close the connection (the daemon drops
    the buffers) and the session's client. Also run by the finalizer of a session never closed."""
    for shm in buffers:
        shm.revoke()
    buffers.clear()
    try:
        sock.close()
    finally:
        client.close()


class StagingSession:
    """A storage session with a daemon on this machine (module docstring).

    Attributes:
        session_id: the session's id (a secret: never log it). tenant: the tenant it runs as.
        staging_max_bytes, staging_max_buffers: the daemon's budget for the session's buffers.
        client: a :class:`~kvtier.client.KVTierClient` whose calls are made in the session.
    """

    def __init__(self, *, client: Any, sock: socket.socket, reply: dict[str, Any]) -> None:
        self.client = client
        self.session_id: str = reply["session_id"]
        self.tenant: str = reply["tenant"]
        self.staging_max_bytes = int(reply.get("staging_max_bytes", 0))
        self.staging_max_buffers = int(reply.get("staging_max_buffers", 0))
        self._sock = sock
        self._buffers: list[Any] = []
        self._lock = threading.Lock()
        self._closed = False
        self._requests = 0  # staging requests sent (their ids: a late reply is matched and dropped)
        self._finalizer = weakref.finalize(self, _release, self._buffers, sock, client)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def buffer(self, nbytes: int, *, timeout: float = HANDSHAKE_TIMEOUT_S) -> StagingBuffer:
        """A new staging buffer of ``nbytes`` (at most ``staging_max_bytes`` in all, ``staging_max_buffers`` buffers).

        Raises:
            ResourceExhaustedError: past the session's budget. InvalidArgumentError: a bad size.
            UnavailableError: the session's connection is gone. RuntimeError: the session was closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the storage session was closed")
            self._requests += 1
            index, shm = request_staging(self._sock, nbytes, timeout, self._requests)
            self._buffers.append(shm)
            return StagingBuffer(index, shm.nbytes, shm.tensor())

    def close(self, *, revoke: bool = True) -> None:
        """End the session (mappings revoked first, then the connection closed). Idempotent.

        With ``revoke=False`` the mappings are left as they are and go when the last tensor over
        them does: for a session that died under calls still reading their buffers (the daemon has
        dropped the buffers already; they were this session's alone)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not revoke:
                self._buffers.clear()
        self._finalizer()

    def __enter__(self) -> StagingSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StagingMixin(AttachMixin):
    """``storage_session()``: staging buffers shared with a daemon on this machine (module docstring)."""

    def storage_session(self, *, timeout: float = HANDSHAKE_TIMEOUT_S) -> StagingSession:
        """Open a storage session on the daemon's attach channel.

        Raises:
            FailedPreconditionError: this client or the daemon is on TCP (it needs the unix socket).
            NotFoundError: this process's uid may not attach as the token's tenant.
            UnauthenticatedError: no known token. UnavailableError: the channel is unreachable.
        """
        path = self.attach_socket(timeout=timeout)
        sock, reply, fds = open_channel(path, {"kind": "storage", "version": PROTOCOL_VERSION, "token": self._token},
                                        timeout)
        try:
            if "session_id" not in reply or "tenant" not in reply:
                raise KVTierError("the daemon's storage-session reply is malformed")
            client = type(self)(self.address, timeout=self.timeout, max_message_bytes=self.max_message_bytes,
                                chunk_bytes=self.chunk_bytes, retries=self.retries, token=self._token,
                                metadata=[(SESSION_METADATA, reply["session_id"])], **self._tls)
            return StagingSession(client=client, sock=sock, reply=reply)
        except BaseException:
            _close_fds(fds)
            sock.close()
            raise
