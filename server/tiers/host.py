"""Host-memory tier: records in the host arena (page-locked on CUDA machines) under a byte budget.

Records live in one :class:`~kvtier.server.hostmem.HostArena` (anonymous shared memory faulted in
once), so a spill from the device writes into memory that is already there, and a transfer engine
can register the tier's memory as one range (:meth:`HostTier.registration_range`). Producers build
records straight in it (:meth:`HostTier.record_buffer`); a record that arrives elsewhere is copied
in; when the arena has no room (fragmentation; it holds the budget plus 1/16) a record stays where
it is (page-locked first on CUDA), counted in ``arena_fallbacks``.

Thread safety: one lock (the index's) guards the table, the policy and the counters; record bytes
are copied out *outside* the lock while the key is pinned, so a reader never sees a half-evicted
record and eviction never waits for a copy. Pins always return to zero (``finally``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvtier.server.hostmem import HostArena
from kvtier.server.tiers.base import EvictHook, RecordLike, Tier, TierConfig
from kvtier.server.tiers.errors import RecordError, TierFullError
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
        prefault: fault the arena in at once (``True``), in a background thread at the lowest CPU
            priority (``"background"``, the default: the daemon starts at once), or on first use.
        prefault_limit_bytes: fault in at most this much (default 1 GiB: a default daemon does not
            take its whole 4 GiB budget of memory at start); beyond it each page faults on first use,
            once. 0: no limit.
    """

    kind: ClassVar[str] = "host"
    capacity_bytes: int = 1 << 30
    write_back: bool = True
    pin_memory: bool | None = None
    verify_reads: bool = True
    prefault: bool | str = "background"
    prefault_limit_bytes: int = 1 << 30


class HostTier(Tier):
    """Records in host memory, LRU by default.

    Args:
        config: :class:`HostTierConfig`.
    """

    name = "host"

    def __init__(self, config: HostTierConfig) -> None:
        config.validate()
        super().__init__(config.make_index(config.capacity_bytes))
        self.config = config
        self.pin_memory = torch.cuda.is_available() if config.pin_memory is None else bool(config.pin_memory)
        self._data: dict[bytes, torch.Tensor] = {}
        self._arena: HostArena | None = None
        self._arena_lock = threading.Lock()

    @property
    def arena(self) -> HostArena:
        """The arena records live in (made on first use: the budget plus 1/16 for page rounding)."""
        with self._arena_lock:
            if self._arena is None:
                size = max(self.config.capacity_bytes + self.config.capacity_bytes // 16, 1 << 20)
                self._arena = HostArena(size, pin=self.pin_memory, prefault=self.config.prefault,
                                        prefault_limit=self.config.prefault_limit_bytes or None, name="kvtier-host-tier")
            return self._arena

    def registration_range(self) -> tuple[int, int]:
        """``(ptr, nbytes)`` of the tier's arena: one range for a transfer engine to register."""
        return self.arena.registration_range()

    def record_buffer(self, nbytes: int) -> torch.Tensor:
        """A block of the tier's arena to build a record in (stored then without a copy); fresh
        memory (page-locked when the tier is) when the arena has no room."""
        block = self.arena.alloc_tensor(nbytes)
        if block is not None:
            return block
        self.arena.count_fallback()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)

    def nbytes(self, keys: Sequence[bytes]) -> list[int | None]:
        with self.index.lock:
            return [int(self._data[k].numel()) if k in self._data else None for k in keys]

    def _in_arena(self, rec: torch.Tensor) -> torch.Tensor | None:
        """``rec`` itself when it lies in the arena (built there), else a copy in the arena, else None."""
        arena = self.arena
        if arena.owns(rec):
            return rec
        block = arena.alloc_tensor(int(rec.numel()))
        if block is not None:
            block.copy_(rec)
        return block

    def _own(self, rec: torch.Tensor) -> torch.Tensor:
        """:meth:`_in_arena`; when the arena has no room, ``rec`` (copied to page-locked memory first
        if the tier pins), counted as a fallback."""
        owned = self._in_arena(rec)
        if owned is not None:
            return owned
        self.arena.count_fallback()
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
        written: list[bytes] = []
        with self.index.lock:
            for pos, (key, rec) in enumerate(items):
                if key in self.index:
                    if not replace:
                        self.index.touch(key)
                        continue
                    self._drop(key)
                n = int(rec.numel())
                try:
                    victims = self.index.plan_insert(key, n)
                except Exception as e:
                    self._count(full_errors=1)
                    if isinstance(e, TierFullError):  # the batch's earlier items stay
                        e.done, e.written = pos, tuple(written)
                    raise
                owned = self._in_arena(rec)
                for v in victims:
                    if on_evict is not None:
                        on_evict(v, self._data[v])
                    self._count(evictions=1, bytes_evicted=int(self._data[v].numel()))
                    del self._data[v]
                if owned is None:  # the victims' blocks are free now
                    try:
                        owned = self._own(rec)
                    except (RuntimeError, MemoryError):  # no page-locked memory left: keep it as it is
                        owned = rec
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

    def stats(self):  # type: ignore[override]
        s = super().stats()
        a = self._arena
        if a is not None:
            st = a.stats()
            s.extra = {**s.extra, "arena_bytes": st.capacity_bytes, "arena_used_bytes": st.used_bytes,
                       "arena_fallbacks": st.fallbacks}
        return s

    def close(self) -> None:
        with self.index.lock:
            for k in list(self._data):
                self._drop(k)
        with self._arena_lock:
            if self._arena is not None:
                self._arena.close()  # stops its prefault; unmapped once no block is alive
