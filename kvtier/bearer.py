"""Bearer tokens: what one may hold. The client checks a token before its first call; the daemon
checks every token of its ``--auth-tokens`` file at start, so a token one side takes the other can send."""

from __future__ import annotations

TOKEN_CHARS = "visible ASCII (! to ~, no space)"
"""What a bearer token may hold: a gRPC header value carries printable ASCII only, and the token
follows ``Bearer `` (RFC 6750 ``b64token`` is a subset; ``secrets.token_urlsafe`` fits)."""


def check_token(token: str, source: str = "token") -> None:
    """Refuse a bearer token a gRPC header cannot carry, before any call (gRPC itself would fail
    every call with INTERNAL "Invalid metadata").

    Raises:
        ValueError: one line naming ``source`` and the first bad character's position (never the token).
    """
    for i, ch in enumerate(token, 1):
        if not "!" <= ch <= "~":
            raise ValueError(f"{source} holds a character a gRPC header cannot carry (character #{i}, "
                             f"code {ord(ch)}); a token is {TOKEN_CHARS}, e.g. from "
                             f"`python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
