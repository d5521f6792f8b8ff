"""Settings of the unit store (``[units]`` in the TOML config): the pending table of half-arrived units
and the size of one call. See :mod:`kvtier.server.daemon.unit_store`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.server.daemon.config_keys import settings_from_table

MiB = 1 << 20


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
        if isinstance(self.pending_seconds, bool) or not isinstance(self.pending_seconds, (int, float)) \
                or self.pending_seconds <= 0:
            raise ValueError(f"units.pending_seconds must be > 0, got {self.pending_seconds!r}")

    @classmethod
    def coerce(cls, value: UnitSettings | Mapping[str, Any] | None) -> UnitSettings:
        """UnitSettings from itself, a ``[units]`` table (byte sizes may be ``"256MiB"``) or None.

        Raises:
            ValueError: unknown keys or bad values (the message names them).
        """
        return settings_from_table(cls, value, "[units]", byte_keys=("pending_bytes", "max_call_bytes"))
