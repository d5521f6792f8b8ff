"""Local attach, the domain half: authorise a worker, describe a pool's memory to it, staging buffers.

The attach channel (``kvtier.server.service.attach_channel``) reads a worker's first message and
its credentials (``SO_PEERCRED``) and calls :meth:`AttachService.attach`; the reply and the arena
descriptors go back on the same connection, which stays open as the session
(:mod:`kvtier.server.daemon.sessions`). Nothing here touches a socket.

Who may attach (checked in this order, so nothing leaks about pools a caller may not see):

1. the token, authenticated exactly as gRPC calls are (:func:`~kvtier.server.daemon.tenants.authenticate`):
   UNAUTHENTICATED without a known one on a daemon with tenants;
2. the peer's uid: the daemon's own, or one of the tenant's ``attach_uids``; any other uid gets the
   answer an absent pool gets (NOT_FOUND, same message);
3. the pool, in the tenant's namespace: another tenant's pool is NOT_FOUND like an absent one.

A *storage session* (``{"kind": "storage"}``) is the same handshake without a pool (steps 1 and 2):
an engine's storage backend on this machine gets a session whose staging buffers carry the unit
store's page bytes (:meth:`AttachService.staging_region`; README "Use with SGLang").

The reply names the pool's geometry (:func:`~kvtier.server.pool.layout.pool_geometry`), the offset,
shape and dtype of every per-layer view (:func:`~kvtier.server.pool.layout.pool_views`), the model
fingerprint, and the arenas: on the CPU one memfd descriptor each (passed with the reply), on CUDA
one IPC handle each (:func:`kvtier.cuda_ipc.export_arena`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvtier.attach_wire import MAX_TIMEOUT_S, PROTOCOL_VERSION, WireError, decode_keys, decode_slots, encode_slots
from kvtier.memfd import SharedMemory
from kvtier.server.daemon.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, always
from kvtier.server.daemon.pools import MAX_POOL_ID_CHARS, PoolEntry
from kvtier.server.daemon.sessions import AttachSession, PeerCredentials
from kvtier.server.daemon.tenants import Caller, authenticate
from kvtier.server.pool.layout import pool_geometry, pool_views

if TYPE_CHECKING:
    from kvtier.server.daemon.core import Daemon

log = logging.getLogger("kvtier.attach")

MAX_STAGING_BUFFERS = 8  # per session
POOL_LOCK_SECONDS = 0.02  # a handshake holds a channel worker at most this long for a busy pool (A10-4); the client retries
"""How long a handshake waits for its pool's shared lock (it runs in one of the attach channel's few
workers): past it the attach is answered UNAVAILABLE (the pool is busy; the client retries)."""


@dataclass(frozen=True)
class AttachGrant:
    """An accepted attach: the session, the reply to send, and the descriptors that go with it
    (the daemon's own: sending does not give them away)."""

    session: AttachSession
    reply: dict[str, Any]
    fds: list[int]


def _arena_components(entry: PoolEntry) -> list[str]:
    return [c for c, n in entry.pool.arena_nbytes().items() if n]


def describe_memory(entry: PoolEntry) -> tuple[list[dict[str, Any]], list[int]]:
    """The pool's arenas as the reply lists them, and the descriptors to pass (CPU; none on CUDA).

    Raises:
        FailedPrecondition: a CPU pool not in shared memory, or CUDA memory that cannot be shared.
    """
    pool = entry.pool
    arenas, fds = [], []
    for comp in _arena_components(entry):
        nbytes = pool.arena_nbytes()[comp]
        if pool.device.type == "cpu":
            shm = pool.shared_memory.get(comp)
            if shm is None or shm.fd < 0:
                raise FailedPrecondition(f"pool {entry.pool_id!r} does not live in shared memory; it cannot be attached")
            arenas.append({"component": comp, "nbytes": nbytes, "fd_index": len(fds)})
            fds.append(shm.fd)
        else:
            from kvtier.cuda_ipc import CudaIpcError, export_arena

            try:
                arenas.append({"component": comp, "nbytes": nbytes, "cuda": export_arena(pool.arena(comp))})
            except CudaIpcError as e:
                raise FailedPrecondition(f"pool {entry.pool_id!r}: {e}") from None
    return arenas, fds


class AttachService:
    """Attach handshakes, staging buffers and session ends for one daemon.

    Args:
        daemon: the daemon (its tokens, tenant settings, pools, sessions).
    """

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.sessions = daemon.sessions

    def uid_allowed(self, tenant: str, uid: int) -> bool:
        """Whether a process of ``uid`` may attach ``tenant``'s pools: the daemon's own uid, or one
        of the tenant's ``attach_uids``."""
        settings = self.daemon.config.tenants.get(tenant)
        return uid == os.getuid() or (settings is not None and uid in settings.attach_uids)

    def attach(self, peer: PeerCredentials, request: dict[str, Any]) -> AttachGrant:
        """Check an attach request (module docstring) and open a session.

        Raises:
            InvalidArgument: a malformed request. FailedPrecondition: another protocol version, or a
                pool that cannot be attached. Unauthenticated: no known token. NotFound: no such pool
                for this caller (or its uid may not attach). ResourceExhausted: too many sessions (the
                daemon's, or the tenant's ``attach_sessions_per_tenant``). Unavailable: the pool's lock
                stayed held exclusive for :data:`POOL_LOCK_SECONDS` (retry).
        """
        version, pool_id, token = request.get("version"), request.get("pool_id"), request.get("token")
        if version != PROTOCOL_VERSION:
            raise FailedPrecondition(f"attach protocol version {version!r} is not this daemon's {PROTOCOL_VERSION}; "
                                     f"use a kvtier client of the daemon's version")
        if not isinstance(pool_id, str) or not 0 < len(pool_id) <= MAX_POOL_ID_CHARS:
            raise InvalidArgument(f"pool_id must be a string of 1..{MAX_POOL_ID_CHARS} characters")
        if token is not None and not isinstance(token, str):
            raise InvalidArgument("token must be a string or null")
        caller = authenticate(self.daemon.tokens, token)
        if not self.uid_allowed(caller.tenant, peer.uid):
            log.info("attach refused: uid %d may not attach pools of tenant %r", peer.uid, caller.tenant)
            raise NotFound(f"no pool {pool_id!r}")
        with self.daemon.pools.locked(caller, pool_id, exclusive=False, timeout=POOL_LOCK_SECONDS) as entry:
            arenas, fds = describe_memory(entry)
            session = self.sessions.new(caller.tenant, entry, peer)
            reply = {
                "version": PROTOCOL_VERSION, "session_id": session.session_id, "pool_id": entry.pool_id,
                "tenant": caller.tenant, "device": entry.pool.device.type, "role": entry.role,
                "model": entry.model.fingerprint(), "fingerprint_digest": entry.model.fingerprint_digest(),
                "geometry": pool_geometry(entry.pool), "views": pool_views(entry.pool), "arenas": arenas,
                "staging_max_bytes": self.daemon.config.attach_staging_bytes,
            }
        self.daemon.counters.add(caller, "attach_sessions")
        log.info("attach session %d: pid %d (uid %d) attached pool %r of tenant %r", session.number, peer.pid,
                 peer.uid, entry.pool_id, caller.tenant)
        return AttachGrant(session, reply, fds)

    def open_storage(self, peer: PeerCredentials, request: dict[str, Any]) -> AttachGrant:
        """Check a storage-session request (``{"kind": "storage", "version": 1, "token": ...}``) and open
        a session without a pool: it holds staging buffers only (for the unit store's staged calls).

        Raises:
            InvalidArgument: a malformed request. FailedPrecondition: another protocol version.
            Unauthenticated: no known token. NotFound: the peer's uid may not attach as that tenant.
            ResourceExhausted: too many sessions.
        """
        version, token = request.get("version"), request.get("token")
        if version != PROTOCOL_VERSION:
            raise FailedPrecondition(f"attach protocol version {version!r} is not this daemon's {PROTOCOL_VERSION}; "
                                     f"use a kvtier client of the daemon's version")
        if token is not None and not isinstance(token, str):
            raise InvalidArgument("token must be a string or null")
        caller = authenticate(self.daemon.tokens, token)
        if not self.uid_allowed(caller.tenant, peer.uid):
            log.info("storage session refused: uid %d may not attach as tenant %r", peer.uid, caller.tenant)
            raise NotFound("no storage session for this process: its uid may not attach (give it the tenant's "
                           "attach_uids, or use the gRPC transport)")
        session = self.sessions.new(caller.tenant, None, peer)
        self.daemon.counters.add(caller, "storage_sessions")
        log.info("attach session %d: pid %d (uid %d) opened a storage session of tenant %r", session.number, peer.pid,
                 peer.uid, caller.tenant)
        reply = {"version": PROTOCOL_VERSION, "session_id": session.session_id, "tenant": caller.tenant,
                 "staging_max_bytes": self.daemon.config.attach_staging_bytes,
                 "staging_max_buffers": MAX_STAGING_BUFFERS}
        return AttachGrant(session, reply, [])

    @staticmethod
    def staging_region(caller: Caller, buffer: int, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` of staging buffer ``buffer`` of the caller's attach
        session, as a ``(nbytes,)`` uint8 tensor over the shared memory (no copy). The mapping stays
        valid while the tensor lives, even if the session ends meanwhile.

        Raises:
            FailedPrecondition: the call is not made in an attach session (no ``x-kvtier-session``).
            NotFound: the session has ended. InvalidArgument: no such buffer, or the region does not lie in it.
        """
        session = caller.session
        if session is None:
            raise FailedPrecondition("a staged call needs an attach session with a staging buffer (x-kvtier-session "
                                     "metadata; see README \"Use with SGLang\"); without one use PutUnits/GetUnits")
        if session.ended:
            raise NotFound("the attach session has ended; open another")
        bufs = list(session.staging)  # the session's end may clear the list; the mappings outlive it
        if not 0 <= buffer < len(bufs):
            raise InvalidArgument(f"the session has {len(bufs)} staging buffers; there is no buffer {buffer}")
        shm = bufs[buffer]
        if offset < 0 or nbytes < 0 or offset + nbytes > shm.nbytes:
            raise InvalidArgument(f"bytes {offset}..{offset + nbytes} do not lie in staging buffer {buffer} "
                                  f"({shm.nbytes} bytes)")
        return shm.tensor()[offset:offset + nbytes]

    def staging(self, session: AttachSession, request: dict[str, Any]) -> tuple[dict[str, Any], SharedMemory]:
        """A new staging buffer of ``request["nbytes"]`` bytes for ``session``: anonymous shared memory
        of this session alone (never the host tier's memory, which holds every tenant's records),
        freed when the session ends. Returns the reply and the buffer (its descriptor goes with the reply).

        Raises:
            InvalidArgument: a bad size. ResourceExhausted: past ``attach_staging_bytes`` or
                :data:`MAX_STAGING_BUFFERS` for the session, or past ``attach_staging_tenant_bytes``
                for its tenant. NotFound: the session has ended.
        """
        nbytes = request.get("nbytes")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise InvalidArgument(f"nbytes must be a positive integer, got {nbytes!r}")
        limit = self.daemon.config.attach_staging_bytes
        if session.ended:
            raise NotFound("the attach session has ended")
        if len(session.staging) >= MAX_STAGING_BUFFERS or session.staging_bytes + nbytes > limit:
            raise ResourceExhausted(f"staging buffers of a session hold at most {limit} bytes in {MAX_STAGING_BUFFERS} "
                                    f"buffers ({session.staging_bytes} bytes in {len(session.staging)} now)")
        budget = self.daemon.config.attach_staging_tenant_bytes
        if not self.sessions.reserve_staging(session.tenant, nbytes, budget):
            raise ResourceExhausted(f"staging buffers of tenant {session.tenant!r} hold at most {budget} bytes (the "
                                    f"attach_staging_tenant_bytes budget; {self.sessions.staging_bytes(session.tenant)} "
                                    f"bytes now); end other sessions first")
        try:
            shm = SharedMemory.create(nbytes, f"kvtier-staging-{session.number}")
        except OSError as e:
            self.sessions.release_staging(session.tenant, nbytes)
            raise ResourceExhausted(f"could not make a {nbytes}-byte staging buffer: {e.strerror}") from None
        session.staging.append(shm)
        self.daemon.counters.add(Caller(session.tenant), "attach_staging_buffers")
        return {"staging": {"index": len(session.staging) - 1, "nbytes": nbytes}}, shm

    def prefix_call(self, session: AttachSession, request: dict[str, Any], *, received: float | None = None,
                    connected: Callable[[], bool] = always) -> dict[str, Any]:
        """LoadPrefix, StorePrefix or ReleasePrefix on the session's pool, in the session, from an
        attach-channel message (``kvtier.attach_wire``: keys hex, slots base64 int64): the same
        :class:`~kvtier.server.daemon.tier_runtime.TierRuntime` calls, checks and lease ownership as
        the gRPC methods, without HTTP/2 (a local worker's control path). Returns the reply (``id``
        echoed).

        The caller check is a gRPC call's (:func:`~kvtier.server.daemon.errors.still_wanted`, at the
        same points): the caller is there while ``connected()`` (its connection is open), its session
        lives, and the message's ``timeout_s`` (:func:`call_deadline`, counted from ``received``, a
        ``time.monotonic()``; now when None) has not run out (attack pass 8, A8-6).

        Raises:
            InvalidArgument: a malformed message (keys, slots, lease id, total_tokens, timeout_s), or what
                the prefix cache refuses. NotFound: the lease is not this session's, or the session ended.
                ResourceExhausted: the pool cannot make room. Unavailable: a tier is unhealthy.
                Cancelled: the caller gave up or left before the call changed anything.
        """
        kind = request.get("kind")
        caller = Caller(session.tenant, None, session)
        if session.entry is None:
            raise FailedPrecondition("prefix calls need an attached pool; a storage session has none")
        if session.ended:
            raise NotFound("the attach session has ended")
        deadline = call_deadline(request, time.monotonic() if received is None else received)

        def wanted() -> bool:
            return connected() and not session.ended and (deadline is None or time.monotonic() < deadline)

        pool_id, tiers = session.pool_id, self.daemon.tiers
        try:
            if kind == "load_prefix":
                keys = decode_keys(request.get("keys"))
                total = request.get("total_tokens")
                if total is not None and (isinstance(total, bool) or not isinstance(total, int)):
                    raise InvalidArgument(f"total_tokens must be an integer or null, got {total!r}")
                ld = tiers.load(caller, pool_id, keys, total, wanted)
                slots = ld.slots.to(torch.int64).contiguous().numpy().astype("<i8", copy=False).tobytes()
                reply: dict[str, Any] = {"lease_id": ld.lease, "slots": encode_slots(slots), "tiers": list(ld.tiers)}
            elif kind in ("store_prefix", "release_prefix"):
                lease = request.get("lease_id")
                if not isinstance(lease, str) or not lease:
                    raise InvalidArgument("lease_id must be a non-empty string")
                if kind == "release_prefix":
                    tiers.release(caller, pool_id, lease, wanted)
                    reply = {}
                else:
                    keys = decode_keys(request.get("keys"))
                    raw = decode_slots(request.get("slots"))
                    release = request.get("release", False)
                    if not isinstance(release, bool):
                        raise InvalidArgument("release must be true or false")
                    slots = torch.frombuffer(bytearray(raw), dtype=torch.int64) if raw else torch.empty(0, dtype=torch.int64)
                    reply = {"stored_pages": tiers.store(caller, pool_id, lease, keys, slots.tolist(), release=release,
                                                         wanted=wanted)}
            else:
                raise InvalidArgument(f"unknown prefix call {kind!r}")
        except WireError as e:
            raise InvalidArgument(str(e)) from None
        reply["id"] = request.get("id")
        return reply

    def abandon(self, session: AttachSession, reply: dict[str, Any]) -> None:
        """A prefix call's reply could not be sent: release the lease it took (the worker never heard
        of it), as a cancelled LoadPrefix over gRPC is released. Never raises."""
        lease = reply.get("lease_id")
        if isinstance(lease, str) and session.entry is not None:
            try:
                self.daemon.tiers.release(Caller(session.tenant, None, session), session.pool_id, lease)
            except Exception:  # noqa: BLE001 - ended meanwhile: the session's end released it
                log.debug("attach: an unsent lease was released already")


#: How far a client's ``sent_at`` may lie after the daemon's receipt and still be read on the
#: daemon's clock (seconds; later: another clock, ignored).
SENT_AT_SLACK_S = 1.0


def call_deadline(request: dict[str, Any], received: float) -> float | None:
    """The ``time.monotonic()`` by which a prefix call's caller gives up: its message's ``timeout_s``
    counted from when the client sent it (``sent_at``, the client's ``time.monotonic()``: one clock
    for every process of a host, which the attach socket is on), else from ``received``. A message
    that waited unread (in the socket, behind the channel's workers) has that wait counted: counted
    from the receipt, a call the client had been told failed was applied seconds later (attack pass 9,
    A9-1). A ``sent_at`` after the receipt by over :data:`SENT_AT_SLACK_S` cannot be on the daemon's
    clock and is ignored; a client in another time namespace whose clock is behind the daemon's by
    more than its timeouts finds its prefix calls CANCELLED (the attach guide says so). None without
    ``timeout_s`` (absent or null: a client that predates it).

    Raises:
        InvalidArgument: ``timeout_s`` is not a number, not finite, not above 0, or above
            :data:`~kvtier.attach_wire.MAX_TIMEOUT_S`; ``sent_at`` is not a finite number or null.
    """
    sent = request.get("sent_at")
    if sent is not None:
        try:  # an int too large for a float (10**400) is refused as one that is not finite (A10-3)
            ok = not isinstance(sent, bool) and isinstance(sent, (int, float)) and math.isfinite(float(sent))
        except OverflowError:
            ok = False
        if not ok:
            raise InvalidArgument(f"sent_at must be a finite number (the client's monotonic clock) or null, "
                                  f"got {str(sent)[:40]!r}")
        sent = float(sent)
    timeout = request.get("timeout_s")
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidArgument(f"timeout_s must be a number of seconds or null, got {str(timeout)[:40]!r}")
    if (isinstance(timeout, float) and not math.isfinite(timeout)) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise InvalidArgument(f"timeout_s must be above 0 and at most {MAX_TIMEOUT_S:g} seconds, got {timeout!r}"[:200])
    deadline = received + float(timeout)
    if sent is not None and sent <= received + SENT_AT_SLACK_S:
        deadline = min(deadline, float(sent) + float(timeout))
    return deadline
