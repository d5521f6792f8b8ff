"""Typed errors of the daemon's domain.

Domain code (registry, KV operations, offload store, tier runtime, transfer, tenants) raises these;
it never picks a status code. The one mapping to gRPC status codes lives in
``kvtier.server.service.errors``. Other modules add errors by subclassing one of these (e.g. a
tier's "full" error subclasses :class:`ResourceExhausted`); the mapping then applies unchanged.
"""

from __future__ import annotations

from collections.abc import Callable


class KVTierError(Exception):
    """Base of every domain error; the message says what was wrong (it reaches the client).

    ``unchanged``: True on the errors raised before the call changed anything and only because of
    a passing state (:class:`Busy`, :class:`StreamsFull`); their answer carries
    :data:`RETRY_UNCHANGED`, so a caller may send even a write again."""

    unchanged: bool = False


class InvalidArgument(KVTierError):
    """Bad slots, shapes, dtypes, lengths, names or values in a request (INVALID_ARGUMENT)."""


class NotFound(KVTierError):
    """Unknown pool id, key or lease -- or one that belongs to another tenant (NOT_FOUND)."""


class AlreadyExists(KVTierError):
    """A pool id or offload key that is already taken (ALREADY_EXISTS)."""


class ResourceExhausted(KVTierError):
    """Not enough free pages, tier room, memory, quota or stream slots for the request (RESOURCE_EXHAUSTED)."""


class StreamsFull(ResourceExhausted):
    """Every KV stream slot (``--max-streams``) is taken, or the caller's tenant holds its share of them
    (``--max-streams-per-tenant``), or every slot of the open streams (health ``Watch`` and
    reflection, ``open_streams.py``) is: refused before anything of the call ran; a
    slot comes back when a stream ends (RESOURCE_EXHAUSTED, with :data:`RETRY_UNCHANGED` in the
    trailing metadata). A PullKV whose peer answers this to a ReadPages retries it within its deadline."""

    unchanged = True


class Unavailable(KVTierError):
    """A tier the request needs is unhealthy (its storage failed: ENOSPC, EIO); retry once its health
    service (``kvtier.tier.<name>``) is SERVING again (UNAVAILABLE)."""


class Busy(Unavailable):
    """Refused before anything changed, because another call holds what this one names for a short
    while (pages a WriteKV still arriving is writing in place); retrying is safe for any call, write
    or not (UNAVAILABLE, with :data:`RETRY_UNCHANGED` in the trailing metadata)."""

    unchanged = True


RETRY_UNCHANGED = ("kvtier-retry", "unchanged")
"""Trailing metadata of an answer whose error is ``unchanged`` (:class:`Busy`, :class:`StreamsFull`): the daemon changed nothing, so a client may retry
even a call that is not idempotent."""


class FailedPrecondition(KVTierError):
    """The request does not fit the current layout or state: a host copy or peer whose layout
    differs from the pool's, indexer data for a skip-topk layer, deleting a busy pool (FAILED_PRECONDITION)."""


class Cancelled(KVTierError):
    """The call was cancelled or ran past its deadline before it changed anything (CANCELLED): e.g. a
    WriteKV whose commit found its call no longer active (its client cannot learn of the result)."""


class Unauthenticated(KVTierError):
    """A call without a valid bearer token on a daemon with tenants (UNAUTHENTICATED)."""


def always() -> bool:
    """The default ``wanted`` of a call made in process (no client that could give up)."""
    return True


def still_wanted(wanted: Callable[[], bool], call: str) -> None:
    """Raise Cancelled unless ``wanted()`` (the call is still active: not cancelled, not past its
    deadline). A call that changes the pool checks it once it holds the pool's lock, before it
    changes anything: a caller that gave up while the call waited for the lock was told it failed,
    so the call must change nothing (attack pass 4, A4-6: AllocateSlots and Restore past their
    deadline still ran, leaking pages nobody knew of and dropping the restored copy)."""
    if not wanted():
        raise Cancelled(f"the {call} was cancelled or ran past its deadline while it waited; nothing was changed")


def time_left_of(wanted: Callable[[], bool]) -> Callable[[], float | None] | None:
    """The seconds-to-deadline function a ``wanted`` check carries (a gRPC call's, set by the
    service's ``caller_waits``), or None (no deadline known): a call that must answer before its
    caller's deadline bounds its last waits by it."""
    return getattr(wanted, "time_left", None)
