"""The ONE place that maps the daemon's domain errors to gRPC status codes.

Domain code (``kvtier.server.daemon``: registry, KV operations, offload store, tiers, transfer,
tenants) raises the typed errors of :mod:`kvtier.server.daemon.errors`; servicers never pick status
codes themselves. :class:`DomainErrorInterceptor`, installed on the
server by :func:`kvtier.server.service.server.create_server`, catches them around every RPC of every
service and aborts the call with the mapped code and the error's message.

Other modules add their own errors by subclassing one of the domain errors (e.g. a tier's "full"
error subclasses :class:`ResourceExhausted`); the mapping then applies without edits here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kvtier.server.daemon.errors import (
    RETRY_UNCHANGED, AlreadyExists, Busy, Cancelled, FailedPrecondition, InvalidArgument, KVTierError, NotFound, ResourceExhausted, Unauthenticated,
    Unavailable,
)
from kvtier.server.service.interceptors import handler_like
from kvtier.server.tiers.errors import TierUnavailableError
from kvtier.server.transfer.errors import LayoutMismatchError, TransferEngineUnavailable, TransferError

log = logging.getLogger("kvtier.service")

__all__ = [
    "AlreadyExists", "Cancelled", "DomainErrorInterceptor", "FailedPrecondition", "InvalidArgument", "KVTierError", "NotFound",
    "ResourceExhausted", "STATUS_CODES", "Unauthenticated", "Unavailable", "status_code_for",
]


# The mapping, most specific first. ValueError/TypeError come from the pool core (which never
# imports grpc): its argument checks run before anything is written, so they are client errors.
STATUS_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (TierUnavailableError, grpc.StatusCode.UNAVAILABLE),  # a tier that went unhealthy mid-call; retry later
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (Cancelled, grpc.StatusCode.CANCELLED),  # the caller went away first; nothing was changed
    (LayoutMismatchError, grpc.StatusCode.FAILED_PRECONDITION),  # PD peers' layouts differ; nothing moved
    (TransferEngineUnavailable, grpc.StatusCode.FAILED_PRECONDITION),
    (TransferError, grpc.StatusCode.ABORTED),  # moving bytes failed; the destination pages were freed
    (MemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (TypeError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    """The status code for ``exc``: the first matching entry of :data:`STATUS_CODES`, else INTERNAL."""
    for cls, code in STATUS_CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


# A status message travels in the call's trailing metadata, which gRPC caps (8 KiB by default): a
# message that echoes a huge input would replace the real status with RESOURCE_EXHAUSTED "metadata
# size exceeds". Longer messages are cut, keeping their start (what failed) and saying so.
MAX_MESSAGE_CHARS = 1024


def short_message(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters (a marker says how many were left out)."""
    if len(text) <= limit:
        return text
    tail = f"... ({len(text) - limit + 40} characters left out)"
    return text[:limit - len(tail)] + tail


class _Undecodable:
    """What the request deserializer yields for bytes that are not a valid request message: the call
    is then answered INVALID_ARGUMENT by the method's wrapper (gRPC itself would answer INTERNAL)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def des(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends: the client's bytes
            return _Undecodable(f"{type(exc).__name__}: {exc}")
    return des


def _undecodable(method: str, reason: str) -> InvalidArgument:
    return InvalidArgument(f"the request to {method} is not a valid message of its type ({reason}); "
                           "use the stubs generated from proto/kvtier/v1")


def _checked_stream(requests: Iterator[Any], method: str) -> Iterator[Any]:
    for req in requests:
        if isinstance(req, _Undecodable):
            raise _undecodable(method, req.reason)
        yield req


def _checked(request_or_iterator: Any, method: str) -> Any:
    if isinstance(request_or_iterator, _Undecodable):
        raise _undecodable(method, request_or_iterator.reason)
    if hasattr(request_or_iterator, "__next__"):  # a client stream
        return _checked_stream(request_or_iterator, method)
    return request_or_iterator


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    code = status_code_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error in %s", method)
        message = f"internal error: {type(exc).__name__}: {exc}"
    else:
        # a Busy answer is retried by the client until the claim ends: one line per attempt would flood the log
        log.log(logging.DEBUG if isinstance(exc, Busy) else logging.INFO, "%s -> %s: %s", method, code.name,
                short_message(str(exc)))
        message = str(exc)
    if isinstance(exc, KVTierError) and exc.unchanged:  # nothing changed: the client may retry even a write
        context.set_trailing_metadata((RETRY_UNCHANGED,))
    context.abort(code, short_message(message))


def _wrap_unary(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    def call(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behavior(_checked(request_or_iterator, method), context)
        except grpc.RpcError:
            raise  # the call was cancelled or already aborted
        except Exception as exc:  # noqa: BLE001 - mapped to a status code, never swallowed
            _abort(context, exc, method)
    return call


def _wrap_stream(behavior: Callable[..., Iterator[Any]], method: str) -> Callable[..., Iterator[Any]]:
    def call(request_or_iterator: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behavior(_checked(request_or_iterator, method), context)
        except grpc.RpcError:
            raise
        except Exception as exc:  # noqa: BLE001
            _abort(context, exc, method)
    return call


class DomainErrorInterceptor(grpc.ServerInterceptor):
    """Maps domain errors raised by any servicer method to gRPC status codes (see :data:`STATUS_CODES`),
    answers bytes that are not a valid request message INVALID_ARGUMENT (gRPC's own answer would be
    INTERNAL), and cuts status messages to :data:`MAX_MESSAGE_CHARS`."""

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        return handler_like(handler, lambda b: _wrap_unary(b, method), streaming=lambda b: _wrap_stream(b, method),
                            deserializer=_tolerant(handler.request_deserializer))


def caller_waits(context: grpc.ServicerContext) -> Callable[[], bool]:
    """The ``wanted`` check of a call that changes state: its caller is still there, neither cancelled
    nor past its deadline. ``is_active()`` alone lags the deadline (gRPC cancels the call a moment
    later): a CreatePool whose deadline had passed still saw True with ``time_remaining()`` 0, and its
    pool was made though its caller was told DEADLINE_EXCEEDED (attack pass 7, A7-5)."""

    def wanted() -> bool:
        if not context.is_active():
            return False
        remaining = context.time_remaining()
        return remaining is None or remaining > 0

    wanted.time_left = context.time_remaining  # type: ignore[attr-defined]  # (time_left_of)
    return wanted
