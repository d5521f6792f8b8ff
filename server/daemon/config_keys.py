"""The one check every TOML table of the daemon's config goes through: no key the typed config lacks."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


def check_known_keys(cls: type, table: Mapping[str, Any], where: str) -> None:
    """Raise ValueError naming the keys of ``table`` that are not fields of dataclass ``cls``.

    ``where`` names the table in the message (``config``, ``[tiers]``, ``[[pools]]``).
    """
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"unknown {where} keys {unknown}; known: {sorted(known)}")
