"""The one check every TOML table of the daemon's config goes through (no key the typed config lacks),
and the one way a settings class is made from such a table."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

S = TypeVar("S")


def check_known_keys(cls: type, table: Mapping[str, Any], where: str) -> None:
    """Raise ValueError naming the keys of ``table`` that are not fields of dataclass ``cls``.

    ``where`` names the table in the message (``config``, ``[tiers]``, ``[[pools]]``).
    """
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"unknown {where} keys {unknown}; known: {sorted(known)}")


def settings_from_table(cls: type[S], value: S | Mapping[str, Any] | None, where: str, *,
                        byte_keys: tuple[str, ...] = (), convert: Mapping[str, Any] | None = None) -> S:
    """A ``cls`` (a settings dataclass) from itself, a TOML table or None (the defaults).

    ``where`` names the table (``[units]``); ``byte_keys`` may be sizes such as ``"256MiB"``;
    ``convert`` maps a key to a function applied to its value first.

    Raises:
        ValueError: not a table, unknown keys or bad values (the message names them).
    """
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a table, got {type(value).__name__}")
    check_known_keys(cls, value, where)
    from kvtier.server.daemon.config import parse_bytes  # config imports the settings modules

    data = dict(value)
    for key in byte_keys:
        if key in data:
            data[key] = parse_bytes(data[key], f"{where.strip('[]')}.{key}")
    for key, fn in (convert or {}).items():
        if key in data:
            data[key] = fn(data[key])
    return cls(**data)
