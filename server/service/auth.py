"""Who a call is made as: bearer-token metadata -> :class:`~kvtier.server.daemon.tenants.Caller`.

:class:`AuthInterceptor` runs around every RPC. Without a token table (no ``--auth-tokens``) every
call is tenant ``default``. With one, a call must carry ``authorization: Bearer <token>`` metadata
naming a known token (compared in constant time by the table), else it is refused with
UNAUTHENTICATED before any servicer code runs. The health and reflection services stay open.

The servicers get the caller explicitly: the interceptor hands them a context that carries it
(:func:`caller_of`), and they pass it into every domain call. Tokens are never logged.

An attached worker's calls carry ``x-kvtier-session: <session id>`` metadata (README "Local
attach"); the interceptor resolves it in the caller's tenant and the caller makes its calls in that
session. An id that names no live session of the tenant is refused with NOT_FOUND before any
servicer code runs (its slots were freed when it ended: nothing may act on them as its owner).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvtier.attach_wire import SESSION_METADATA
from kvtier.server.daemon.errors import Unauthenticated
from kvtier.server.daemon.sessions import SessionRegistry
from kvtier.server.daemon.tenants import Caller, TokenTable, authenticate
from kvtier.server.service.interceptors import handler_like, mark_refusal

log = logging.getLogger("kvtier.service")

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
AUTH_HEADER = "authorization"


class CallerContext:
    """A servicer context that also carries the call's :class:`Caller` (everything else is the real context's)."""

    def __init__(self, context: grpc.ServicerContext, caller: Caller) -> None:
        self._context = context
        self.caller = caller

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def caller_of(context: Any) -> Caller:
    """The caller of a call handed through :class:`AuthInterceptor`.

    Raises:
        Unauthenticated: a context the interceptor did not see (never served without it).
    """
    caller = getattr(context, "caller", None)
    if not isinstance(caller, Caller):
        raise Unauthenticated("the call carries no authenticated caller")
    return caller


def bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The token of the first ``authorization: Bearer <token>`` entry (None if there is none)."""
    for key, value in metadata or ():
        if key.lower() == AUTH_HEADER and isinstance(value, str):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def metadata_value(metadata: Sequence[tuple[str, Any]] | None, key: str) -> str | None:
    """The value of the first ``key`` entry of ``metadata`` (None if there is none)."""
    for k, value in metadata or ():
        if k.lower() == key and isinstance(value, str):
            return value
    return None


def _wrap(behavior: Callable[..., Any], caller: Caller) -> Callable[..., Any]:
    def call(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
        return behavior(request_or_iterator, CallerContext(context, caller))
    return call


def _refuse(message: str, code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED) -> Callable[..., Any]:
    def call(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)
    return call


class AuthInterceptor(grpc.ServerInterceptor):
    """Resolves each call's caller from its metadata (see the module docstring).

    Args:
        tokens: the daemon's token table; None: no auth, every call is tenant ``default``.
        timer: the RPC latency interceptor (``observability.RpcMetricsInterceptor``) installed inside
            this one, if any: a call refused here never reaches it, so the refusal is timed through
            its ``time_refusal``.
        sessions: the daemon's attach sessions (``x-kvtier-session`` metadata is resolved there);
            None: such metadata is refused.
    """

    def __init__(self, tokens: TokenTable | None, *, timer: Any = None, sessions: SessionRegistry | None = None) -> None:
        self.tokens = tokens
        self.timer = timer
        self.sessions = sessions

    def _refusal(self, handler: grpc.RpcMethodHandler, method: str, message: str, code: grpc.StatusCode) -> grpc.RpcMethodHandler:
        refuse = _refuse(message, code)
        if self.timer is not None:
            refuse = self.timer.time_refusal(refuse, method)
        # marked: it needs no request message, so arrival.py answers it without waiting for one (a
        # client without a token holds no thread while it sends nothing)
        return handler_like(handler, lambda _b: mark_refusal(refuse))

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        metadata = handler_call_details.invocation_metadata
        token = bearer_token(metadata) if self.tokens is not None else None
        try:
            caller = authenticate(self.tokens, token)
        except Unauthenticated as e:
            log.info("%s -> UNAUTHENTICATED: %s", method, "unknown token" if token else "no token")
            return self._refusal(handler, method, str(e), grpc.StatusCode.UNAUTHENTICATED)
        session_id = metadata_value(metadata, SESSION_METADATA)
        if session_id is not None:
            session = self.sessions.get(caller.tenant, session_id) if self.sessions is not None else None
            if session is None:
                log.info("%s -> NOT_FOUND: an unknown or ended attach session", method)
                return self._refusal(handler, method, "the attach session is unknown or has ended (its slots and "
                                     "leases were given back); attach again", grpc.StatusCode.NOT_FOUND)
            caller = caller.in_session(session)
        return handler_like(handler, lambda b: _wrap(b, caller))
