"""How unit bytes travel between the backend and its daemon: one small interface, two movers.

The backend decides *what* moves (which keys, which part, which host pages) and gathers or scatters
the pages' bytes through a staging buffer; a :class:`UnitTransport` moves that buffer's bytes to or
from the daemon. A call's buffer is named, never looked up twice: a put is handed the :class:`Staged`
bytes the backend filled, and a get returns the very bytes its read filled, so a page reaches the
engine only from the buffer the daemon wrote it into (whichever buffer, session or mover that was):

* :class:`GrpcTransport`: the parts travel as gRPC streams (``StorageService.PutUnits`` /
  ``GetUnits``), chunked under the message limit: any daemon, local or remote.
* :class:`ShmTransport` (same machine): the backend opens a storage session on the daemon's attach
  channel (``kvtier.client.staging``); each thread that moves pages gets one of the session's staging
  buffers, anonymous shared memory the daemon made for this session alone and passed by SCM_RIGHTS.
  The backend gathers host pages straight into it, and ``PutUnitsStaged`` / ``GetUnitsStaged`` carry
  only keys, a buffer index and an offset: no page byte travels in a gRPC message.

``transport`` in the extra config picks: ``grpc``; ``shm`` (a unix-socket address only; a call that
cannot use shared memory fails: False, a miss and a log line); ``auto`` (the default: shm on a unix
socket, gRPC on TCP; a call that cannot get a staging buffer -- no session yet, more threads than
buffers, a unit larger than a buffer -- goes over gRPC).

Whole pages only, by construction: a gRPC get counts each unit's bytes as they arrive, in order, and
finds a unit only when all of them came in that attempt; a staged get's reply comes after the
daemon's copies into the region are done; and a staged call that ends without its reply (deadline,
cancel, broken connection, refusal) abandons its session, so a buffer the daemon may still be
writing into is never read or lent again. A reply with another number of found flags than keys
is an error (no hits).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvtier.addresses import is_unix, resolve_address
from kvtier.client import (
    CancelledError, DeadlineExceededError, FailedPreconditionError, KVTierClient, KVTierError, NotFoundError, UnavailableError,
)
from kvtier.client.staging import StagingBuffer, StagingSession
from kvtier.client.storage import UnitSpaceSpec
from kvtier.integrations.sglang.settings import BackendSettings

log = logging.getLogger("kvtier.sglang")
MAX_BUFFERS = 4          # staging buffers a backend holds at most (one per thread that moves pages)
REOPEN_AFTER_S = 5.0     # after a failed storage-session handshake, the next try waits this long
PAGE = 4096
# call failures after which the daemon may still be working on the call's staging buffer
UNANSWERED = (DeadlineExceededError, CancelledError, UnavailableError, NotFoundError)


class UnitTransport(Protocol):
    """Moves units' parts between this process and the daemon."""

    name: str

    def call_bytes(self) -> int:
        """The most bytes one put or get should move (the backend splits bigger batches)."""

    def staging(self, nbytes: int) -> Staged:
        """Staging bytes for one put, ``nbytes`` uint8 (this thread's buffer, reused between calls)."""

    def exists(self, space: UnitSpaceSpec, keys: list[bytes]) -> int:
        """Longest prefix of ``keys`` whose units are whole and present."""

    def put(self, space: UnitSpaceSpec, keys: list[bytes], part: str, data: Staged) -> list[bool]:
        """Store ``part`` of each key's unit from ``data`` (what :meth:`staging` gave, filled: unit
        ``i`` at byte ``i * part bytes``); per key whether the daemon accepted it."""

    def get(self, space: UnitSpaceSpec, keys: list[bytes], part: str) -> tuple[list[bool], torch.Tensor]:
        """Read ``part`` of each key's unit. Returns ``(found, data)``: per key whether its unit came
        whole, and ``data``, the ``(len(keys) * part bytes,)`` uint8 buffer this read filled (unit
        ``i`` at byte ``i * part bytes``; a key not found: anything), valid until this thread's next
        call. Raises KVTierError, RuntimeError (a reply that does not fit the request)."""

    def clear(self, space: UnitSpaceSpec) -> int:
        """Remove the space's units; returns how many."""

    def stats(self) -> dict[str, int]:
        """The daemon's unit counters of this tenant."""

    def close(self) -> None:
        """Release the connection."""


@dataclass
class Staged:
    """The staging bytes of one put: the backend fills ``tensor``, then hands this object to ``put``.

    Attributes:
        tensor: ``(nbytes,)`` uint8, contiguous host memory: a view of a shared-memory staging
            buffer, or of this thread's private gRPC buffer.
        held: the shared-memory buffer ``tensor`` lies in (lent to this thread); None: gRPC.
    """

    tensor: torch.Tensor
    held: _Held | None = None


