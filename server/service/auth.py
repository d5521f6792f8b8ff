"""Who a call is made as: bearer-token metadata -> :class:`~kvtier.server.daemon.tenants.Caller`.

:class:`AuthInterceptor` runs around every RPC. Without a token table (no ``--auth-tokens``) every
call is tenant ``default``. With one, a call must carry ``authorization: Bearer <token>`` metadata
naming a known token (compared in constant time by the table), else it is refused with
UNAUTHENTICATED before any servicer code runs. The health and reflection services stay open.

The servicers get the caller explicitly: the interceptor hands them a context that carries it
(:func:`caller_of`), and they pass it into every domain call. Tokens are never logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvtier.server.daemon.errors import Unauthenticated
from kvtier.server.daemon.tenants import Caller, TokenTable
from kvtier.server.service.interceptors import handler_like

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


def _wrap(behavior: Callable[..., Any], caller: Caller) -> Callable[..., Any]:
    def call(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
        return behavior(request_or_iterator, CallerContext(context, caller))
    return call


def _refuse(message: str) -> Callable[..., Any]:
    def call(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
    return call


class AuthInterceptor(grpc.ServerInterceptor):
    """Resolves each call's caller from its metadata (see the module docstring).

    Args:
        tokens: the daemon's token table; None: no auth, every call is tenant ``default``.
        timer: the RPC latency interceptor (``observability.RpcMetricsInterceptor``) installed inside
            this one, if any: a call refused here never reaches it, so the refusal is timed through
            its ``time_refusal``.
    """

    def __init__(self, tokens: TokenTable | None, *, timer: Any = None) -> None:
        self.tokens = tokens
        self.timer = timer

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        if self.tokens is None:
            return handler_like(handler, lambda b: _wrap(b, Caller.default()))
        token = bearer_token(handler_call_details.invocation_metadata)
        tenant = self.tokens.tenant_for(token)
        if tenant is None:
            why = "unknown token" if token else "no token"
            log.info("%s -> UNAUTHENTICATED: %s", method, why)
            message = (f"{why}: this daemon serves tenants; send `authorization: Bearer <token>` metadata "
                       f"(KVTierClient(token=...) or KVTIER_TOKEN) with a token from its --auth-tokens file")
            refuse = _refuse(message)
            if self.timer is not None:
                refuse = self.timer.time_refusal(refuse, method)
            return handler_like(handler, lambda _b: refuse)
        return handler_like(handler, lambda b: _wrap(b, Caller(tenant, token)))
