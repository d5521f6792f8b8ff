"""Host-memory tier: records in (pinned, on CUDA machines) host tensors under a byte budget.

Thread safety: one lock (the index's) guards the table, the policy and the counters; record bytes
are copied out *outside* the lock while the key is pinned, so a reader never sees a half-evicted
record and eviction never waits for a copy. Pins always return to zero (``finally``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvtier.server.tiers.base import EvictHook, RecordLike, Tier, TierConfig
from kvtier.server.tiers.errors import RecordError
from kvtier.server.tiers.policy import TierIndex
from kvtier.server.tiers.record import verify_record

log = logging.getLogger(__name__)


@dataclass
class HostTierConfig(TierConfig):
    """Host tier settings.

    Attributes:
        capacity_bytes: byte budget for record bytes (default 1 GiB).
        write_back: True: an evicted record is written to the next tier then (write-back); False:
            every record is written to the next tier when it enters this one (write-through), and
            eviction just drops it.
        pin_memory: keep records in page-locked memory (None: when CUDA is available).
        verify_reads: check each record's checksum when it is read.
    """

    kind: ClassVar[str] = "host"
    capacity_bytes: int = 1 << 30
    write_back: bool = True
    pin_memory: bool | None = None
    verify_reads: bool = True


class HostTier(Tier):
    """Records in host memory, LRU by default.

    Args:
        config: :class:`HostTierConfig`.
    """

    name = "host"

    def __init__(self, config: HostTierConfig) -> None:
        config.validate()
        super().__init__(TierIndex(config.capacity_bytes))
        self.config = config
        self.pin_memory = torch.cuda.is_available() if config.pin_memory is None else bool(config.pin_memory)
        self._data: dict[bytes, torch.Tensor] = {}

    def nbytes(self, keys: Sequence[bytes]) -> list[int | None]:
        with self.index.lock:
            return [int(self._data[k].numel()) if k in self._data else None for k in keys]

    def _own(self, rec: torch.Tensor) -> torch.Tensor:
        if self.pin_memory and not rec.is_pinned():
            pinned = torch.empty(rec.numel(), dtype=torch.uint8, pin_memory=True)
            pinned.copy_(rec)
            return pinned
        return rec

    def write(self, items: Sequence[tuple[bytes, RecordLike]], *, on_evict: EvictHook | None = None,
              replace: bool = False) -> list[bytes]:
        for key, rec in items:
            if not isinstance(key, bytes) or not isinstance(rec, torch.Tensor) or rec.dtype != torch.uint8 \
                    or rec.dim() != 1 or rec.device.type != "cpu":
                raise ValueError("host tier items must be (bytes key, 1-D uint8 host tensor record)")
        written = []
        with self.index.lock:
            for key, rec in items:
                if key in self.index:
                    if not replace:
                        self.index.touch(key)
                        continue
                    self._drop(key)
                n = int(rec.numel())
                try:
                    victims = self.index.plan_insert(key, n)
                except Exception:
                    self._count(full_errors=1)
                    raise
                owned = self._own(rec)
                for v in victims:
                    if on_evict is not None:
                        on_evict(v, self._data[v])
                    self._count(evictions=1, bytes_evicted=int(self._data[v].numel()))
                    del self._data[v]
                self.index.commit_insert(key, n, victims)
                self._data[key] = owned
                self._count(writes=1, bytes_written=n)
                written.append(key)
        return written

    def _drop(self, key: bytes) -> None:
        self.index.remove(key)
        del self._data[key]

    def remove(self, keys: Sequence[bytes]) -> int:
        n = 0
        with self.index.lock:
            for k in keys:
                if k in self._data:
                    self._drop(k)
                    n += 1
        return n

    @contextmanager
    def borrow(self, keys: Sequence[bytes]) -> Iterator[list[torch.Tensor | None]]:
        """Pin ``keys`` and yield their record tensors (None where absent) without copying; hits are
        touched. The records must not be modified. Pins are dropped on every exit path."""
        with self.index.lock:
            got = self.index.pin(keys)
            recs = [self._data.get(k) for k in keys]
            for k in got:
                self.index.touch(k)
        self._count(hits=len(got), misses=len(keys) - len(got), bytes_read=sum(int(r.numel()) for r in recs if r is not None))
        try:
            yield recs
        finally:
            self.index.unpin(got)

    def read_into(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> list[int]:
        self._check_outs(keys, outs)
        with self.index.lock:
            sizes = [int(self._data[k].numel()) if k in self._data else 0 for k in keys]
        for k, o, n in zip(keys, outs, sizes):
            if n > o.numel():
                raise ValueError(f"buffer of {o.numel()} bytes is too small for the {n}-byte record of key {k.hex()}")
        result = []
        with self.borrow(keys) as recs:
            for k, o, rec in zip(keys, outs, recs):
                if rec is None:
                    result.append(0)
                    continue
                n = int(rec.numel())
                if n > o.numel():  # replaced since the size check: treat as a miss
                    result.append(0)
                    continue
                o[:n].copy_(rec)
                if self.config.verify_reads:
                    try:
                        verify_record(o[:n])
                    except RecordError as e:
                        self.report_damaged(k, e, rec)
                        result.append(0)
                        continue
                result.append(n)
        return result

    def report_damaged(self, key: bytes, err: Exception, rec: torch.Tensor | None = None) -> None:
        """Count and log a record that failed its checks, and drop it (if still the same record)."""
        log.warning("host tier: record %s failed its checks (%s); dropped, read as a miss", key.hex(), err)
        self._count(damaged=1)
        with self.index.lock:
            if key in self._data and (rec is None or self._data[key] is rec):
                self._drop(key)

    def record(self, key: bytes) -> torch.Tensor | None:
        """The stored record of ``key`` (no copy, not pinned; for tests and the stack's moves)."""
        with self.index.lock:
            return self._data.get(key)

    def close(self) -> None:
        with self.index.lock:
            for k in list(self._data):
                self._drop(k)