def _found(found: Any, keys: list[bytes]) -> list[bool]:
    """The daemon's per-key answer, checked to be one flag a key (else RuntimeError: no hits)."""
    flags = [bool(f) for f in found]
    if len(flags) != len(keys):
        raise RuntimeError(f"the daemon answered {len(flags)} found flags for {len(keys)} keys")
    return flags


class GrpcTransport:
    """Unit parts as gRPC streams to any kvtier daemon (``settings.address``)."""

    name = "grpc"

    def __init__(self, settings: BackendSettings) -> None:
        self.client = KVTierClient(
            settings.address or None, timeout=settings.timeout_s, chunk_bytes=settings.chunk_bytes,
            max_message_bytes=settings.max_message_bytes, retries=1, token=settings.token or None,
            tls_root_cert=settings.tls_root_cert or None, tls_client_cert=settings.tls_client_cert or None,
            tls_client_key=settings.tls_client_key or None)
        self._local = threading.local()
        self._call_bytes = settings.staging_bytes
        # this backend's writer id: a unit's KV and indexer parts pair only when one writer sent both,
        # whichever way each travelled (gRPC or shared memory), so two engines writing one prefix
        # never get their parts joined (attack pass 4, A4-8)
        self.writer = uuid.uuid4().bytes

    def call_bytes(self) -> int:
        return self._call_bytes

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """This thread's private buffer, its first ``nbytes`` (grown when too small, else reused)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]

    def staging(self, nbytes: int) -> Staged:
        return Staged(self._buffer(nbytes))

    def exists(self, space: UnitSpaceSpec, keys: list[bytes]) -> int:
        return self.client.exist_units(space, keys)

    def put(self, space: UnitSpaceSpec, keys: list[bytes], part: str, data: Staged) -> list[bool]:
        return self.client.put_units(space, keys, part, data.tensor[:len(keys) * space.part_nbytes(part)],
                                     writer=self.writer).accepted

    def get(self, space: UnitSpaceSpec, keys: list[bytes], part: str) -> tuple[list[bool], torch.Tensor]:
        out = self._buffer(len(keys) * space.part_nbytes(part))
        return _found(self.client.get_units(space, keys, part, out), keys), out

    def clear(self, space: UnitSpaceSpec) -> int:
        return self.client.clear_units(space)

    def stats(self) -> dict[str, int]:
        return self.client.unit_stats()

    def close(self) -> None:
        self.client.close()


@dataclass
class _Held:
    """A staging buffer of ``session`` lent to one thread (returned when the thread ends)."""

    buffer: StagingBuffer
    session: StagingSession
    generation: int


def _give_back(ref: Any, buffer: StagingBuffer, generation: int) -> None:
    transport = ref()
    if transport is not None:
        transport._give_back(buffer, generation)


class ShmTransport:
    """Unit parts through a storage session's shared-memory staging buffers (a daemon on this machine).

    Presence, clear and stats are small calls and go over gRPC as always; puts and gets put the page
    bytes in this thread's staging buffer and send keys and offsets only.

    Args:
        settings: the backend's settings (a unix-socket ``address``).
        fallback: ``auto``: a call that cannot use a staging buffer goes over gRPC instead of failing.

    Threads: each thread that moves pages holds one buffer (at most :data:`MAX_BUFFERS` and the
    daemon's per-session budget); buffers of ended threads are lent again. A session that died (the
    daemon restarted) is replaced at the next call; calls still reading its buffers keep their mappings.
    After a failed handshake the next waits :data:`REOPEN_AFTER_S`, except once where it failed for an
    unreachable daemon and a gRPC call has reached it since (a restarted daemon: shared memory again
    at once, not after the daemon's whole downtime plus the wait).
    """

    name = "shm"

    def __init__(self, settings: BackendSettings, *, fallback: bool) -> None:
        self.settings = settings
        self.fallback = fallback
        self.grpc = GrpcTransport(settings)
        self.client = self.grpc.client
        self._lock = threading.Lock()        # the session, the free buffers (dict/list operations and the handshake)
        self._session: StagingSession | None = None
        self._generation = 0
        self._free: list[StagingBuffer] = []
        self._returned: deque[tuple[StagingBuffer, int]] = deque()   # (buffer, generation) of ended threads
        self._lent = 0
        self._max_buffers = MAX_BUFFERS
        self._buffer_bytes = settings.staging_bytes
        self._reopen_at = 0.0
        self._was_unreachable = False        # the last handshake failed with the daemon unreachable
        self._early_retry_used = False       # the one early retry since the last session opened was taken
        self._local = threading.local()
        self._counts_lock = threading.Lock()  # leaf: the two call counters
        self.staged_calls = 0                # calls through shared memory, calls sent over gRPC instead
        self.grpc_calls = 0

    # ----- the session and its buffers --------------------------------------------------------
    def _open(self) -> StagingSession:
        """The live session, opened if needed (caller holds ``_lock``). Raises KVTierError."""
        if self._session is not None and not self._session.closed:
            return self._session
        if time.monotonic() < self._reopen_at:
            raise KVTierError("the last storage-session handshake failed; retrying shortly")
        try:
            s = self.client.storage_session(timeout=self.settings.timeout_s)
        except KVTierError as e:
            self._reopen_at = time.monotonic() + REOPEN_AFTER_S
            self._was_unreachable = isinstance(e, UnavailableError)
            raise
        self._was_unreachable = self._early_retry_used = False
        self._max_buffers = max(1, min(MAX_BUFFERS, s.staging_max_buffers or MAX_BUFFERS))
        per = (s.staging_max_bytes // self._max_buffers) // PAGE * PAGE
        self._buffer_bytes = max(PAGE, min(self.settings.staging_bytes, per))
        self._session, self._free, self._lent = s, [], 0
        self._generation += 1
        log.info("kvtier backend: storage session open (tenant %r): up to %d staging buffers of %d bytes",
                 s.tenant, self._max_buffers, self._buffer_bytes)
        return s

    def _give_back(self, buffer: StagingBuffer, generation: int) -> None:
        """A lent buffer's holder died (its thread ended). Takes no lock: the finalizer runs wherever
        the holder dies -- inside the garbage collector, possibly in a thread holding ``_lock`` --
        so the buffer waits in ``_returned`` (a deque: append and popleft are atomic) until the
        next lending under ``_lock`` (:meth:`_reclaim`)."""
        self._returned.append((buffer, generation))

    def _reclaim(self) -> None:
        """Move the buffers of ended threads to the free list (caller holds ``_lock``); those of a
        session since replaced are dropped (never lent again)."""
        while self._returned:
            buffer, generation = self._returned.popleft()
            if generation == self._generation:
                self._free.append(buffer)
                self._lent -= 1

    def _thread_buffer(self) -> _Held | None:
        """This thread's buffer of the live session, lent now if it has none (None: all are lent)."""
        held: _Held | None = getattr(self._local, "held", None)
        if held is not None and held.generation == self._generation:
            return held
        with self._lock:
            session = self._open()
            gen = self._generation
            self._reclaim()
            if self._free:
                buf: StagingBuffer | None = self._free.pop()
            elif self._lent < self._max_buffers:
                buf = session.buffer(self._buffer_bytes, timeout=self.settings.timeout_s)
            else:
                return None
            self._lent += 1
        holder = _Held(buf, session, gen)
        weakref.finalize(holder, _give_back, weakref.ref(self), buf, gen)
        self._local.held = holder
        return holder

    def _drop_session(self, session: StagingSession | None) -> None:
        """Forget a session that failed (its buffers stay mapped for calls still reading them)."""
        with self._lock:
            if session is None or session is not self._session:
                return
            self._session, self._free, self._lent = None, [], 0
            self._generation += 1
        session.close(revoke=False)

    # ----- the interface ----------------------------------------------------------------------
    def call_bytes(self) -> int:
        """A staging buffer's size (the session is opened first if it can be: its budget sets it)."""
        if self._session is None:
            try:
                with self._lock:
                    self._open()
            except KVTierError:
                pass  # the call will go over gRPC (auto) or fail (shm); the size does not matter then
        return self._buffer_bytes

    def staging(self, nbytes: int) -> Staged:
        """This thread's staging buffer (shared memory) or, where none can be had and ``fallback``
        allows, its gRPC buffer. Raises FailedPreconditionError (strict ``shm`` without a buffer)."""
        try:
            held = self._thread_buffer()
            why = "every staging buffer is lent to another thread" if held is None else \
                f"{nbytes} bytes do not fit a {held.buffer.nbytes}-byte staging buffer" if nbytes > held.buffer.nbytes else ""
        except (KVTierError, OSError, ValueError) as e:
            held, why = None, f"no storage session ({type(e).__name__}: {e})"
        if not why:
            return Staged(held.buffer.tensor[:nbytes], held)  # type: ignore[union-attr]
        if not self.fallback:
            raise FailedPreconditionError(f"transport 'shm': {why}")
        return self.grpc.staging(nbytes)

    def _call(self, held: _Held, fn: Any) -> Any:
        """``fn(session client, buffer index)`` on ``held``'s buffer. A call that ends without the
        daemon's answer (deadline, cancel, a broken connection, anything not a status the daemon
        sent) may leave the daemon still copying into the buffer (a get) or out of it (a put): its
        session is abandoned then, so the buffer is never read, refilled or lent again. A status the
        daemon sent (a refusal) means its handler is done with the buffer: the session is kept."""
        try:
            return fn(held.session.client, held.buffer.index)
        except BaseException as e:
            if not isinstance(e, KVTierError) or isinstance(e, UNANSWERED):
                self._drop_session(held.session)
            raise

    def _staged(self, held: _Held, fn: Any, carry: int = 0) -> tuple[Any, _Held]:
        """``fn(session client, buffer index)`` in the session that owns ``held``'s buffer. If that
        session has ended (the daemon restarted), once more in a new session, the first ``carry``
        bytes of the old buffer (a put's parts) copied into the new one first. Returns ``fn``'s
        answer and the buffer it used (a get's bytes are there)."""
        try:
            out = self._call(held, fn)
        except (NotFoundError, UnavailableError):   # the session ended (daemon restarted or gone)
            fresh = self._thread_buffer()          # a new session (raises KVTierError if there is none)
            if fresh is None or fresh.buffer.nbytes < carry:
                raise
            if carry:
                fresh.buffer.tensor[:carry].copy_(held.buffer.tensor[:carry])  # the old mapping is still ours
            held, out = fresh, self._call(fresh, fn)
        self._counted("staged_calls")
        return out, held

    def _reached(self) -> None:
        """A gRPC call just reached the daemon: if the last handshake failed only because it was
        unreachable (it restarted), the next call may try again now (once until a session opens)."""
        if self._was_unreachable and not self._early_retry_used:
            with self._lock:
                if self._was_unreachable and not self._early_retry_used:
                    self._reopen_at, self._was_unreachable, self._early_retry_used = 0.0, False, True

    def _counted(self, name: str) -> None:
        with self._counts_lock:
            setattr(self, name, getattr(self, name) + 1)

    def exists(self, space: UnitSpaceSpec, keys: list[bytes]) -> int:
        n = self.grpc.exists(space, keys)
        self._reached()
        return n

    def put(self, space: UnitSpaceSpec, keys: list[bytes], part: str, data: Staged) -> list[bool]:
        nbytes = len(keys) * space.part_nbytes(part)
        if data.held is None:
            self._counted("grpc_calls")
            ok = self.grpc.put(space, keys, part, data)
            self._reached()
            return ok
        writer = self.grpc.writer
        ok, _ = self._staged(data.held, lambda c, i: c.put_units_staged(space, keys, part, i, writer=writer).accepted,
                             carry=nbytes)
        return ok

    def get(self, space: UnitSpaceSpec, keys: list[bytes], part: str) -> tuple[list[bool], torch.Tensor]:
        nbytes = len(keys) * space.part_nbytes(part)
        held = self.staging(nbytes).held
        if held is None:
            self._counted("grpc_calls")
            out = self.grpc.get(space, keys, part)
            self._reached()
            return out
        found, used = self._staged(held, lambda c, i: c.get_units_staged(space, keys, part, i))
        return _found(found, keys), used.buffer.tensor[:nbytes]

    def clear(self, space: UnitSpaceSpec) -> int:
        return self.grpc.clear(space)

    def stats(self) -> dict[str, int]:
        return self.grpc.stats()

    def close(self) -> None:
        """End the storage session and the gRPC channel. The mappings are not revoked (a revoked
        mapping reads zeros): a read another thread is still copying out of keeps its bytes."""
        with self._lock:
            session, self._session, self._free = self._session, None, []
            self._generation += 1
        if session is not None:
            session.close(revoke=False)
        self.grpc.close()


def make_transport(settings: BackendSettings) -> UnitTransport:
    """The transport ``settings.transport`` names (``auto``: shm on a unix socket, else gRPC).

    Raises:
        ValueError: ``shm`` with a TCP address (shared memory needs the daemon's unix socket).
    """
    unix = is_unix(resolve_address(settings.address or None))
    if settings.transport == "shm" and not unix:
        raise ValueError(f"kvtier backend: transport 'shm' needs the daemon's unix socket on this machine; "
                         f"{settings.address!r} is a TCP address (use transport 'grpc' or 'auto')")
    if settings.transport == "grpc" or not unix:
        return GrpcTransport(settings)
    return ShmTransport(settings, fallback=settings.transport == "auto")
