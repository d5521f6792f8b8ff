"""Attach sessions: who holds what while a worker is attached to a pool (README "Local attach").

A *storage session* is an attach session without a pool (``entry`` None): an engine's storage
backend on this machine (``kvtier.integrations.sglang``) opens one to get staging buffers, through
which the unit store's staged calls move page bytes (README "Use with SGLang"). It owns no slots
and no leases; its end frees its staging buffers.

An :class:`AttachSession` exists from a worker's attach handshake until its connection to the attach
channel closes (``detach()``, exit, crash, SIGKILL: the kernel closes the socket in every case). Its
gRPC calls carry its id (``x-kvtier-session``); the caller then makes them in the session, and:

* slots allocated in it (AllocateSlots, Restore into fresh slots) are *owned* by it: the pool entry
  records the session's number on their pages (``PoolEntry.page_owner``). Only the session may free,
  overwrite or move onto them; anyone else is refused with FAILED_PRECONDITION (FreeSlots,
  Offload with free_slots, WriteKV, MoveKV targets, Restore into them, PullKV destinations);
* leases taken in it (LoadPrefix) are its own and never expire by the lease TTL (the session's end
  is the signal that the holder is gone); their pages stay pinned, so the prefix cache never evicts them.

When the session ends, :meth:`kvtier.server.daemon.core.Daemon.end_session` frees its slots and
releases its leases at once (bound: as soon as the pool's lock is free, i.e. once calls in flight on
that pool finish), counted and logged.

Session ids are 128 random bits (32 hex characters): they name a session only to its tenant, and
another tenant's id is an unknown one. Numbers (1, 2, ...) are internal, for the page-owner table.

Locking: the registry's lock is a level-1 dict lock (README "Concurrency"); a session's ``leases``
and ``ended`` are read and changed only under its pool's exclusive lock (level 2), so a call in the
session and the session's end never interleave on that pool.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.server.daemon.errors import ResourceExhausted

if TYPE_CHECKING:
    from kvtier.server.daemon.pools import PoolEntry


@dataclass(frozen=True)
class PeerCredentials:
    """The attached process as the kernel saw it at connect (``SO_PEERCRED``)."""

    pid: int
    uid: int
    gid: int


@dataclass(eq=False)
class AttachSession:
    """One worker attached to one pool.

    Attributes:
        session_id: 32 hex characters (128 random bits); never logged.
        number: small internal number, recorded on the pages the session owns.
        tenant: the tenant it attached as. entry: the pool it attached (the entry object: a pool
            deleted and made again under the same id is another pool); None for a storage session.
        peer: the attached process. started: ``time.monotonic()`` at attach.
        leases: ids of the prefix leases it holds (under the pool's exclusive lock).
        staging: its staging buffers (``kvtier.memfd.SharedMemory``), freed with it.
        ended: set when the session ends; a call in it then fails (checked under the pool's lock).
    """

    session_id: str = field(repr=False)
    number: int
    tenant: str
    entry: PoolEntry | None = field(repr=False)
    peer: PeerCredentials
    started: float = field(default_factory=time.monotonic)
    leases: set[str] = field(default_factory=set, repr=False)
    staging: list[Any] = field(default_factory=list, repr=False)
    ended: bool = False
    close_hook: Any = field(default=None, repr=False)
    """Set by the attach channel: closes the session's connection (when the daemon ends it)."""

    @property
    def pool_id(self) -> str:
        """The attached pool's id ("" for a storage session)."""
        return self.entry.pool_id if self.entry is not None else ""

    @property
    def staging_bytes(self) -> int:
        """Bytes of its staging buffers."""
        return sum(s.nbytes for s in self.staging)


class SessionRegistry:
    """The daemon's live attach sessions (thread-safe; a level-1 lock, held for dict operations only).

    Args:
        max_sessions: live sessions at most, daemon-wide (a new attach past it is refused).
        per_tenant: live sessions of one tenant at most (``attach_sessions_per_tenant``), so one
            tenant cannot take every session of the daemon.
    """

    def __init__(self, max_sessions: int = 1024, per_tenant: int = 256) -> None:
        self.max_sessions = max_sessions
        self.per_tenant = per_tenant
        self._lock = threading.Lock()
        self._sessions: dict[str, AttachSession] = {}
        self._of_tenant: dict[str, int] = {}
        self._staging_of_tenant: dict[str, int] = {}
        self._numbers = itertools.count(1)
        self.started = 0  # plain ints for monitoring
        self.ended = 0

    def new(self, tenant: str, entry: PoolEntry | None, peer: PeerCredentials) -> AttachSession:
        """Register a new session of ``tenant`` on ``entry`` (None: a storage session).

        Raises:
            ResourceExhausted: :attr:`max_sessions` are live, or :attr:`per_tenant` of ``tenant``'s.
        """
        with self._lock:
            full = len(self._sessions) >= self.max_sessions
            tenant_full = self._of_tenant.get(tenant, 0) >= self.per_tenant
            if not (full or tenant_full):
                s = self._add(tenant, entry, peer)
        if full:
            raise ResourceExhausted(f"the daemon already has {self.max_sessions} attach sessions (its cap); "
                                    f"retry when some have ended")
        if tenant_full:
            raise ResourceExhausted(f"tenant {tenant!r} already has {self.per_tenant} attach sessions (the "
                                    f"attach_sessions_per_tenant cap); end some (detach) or raise the cap")
        return s

    def _add(self, tenant: str, entry: PoolEntry | None, peer: PeerCredentials) -> AttachSession:
        """(Registry lock held.) The new session, counted for its tenant."""
        sid = secrets.token_hex(16)
        while sid in self._sessions:
            sid = secrets.token_hex(16)
        s = AttachSession(sid, next(self._numbers), tenant, entry, peer)
        self._sessions[sid] = s
        self._of_tenant[tenant] = self._of_tenant.get(tenant, 0) + 1
        self.started += 1
        return s

    def get(self, tenant: str, session_id: str) -> AttachSession | None:
        """``tenant``'s live session ``session_id`` (None: unknown, ended, or another tenant's)."""
        with self._lock:
            s = self._sessions.get(session_id)
        return s if s is not None and s.tenant == tenant else None

    def remove(self, session: AttachSession) -> bool:
        """Take ``session`` out of the registry; False if it already was (it ends once)."""
        with self._lock:
            if self._sessions.get(session.session_id) is not session:
                return False
            del self._sessions[session.session_id]
            self._of_tenant[session.tenant] -= 1
            self.ended += 1
            return True

    def reserve_staging(self, tenant: str, nbytes: int, budget: int) -> bool:
        """Count ``nbytes`` more staging bytes for ``tenant`` if its staging buffers stay within
        ``budget`` bytes (``attach_staging_tenant_bytes``); False (nothing counted) if they would not.
        Give them back with :meth:`release_staging`."""
        with self._lock:
            held = self._staging_of_tenant.get(tenant, 0)
            if held + nbytes > budget:
                return False
            self._staging_of_tenant[tenant] = held + nbytes
            return True

    def release_staging(self, tenant: str, nbytes: int) -> None:
        """Give back ``nbytes`` of ``tenant``'s staging bytes (buffers closed, or never made)."""
        with self._lock:
            self._staging_of_tenant[tenant] = self._staging_of_tenant.get(tenant, 0) - nbytes

    def staging_bytes(self, tenant: str) -> int:
        """Bytes of ``tenant``'s live staging buffers (a plain read)."""
        return self._staging_of_tenant.get(tenant, 0)

    def of_entry(self, entry: PoolEntry) -> list[AttachSession]:
        """Live sessions attached to ``entry``."""
        with self._lock:
            return [s for s in self._sessions.values() if s.entry is entry]

    def all(self) -> list[AttachSession]:
        """Every live session."""
        with self._lock:
            return list(self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)
