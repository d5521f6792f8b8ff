"""Helpers shared by the commands that talk to a daemon (``status``, ``pools``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click
from google.protobuf.message import Message

F = TypeVar("F", bound=Callable[..., Any])


def _address(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """Check ``--server`` (a bare path becomes a unix socket); a bad one is a one-line usage error."""
    from kvtier.addresses import resolve_address

    if not value:
        return None
    try:
        return resolve_address(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


class _Seconds(click.FloatRange):
    """A finite number of seconds in a range (click's FloatRange lets NaN and inf through)."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        import math

        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return v


SECONDS = _Seconds(min=0.1, max=86400)
"""``--timeout``'s type: 0.1 to 86,400 seconds, finite."""


def server_options(fn: F) -> F:
    """``--server ADDR`` and ``--timeout SECONDS`` for a command that calls a daemon."""
    fn = click.option("--timeout", type=SECONDS, default=10.0, show_default=True,
                      help="Deadline of each call, seconds.")(fn)
    return click.option("--server", "server", default=None, metavar="ADDR", envvar="KVTIER_SERVER", callback=_address,
                        help="Daemon address: unix:///path, a socket path (/run/kvtier/kv.sock) or HOST:PORT "
                             "(env KVTIER_SERVER). Default: the default unix socket.")(fn)


def message_to_dict(msg: Message) -> dict[str, Any]:
    """Every field of ``msg`` (defaults included) as plain JSON-ready values; 64-bit ints stay ints."""
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            out[f.name] = {k: (message_to_dict(v) if isinstance(v, Message) else v) for k, v in value.items()}
        elif f.is_repeated:
            out[f.name] = [message_to_dict(v) if isinstance(v, Message) else v for v in value]
        elif f.message_type is not None:
            out[f.name] = message_to_dict(value) if msg.HasField(f.name) else None
        elif f.enum_type is not None:
            out[f.name] = f.enum_type.values_by_number[value].name
        else:
            out[f.name] = value
    return out


def open_client(server: str | None, timeout: float) -> Any:
    """A :class:`kvtier.client.KVTierClient` for a command; a setting it refuses (a ``$KVTIER_TOKEN``
    a header cannot carry, a token for a remote address without TLS) is a one-line CLI error."""
    from kvtier.client import KVTierClient

    try:
        return KVTierClient(server, timeout=timeout)
    except ValueError as e:
        raise click.ClickException(str(e)) from None


def call_daemon(fn: Callable[[], Any]) -> Any:
    """Run ``fn``; turn a client error into a clean CLI error (exit 1, the daemon's message)."""
    from kvtier.client.errors import KVTierError

    import grpc

    try:
        return fn()
    except KVTierError as e:
        if getattr(e, "code", None) == grpc.StatusCode.UNAVAILABLE:
            head, sep, grpc_says = e.details.partition("; gRPC: ")
            where = head.split(" (", 1)[0] if sep and head.startswith("no kvtier daemon answers at ") else \
                "no kvtier daemon answers there"
            raise click.ClickException(
                f"{where} (start one with `kvtier serve`, or pass --server ADDR; a daemon with --tls-cert needs "
                f"KVTIER_TLS_CA=its CA file): UNAVAILABLE: {grpc_says if sep else e.details}") from None
        if getattr(e, "code", None) == grpc.StatusCode.UNAUTHENTICATED:
            raise click.ClickException(
                "the daemon serves tenants and did not accept this call's token: set KVTIER_TOKEN to a token "
                "from its --auth-tokens file") from None
        raise click.ClickException(str(e)) from None


def console() -> Any:
    """A rich console: the terminal's width on a terminal, 160 columns when piped (no truncated tables)."""
    import sys

    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def shown(text: str) -> str:
    """``text`` from a daemon (a pool id, a model name) made safe for a rich table: each control or
    other non-printable character written as its Python escape (``\\x1b``) and rich markup escaped,
    so no name a client set can reach the operator's terminal as an escape sequence or restyle the
    table (attack pass 7, A7-9; the daemon refuses such names too, but an older daemon took them)."""
    from rich.markup import escape

    text = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in str(text))
    return escape(text)
