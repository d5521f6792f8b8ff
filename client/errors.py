"""Errors the client raises: one class per gRPC status code the daemon uses, all :class:`KVTierError`."""

from __future__ import annotations

import grpc

RETRY_UNCHANGED = ("kvtier-retry", "unchanged")
"""Trailing metadata the daemon adds to an answer that changed nothing (the wire contract; the daemon's
``kvtier.server.daemon.errors.RETRY_UNCHANGED``)."""


class KVTierError(Exception):
    """A call failed. ``code`` is the gRPC status code, ``details`` the daemon's message;
    ``unchanged``: the daemon said it changed nothing (trailing metadata ``kvtier-retry: unchanged``,
    e.g. slots a write still arriving is writing), so even a write may be sent again."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    unchanged: bool = False

    def __init__(self, details: str, code: grpc.StatusCode | None = None, unchanged: bool = False) -> None:
        super().__init__(details)
        self.details = details
        self.unchanged = unchanged
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


class InvalidArgumentError(KVTierError):
    """Bad slots, shapes, dtypes, lengths or values; nothing was changed."""
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(KVTierError):
    """Unknown pool or key."""
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(KVTierError):
    """Pool id or offload key already taken."""
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhaustedError(KVTierError):
    """No free pages, host budget, memory, or a message above the size limit."""
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(KVTierError):
    """Layout mismatch (skip mask, page size, dtype...) or a state that forbids the call."""
    code = grpc.StatusCode.FAILED_PRECONDITION


class UnavailableError(KVTierError):
    """The daemon could not be reached (after the retries allowed for the call), or a tier the call
    needs is unhealthy (e.g. the disk tier on a full filesystem; the message names it): retry later."""
    code = grpc.StatusCode.UNAVAILABLE


class UnauthenticatedError(KVTierError):
    """The daemon serves tenants and the call had no known token (pass ``token=`` or set KVTIER_TOKEN)."""
    code = grpc.StatusCode.UNAUTHENTICATED


class DeadlineExceededError(KVTierError):
    """The call's deadline passed; for a write, nothing was written."""
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class AbortedError(KVTierError):
    """A transfer failed while moving bytes (PullKV: the peer went away, the engine failed); the
    destination pages it named were freed (the message says which)."""
    code = grpc.StatusCode.ABORTED


class CancelledError(KVTierError):
    """The call was cancelled (by the client, or by the daemon's stream watchdog) before it changed anything."""
    code = grpc.StatusCode.CANCELLED


_BY_CODE: dict[grpc.StatusCode, type[KVTierError]] = {
    cls.code: cls for cls in (InvalidArgumentError, NotFoundError, AlreadyExistsError, ResourceExhaustedError,
                              FailedPreconditionError, UnavailableError, DeadlineExceededError, UnauthenticatedError,
                              AbortedError, CancelledError)
}


def from_rpc_error(err: grpc.RpcError) -> KVTierError:
    """The :class:`KVTierError` subclass for a failed call's status code (``KVTierError`` for others)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    cls = _BY_CODE.get(code, KVTierError)
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    unchanged = any(tuple(kv) == RETRY_UNCHANGED for kv in (trailing or ()))
    return cls(details, code, unchanged)


def from_code_name(name: str, details: str, unchanged: bool = False) -> KVTierError:
    """The :class:`KVTierError` subclass for a status code given by name (the attach channel's errors;
    ``unchanged``: the reply said the daemon changed nothing)."""
    code = getattr(grpc.StatusCode, str(name), grpc.StatusCode.UNKNOWN)
    return _BY_CODE.get(code, KVTierError)(details, code, unchanged)
