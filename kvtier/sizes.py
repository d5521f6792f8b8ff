"""Byte sizes as people write them (``4194304``, ``"512MiB"``, ``"8GiB"``), for the daemon's config and the
``kvtier`` command. Imports nothing of kvtier, so the command parses its flags without loading the daemon
(or torch)."""

from __future__ import annotations

import math
import re
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
MAX_BYTES = 1 << 60
"""No size kvtier takes is larger (1 EiB): beyond 2^63 the kernel's and LMDB's calls overflow with a
traceback instead of an error (attack pass 8, A8-8)."""

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 10**6, "mb": 10**6, "mib": MiB,
          "g": 10**9, "gb": 10**9, "gib": GiB, "t": 10**12, "tb": 10**12, "tib": 1 << 40}


def parse_bytes(value: Any, what: str = "size") -> int:
    """``4194304``, ``"4MiB"``, ``"1.5GB"`` -> bytes (int). Raises ValueError naming ``what``."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a byte count, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must be >= 0, got {value}")
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{what} must be a byte count like 4194304, '512MiB' or '8GiB', got {value!r}")
        f = float(m.group(1)) * _UNITS[m.group(2).lower()]
        n = int(f) if math.isfinite(f) else MAX_BYTES + 1
    if n > MAX_BYTES:
        raise ValueError(f"{what} must be at most 1 EiB (2^60 bytes), got {value!r}")
    return n
