"""Settings of the unit store (``[units]`` in the TOML config): the pending table of half-arrived units
and the size of one call. See :mod:`kvtier.server.daemon.unit_store`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.server.daemon.config_keys import settings_from_table

MiB = 1 << 20
MAX_CALL_BYTES = 64 << 30
"""The most data bytes one unit call may be allowed to carry (its buffers are this large)."""


@dataclass(frozen=True)
class UnitSettings:
    """Unit store settings of a daemon.

    Attributes:
        pending_bytes: host memory for parts whose other half has not arrived yet (daemon-wide); past
            it the oldest waiting parts are dropped (counted ``partial_evicted``).
        pending_seconds: a part that waited this long for its other half is dropped (counted
            ``partial_expired``); its unit was never visible.
        max_call_bytes: data bytes one PutUnits/GetUnits call may carry (an engine's batch of pages);
            a bigger put is refused before anything is allocated.
    """

    pending_bytes: int = 256 * MiB
    pending_seconds: float = 30.0
    max_call_bytes: int = 1024 * MiB

    def __post_init__(self) -> None:
        for name in ("pending_bytes", "max_call_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"units.{name} must be a positive byte count, got {v!r}")
        # finite and at most a day; a call at most 64 GiB (NaN, 1e308 and 100 TB were taken: attack pass 6, A6-7)
        if isinstance(self.pending_seconds, bool) or not isinstance(self.pending_seconds, (int, float)) \
                or not 0 < self.pending_seconds <= 86400:
            raise ValueError(f"units.pending_seconds must be > 0 and at most 86400 (a day), got {self.pending_seconds!r}")
        if self.max_call_bytes > MAX_CALL_BYTES:
            raise ValueError(f"units.max_call_bytes must be at most {MAX_CALL_BYTES} (64 GiB), got {self.max_call_bytes}")

    @classmethod
    def coerce(cls, value: UnitSettings | Mapping[str, Any] | None) -> UnitSettings:
        """UnitSettings from itself, a ``[units]`` table (byte sizes may be ``"256MiB"``) or None.

        Raises:
            ValueError: unknown keys or bad values (the message names them).
        """
        return settings_from_table(cls, value, "[units]", byte_keys=("pending_bytes", "max_call_bytes"))
