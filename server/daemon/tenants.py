"""Tenants: who a call is made as, the bearer-token table that says so, and tenant-namespaced tier keys.

A :class:`Caller` is passed explicitly into every domain call (never a global): it names the tenant
whose pools, offloaded copies, prefix namespace and leases the call may see. Another tenant's things
are NOT_FOUND, with the same message as something absent, so existence never leaks.

Without ``--auth-tokens`` there is one tenant, :data:`DEFAULT_TENANT`. With it, a
:class:`TokenTable` maps bearer tokens (``authorization: Bearer <token>`` metadata) to tenants; the
service layer turns metadata into a :class:`Caller` (``kvtier.server.service.auth``).

Local attach (README "Local attach") authenticates a worker's token with :func:`authenticate`, the
same code the gRPC interceptor uses, and checks the worker's uid (``SO_PEERCRED``) against
:class:`TenantSettings` ``attach_uids`` (``[tenants.<name>]`` in the daemon's config).

Tier keys carry the tenant *above* the tiers (:func:`tenant_key`): ``b"t" + len(name) + name + rest``.
The tiers store opaque byte keys and never know tenants; :func:`tenant_of_key` reads the tenant back
for per-tenant quotas and usage, :func:`key_body` the rest (its namespace, ``p:``/``o:``, first) for
a tier that keeps only some namespaces (the shared Mooncake Store tier: prefix pages only).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.bearer import check_token
from kvtier.server.daemon.config_keys import check_known_keys
from kvtier.server.daemon.errors import Unauthenticated
from kvtier.server.daemon.private_files import AuthConfigError, read_private_file

if TYPE_CHECKING:
    from kvtier.server.daemon.sessions import AttachSession

DEFAULT_TENANT = "default"
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MIN_TOKEN_CHARS = 16
_KEY_TAG = b"t"


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
    session: AttachSession | None = field(default=None, repr=False, compare=False)
    """The attach session the call is made in (``x-kvtier-session`` metadata), or None: slots it
    allocates and leases it takes belong to that session (README "Local attach")."""

    def __post_init__(self) -> None:
        check_tenant_name(self.tenant)

    @classmethod
    def default(cls) -> Caller:
        """The one tenant of a daemon without ``--auth-tokens``."""
        return cls(DEFAULT_TENANT)

    def in_session(self, session: AttachSession | None) -> Caller:
        """This caller, making its calls in ``session``."""
        return Caller(self.tenant, self.token, session)


def unauthenticated_message(token: str | None) -> str:
    """What a caller without a known token is told (gRPC and the attach channel alike)."""
    why = "unknown token" if token else "no token"
    return (f"{why}: this daemon serves tenants; send `authorization: Bearer <token>` metadata "
            f"(KVTierClient(token=...) or KVTIER_TOKEN) with a token from its --auth-tokens file")


def authenticate(tokens: TokenTable | None, token: str | None) -> Caller:
    """The caller a bearer token names: without a token table every caller is tenant ``default``;
    with one, the token's tenant. The gRPC auth interceptor and the attach channel both call this.

    Raises:
        Unauthenticated: a table is set and ``token`` is missing or unknown.
    """
    if tokens is None:
        return Caller.default()
    tenant = tokens.tenant_for(token)
    if tenant is None:
        raise Unauthenticated(unauthenticated_message(token))
    return Caller(tenant, token)


@dataclass(frozen=True)
class TenantSettings:
    """Per-tenant settings (``[tenants.<name>]`` in the daemon's config).

    Attributes:
        attach_uids: uids besides the daemon's own whose processes may attach this tenant's pools
            (local attach checks the connecting process's uid with ``SO_PEERCRED``). The daemon's
            socket directory is private (0700): give those users a way in (a group, an ACL) too.
    """

    attach_uids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.attach_uids, tuple):
            raise ValueError(f"attach_uids must be a list of uids (integers 0..2^32-1), got {self.attach_uids!r}")
        if any(isinstance(u, bool) or not isinstance(u, int) or not 0 <= u < 2**32 for u in self.attach_uids):
            raise ValueError(f"attach_uids must be uids (integers 0..2^32-1), got {list(self.attach_uids)!r}")

    @classmethod
    def table_from_mapping(cls, data: Mapping[str, Any]) -> dict[str, TenantSettings]:
        """``{tenant: settings}`` from a parsed ``[tenants]`` TOML table. Raises ValueError naming a
        bad tenant name, key or value."""
        if not isinstance(data, Mapping):
            raise ValueError("[tenants] must be a table of [tenants.<name>] tables")
        out = {}
        for name, table in data.items():
            check_tenant_name(name)
            if not isinstance(table, Mapping):
                raise ValueError(f"[tenants.{name}] must be a table")
            check_known_keys(cls, table, f"[tenants.{name}]")
            uids = table.get("attach_uids", ())
            if not isinstance(uids, (list, tuple)):  # 5 was a traceback (attack pass 7, A7-1)
                raise ValueError(f"[tenants.{name}] attach_uids must be a list of uids (integers 0..2^32-1), got {uids!r}")
            out[name] = cls(attach_uids=tuple(uids))
        return out


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
        AuthConfigError: an empty table, a short token, a token that is not visible ASCII
            (:func:`kvtier.bearer.check_token`) or a bad tenant name.
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
                check_token(token, f"token #{i}")
            except ValueError as e:
                raise AuthConfigError(str(e)) from None
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
            data = tomllib.loads(read_private_file(path, "--auth-tokens").decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise AuthConfigError(f"--auth-tokens {path}: not valid TOML ({first})") from None
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
