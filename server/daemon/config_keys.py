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


_TYPE_WORDS = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string",
               "int | None": "an integer", "bool | None": "true or false", "float | None": "a finite number",
               "tuple[str, ...]": "a list of strings", "tuple[int, ...]": "a list of integers"}


def _type_ok(kind: str, v: Any) -> bool:
    import math

    if kind.endswith(" | None"):
        return v is None or _type_ok(kind[:-len(" | None")], v)
    if kind == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == "float":
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "str":
        return isinstance(v, str)
    if kind.startswith("tuple[") and kind.endswith(", ...]"):
        return isinstance(v, (list, tuple)) and all(_type_ok(kind[len("tuple["):-len(", ...]")], x) for x in v)
    return True


def check_field_types(obj: object, where: str = "", skip: tuple[str, ...] = ()) -> None:
    """Refuse a field of dataclass ``obj`` whose value has the wrong type (a TOML ``"5"`` for a
    number, ``true`` for a count, ``5`` for a name or a list, NaN or inf for seconds) in one line
    naming the key, before any other check uses it (a traceback otherwise: attack passes 3, 6, 7).
    Fields of other types (nested settings, tables) and those in ``skip`` are left to their own checks.

    ``where`` prefixes the key in the message (``tiers.``, ``[[pools]] ``).

    Raises:
        ValueError: ``WHEREKEY must be TYPE, got VALUE``.
    """
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        want = _TYPE_WORDS.get(str(f.type))
        if want is None or f.name in skip:
            continue
        v = getattr(obj, f.name)
        if not _type_ok(str(f.type), v):
            raise ValueError(f"{where}{f.name} must be {want}, got {v!r}")
