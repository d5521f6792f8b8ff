"""Domain errors of the daemon and the ONE place that maps them to gRPC status codes.

Domain code (registry, pool operations, offload store, tiers, transfer) raises these typed errors;
servicers never pick status codes themselves. :class:`DomainErrorInterceptor`, installed on the
server by :func:`kvtier.server.service.server.create_server`, catches them around every RPC of every
service and aborts the call with the mapped code and the error's message.

Other modules add their own errors by subclassing one of these (e.g. a tier's "full" error
subclasses :class:`ResourceExhausted`); the mapping then applies without edits here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kvtier.server.transfer.errors import LayoutMismatchError, TransferEngineUnavailable, TransferError

log = logging.getLogger("kvtier.service")


class KVTierError(Exception):
    """Base of every domain error; the message says what was wrong (it reaches the client)."""


class InvalidArgument(KVTierError):
    """Bad slots, shapes, dtypes, lengths, names or values in a request (INVALID_ARGUMENT)."""


class NotFound(KVTierError):
    """Unknown pool id or key (NOT_FOUND)."""


class AlreadyExists(KVTierError):
    """A pool id or offload key that is already taken (ALREADY_EXISTS)."""


class ResourceExhausted(KVTierError):
    """Not enough free pages, host budget or memory for the request (RESOURCE_EXHAUSTED)."""


class Unavailable(KVTierError):
    """A tier the request needs is unhealthy (its storage failed: ENOSPC, EIO); retry once its health
    service (``kvtier.tier.<name>``) is SERVING again (UNAVAILABLE)."""


class FailedPrecondition(KVTierError):
    """The request does not fit the current layout or state: a host copy or peer whose layout
    differs from the pool's, indexer data for a skip-topk layer, deleting a busy pool (FAILED_PRECONDITION)."""


# The mapping, most specific first. ValueError/TypeError come from the pool core (which never
# imports grpc): its argument checks run before anything is written, so they are client errors.
STATUS_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
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


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    code = status_code_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error in %s", method)
        message = f"internal error: {type(exc).__name__}: {exc}"
    else:
        log.info("%s -> %s: %s", method, code.name, exc)
        message = str(exc)
    context.abort(code, message)


def _wrap_unary(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    def call(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behavior(request_or_iterator, context)
        except grpc.RpcError:
            raise  # the call was cancelled or already aborted
        except Exception as exc:  # noqa: BLE001 - mapped to a status code, never swallowed
            _abort(context, exc, method)
    return call


def _wrap_stream(behavior: Callable[..., Iterator[Any]], method: str) -> Callable[..., Iterator[Any]]:
    def call(request_or_iterator: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behavior(request_or_iterator, context)
        except grpc.RpcError:
            raise
        except Exception as exc:  # noqa: BLE001
            _abort(context, exc, method)
    return call


class DomainErrorInterceptor(grpc.ServerInterceptor):
    """Maps domain errors raised by any servicer method to gRPC status codes (see :data:`STATUS_CODES`)."""

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method), handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary, method), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method), handler.request_deserializer, handler.response_serializer)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream, method), handler.request_deserializer, handler.response_serializer)
        return handler
