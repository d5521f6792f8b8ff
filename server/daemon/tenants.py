"""Tenants: who a call is made as, the bearer-token table that says so, and tenant-namespaced tier keys.

A :class:`Caller` is passed explicitly into every domain call (never a global): it names the tenant
whose pools, offloaded copies, prefix namespace and leases the call may see. Another tenant's things
are NOT_FOUND, with the same message as something absent, so existence never leaks.

Without ``--auth-tokens`` there is one tenant, :data:`DEFAULT_TENANT`. With it, a
:class:`TokenTable` maps bearer tokens (``authorization: Bearer <token>`` metadata) to tenants; the
service layer turns metadata into a :class:`Caller` (``kvtier.server.service.auth``).

Tier keys carry the tenant *above* the tiers (:func:`tenant_key`): ``b"t" + len(name) + name + rest``.
The tiers store opaque byte keys and never know tenants; :func:`tenant_of_key` reads the tenant back
for per-tenant quotas and usage, :func:`key_body` the rest (its namespace, ``p:``/``o:``, first) for
a tier that keeps only some namespaces (the shared Mooncake Store tier: prefix pages only).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_TENANT = "default"
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MIN_TOKEN_CHARS = 16
_KEY_TAG = b"t"


class AuthConfigError(ValueError):
    """The tokens file cannot be used (permissions, owner, format); the message is one line."""


def check_tenant_name(name: str) -> str:
    """``name`` if it is a valid tenant name (1-64 of ``A-Za-z0-9_.-``, not starting with ``.-_``).

    Raises:
        ValueError: naming the rule.
    """
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise ValueError(f"tenant names are 1-64 characters of A-Z a-z 0-9 _ . - starting with a letter or digit, got {name!r}")
    return name


@dataclass(frozen=True)
class Caller:
    """Who a call is made as.

    Attributes:
        tenant: the tenant's name.
        token: the bearer token the call presented (None without auth). Never printed (``repr``
            hides it) and never logged; PullKV forwards it to the peer daemon.
    """

    tenant: str
    token: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_tenant_name(self.tenant)

    @classmethod
    def default(cls) -> Caller:
        """The one tenant of a daemon without ``--auth-tokens``."""
        return cls(DEFAULT_TENANT)


def tenant_key(tenant: str, rest: bytes) -> bytes:
    """A tier key in ``tenant``'s namespace: ``b"t" + bytes([len(tenant)]) + tenant + rest``."""
    name = tenant.encode()
    return _KEY_TAG + bytes([len(name)]) + name + rest


def tenant_of_key(key: object) -> str | None:
    """The tenant a tier key belongs to (None for a key not made by :func:`tenant_key`)."""
    if not isinstance(key, bytes) or len(key) < 3 or key[:1] != _KEY_TAG:
        return None
    n = key[1]
    if len(key) < 2 + n or n == 0:
        return None
    try:
        return key[2:2 + n].decode()
    except UnicodeDecodeError:
        return None


def key_body(key: bytes) -> bytes:
    """The ``rest`` of a :func:`tenant_key` (namespace first, e.g. ``b"p:..."``); a key not made by
    :func:`tenant_key` is its own body."""
    if tenant_of_key(key) is None:
        return key
    return key[2 + key[1]:]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenTable:
    """Bearer tokens -> tenants, compared in constant time.

    Args:
        tokens: ``{token: tenant}``; tokens of at least :data:`MIN_TOKEN_CHARS` characters.

    Raises:
        AuthConfigError: an empty table, a short token or a bad tenant name.
    """

    def __init__(self, tokens: dict[str, str]) -> None:
        if not tokens:
            raise AuthConfigError("the [tokens] table is empty: give at least one token = tenant line")
        entries = []
        for i, (token, tenant) in enumerate(tokens.items(), 1):
            if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
                raise AuthConfigError(f"token #{i} is shorter than {MIN_TOKEN_CHARS} characters; use a long random "
                                      f"secret (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
            try:
                check_tenant_name(tenant)
            except ValueError as e:
                raise AuthConfigError(f"token #{i}: {e}") from None
            entries.append((_digest(token), tenant))
        self._entries = entries
        self.tenants = frozenset(t for _, t in entries)

    def tenant_for(self, token: str | None) -> str | None:
        """The tenant of ``token``, or None. Compares SHA-256 digests with :func:`hmac.compare_digest`
        against every entry (no early exit), so the time taken says nothing about the tokens."""
        if not token:
            return None
        probe = _digest(token)
        found = None
        for digest, tenant in self._entries:
            if hmac.compare_digest(digest, probe) and found is None:
                found = tenant
        return found

    @classmethod
    def from_file(cls, path: str | Path) -> TokenTable:
        """Read a TOML tokens file (``[tokens]`` table: ``"<token>" = "<tenant>"``).

        The file must be a regular file owned by the daemon's user with no permissions for group or
        others (mode 0600 or 0400): anyone who can read it can act as any tenant.

        Raises:
            AuthConfigError: a one-line reason (missing, owner, mode, not TOML, bad table).
        """
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as e:
            raise AuthConfigError(f"--auth-tokens {path}: cannot open it ({e.strerror}); it must be a regular "
                                  f"file, not a symlink") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise AuthConfigError(f"--auth-tokens {path}: not a regular file")
            if st.st_uid != os.getuid():
                raise AuthConfigError(f"--auth-tokens {path}: owned by uid {st.st_uid}, not by the daemon's user "
                                      f"(uid {os.getuid()}); chown it to that user")
            mode = stat.S_IMODE(st.st_mode)
            if mode & 0o077:
                raise AuthConfigError(f"--auth-tokens {path}: mode {mode:04o} lets other users read the tokens; "
                                      f"run chmod 600 {path}")
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise AuthConfigError(f"--auth-tokens {path}: not valid TOML ({e})") from None
        unknown = set(data) - {"tokens"}
        if unknown:  # not named: a misplaced key may be a token
            raise AuthConfigError(f"--auth-tokens {path}: {len(unknown)} unknown tables/keys outside [tokens]; the file "
                                  f"holds one [tokens] table")
        tokens = data.get("tokens")
        if not isinstance(tokens, dict) or any(not isinstance(v, str) for v in tokens.values()):
            raise AuthConfigError(f"--auth-tokens {path}: needs a [tokens] table of \"<token>\" = \"<tenant>\" strings")
        try:
            return cls(tokens)
        except AuthConfigError as e:
            raise AuthConfigError(f"--auth-tokens {path}: {e}") from None
