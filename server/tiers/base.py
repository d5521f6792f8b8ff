"""The one tier interface: batch-first, longest-prefix lookup, read into the caller's buffer.

Every tier (host memory, LMDB disk, the simulator's size-only tier) implements :class:`Tier` and is
built from one typed config object (:class:`TierConfig` subclasses), so a stack is built by a loop
over configs (:func:`kvtier.server.tiers.stack.build_tier`).

A tier stores *records* (:mod:`kvtier.server.tiers.record`) under byte-string keys. A record is
atomic: it is present with every component or absent. ``read_into`` verifies the record's checksum
and returns a miss for a damaged one (counted in ``stats().damaged`` and logged).
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch

from kvtier.server.tiers.health import TierHealth
from kvtier.server.tiers.policy import TierIndex

log = logging.getLogger(__name__)

#: A record: a 1-D uint8 host tensor (real tiers) or its size in bytes (the simulator's tiers).
RecordLike = torch.Tensor | int
#: Called with ``(key, record or None)`` for each victim before a tier drops it.
EvictHook = Callable[[bytes, "RecordLike | None"], None]


def record_nbytes(rec: RecordLike) -> int:
    """Bytes of a record or of a size-only stand-in."""
    return int(rec) if isinstance(rec, int) else int(rec.numel())


@dataclass
class TierConfig:
    """Fields every tier config has.

    Attributes:
        capacity_bytes: the tier's byte budget (0 disables the tier in a stack).
        policy: eviction policy name (:func:`kvtier.server.tiers.policies.make_policy`; ``lru`` by
            default here, the daemon passes its ``--policy``); each tier builds its own instance.
    """

    kind: ClassVar[str] = ""
    capacity_bytes: int = 0
    policy: str = "lru"

    def validate(self) -> None:
        """Raise ValueError naming a bad field."""
        from kvtier.server.tiers.policies import resolve_policy

        if isinstance(self.capacity_bytes, bool) or not isinstance(self.capacity_bytes, int) or self.capacity_bytes < 0:
            raise ValueError(f"{self.kind} capacity_bytes must be a non-negative integer, got {self.capacity_bytes!r}")
        resolve_policy(self.policy)

    def make_index(self, capacity: int) -> TierIndex:
        """A :class:`TierIndex` of ``capacity`` charged bytes with a fresh instance of :attr:`policy`."""
        from kvtier.server.tiers.policies import make_policy

        return TierIndex(capacity, make_policy(self.policy))


@dataclass
class TierStats:
    """Usage and counters of one tier (bytes are record bytes unless named ``charged``)."""

    name: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    entries: int = 0
    pinned: int = 0
    hits: int = 0
    misses: int = 0
    damaged: int = 0
    writes: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0
    bytes_evicted: int = 0
    full_errors: int = 0
    io_errors: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready)."""
        return asdict(self)


class Tier(ABC):
    """A tier of records keyed by bytes. Thread-safe; every method takes a batch of keys.

    Attributes:
        index: what the tier holds, its byte budget, LRU policy and pins.
        health: :class:`~kvtier.server.tiers.health.TierHealth`; an unhealthy tier is bypassed by the
            stack until :meth:`probe` succeeds: it answers every presence question with "absent" and
            every read with a miss, while its index keeps what its storage holds (see
            :meth:`held_while_unhealthy`).
        persistent: records written here outlive the process (the disk tier): a copy the stack put
            here is "durable" in the sense of an Offload's OK.
        verifies_reads: every record :meth:`borrow` and :meth:`read_into` hand out has just passed
            its checksum (the disk tier), so a reader need not hash it again.
    """

    name: str = ""
    persistent: bool = False
    verifies_reads: bool = False

    def __init__(self, index: TierIndex) -> None:
        self.index = index
        self.health = TierHealth(self.name)
        self._stats = TierStats(self.name, capacity_bytes=index.capacity)
        self._stats_lock = threading.Lock()  # leaf: taken after index.lock, never before it

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every write this tier has acknowledged is in its storage (the disk tier's
        write-behind transactions committed, or failed and the tier unhealthy); False when
        ``timeout`` seconds passed first. Default: writes are stored when ``write`` returns;
        nothing to wait for."""
        return True

    def probe(self) -> None:
        """Check that an unhealthy tier can serve again (e.g. a small write and delete); raise an
        exception saying why not. The default has nothing to check."""

    # ----- presence -------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether the tier holds its record (all False while unhealthy). Plain
        membership reads, no index lock: an answer is a snapshot either way, and a check of one
        copy (an Offload's "key taken?") must not wait for a disk tier committing another under its
        lock (attack pass 8, A8-7)."""
        if not self.health.healthy:
            return [False] * len(keys)
        index = self.index
        return [k in index for k in keys]

    def held_while_unhealthy(self, key: bytes) -> bool:
        """True when the tier is unhealthy and its storage holds ``key``'s record (unreachable until
        the tier recovers): lets a caller answer "unavailable, retry" instead of "not found"."""
        return not self.health.healthy and key in self.index

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` whose records are all present (0 while unhealthy).
        Plain membership reads, no index lock, as :meth:`contains`: a LoadPrefix asking the disk tier
        does not wait for a commit holding its lock (the rest of attack pass 8's A8-4)."""
        if not self.health.healthy:
            return 0
        return prefix_present(self.index, keys)

    @abstractmethod
    def nbytes(self, keys: Sequence[bytes]) -> list[int | None]:
        """Record bytes for each key (None where absent): the buffer size :meth:`read_into` needs."""

    # ----- data -------------------------------------------------------------------------------
    @abstractmethod
    def read_into(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> list[int]:
        """Copy each key's record into ``outs[i]`` (1-D uint8 host tensor, at least the record's
        bytes) and verify it. Returns the bytes read per key; 0 is a miss (absent or damaged: a
        damaged record is removed, counted and logged). A hit touches the key in the policy.

        Raises:
            ValueError: ``outs`` of another length than ``keys``, or a buffer too small (checked
                before any copy).
        """

    @contextmanager
    def borrow(self, keys: Sequence[bytes]) -> Iterator[list[RecordLike | None]]:
        """Yield each key's record (None where absent or damaged) for the ``with`` block: a verified
        copy here; the host tier lends its own tensor, pinned. Hits are touched."""
        sizes = self.nbytes(keys)
        outs = [torch.empty(n or 0, dtype=torch.uint8) for n in sizes]
        got = self.read_into(keys, outs)
        yield [o[:n] if n else None for o, n in zip(outs, got)]

    def record_buffer(self, nbytes: int) -> torch.Tensor:
        """A ``(nbytes,)`` uint8 host buffer to build a record in that this tier can store without a
        copy (the host tier: a block of its arena). Here: fresh memory."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def report_damaged(self, key: bytes, err: Exception) -> None:
        """A reader found ``key``'s record bad (e.g. another model's fingerprint): count, log, drop."""
        log.warning("%s tier: record %s failed its checks (%s); dropped, read as a miss", self.name, key.hex(), err)
        self._count(damaged=1)
        self.remove([key])

    @abstractmethod
    def write(self, items: Sequence[tuple[bytes, RecordLike]], *, on_evict: EvictHook | None = None,
              replace: bool = False) -> list[bytes]:
        """Store records, evicting by policy to stay in budget. A key already present is touched, not
        rewritten, unless ``replace``. Each victim is handed to ``on_evict`` before it is dropped.

        Returns:
            The keys written (present ones skipped).

        Raises:
            TierFullError: a record does not fit (larger than the budget, the rest pinned, or LMDB's
                map full). Nothing of it is visible; records of the batch stored before it stay
                (the disk tier commits a batch in transactions of up to ``max_txn_bytes`` and rolls
                back the whole failing transaction). The error's ``done`` says how many items
                of the batch were handled before the failing one, ``written`` which were stored.
            TierUnavailableError: the tier's storage failed (it marked itself unhealthy); ``done``
                and ``written`` as for TierFullError.
        """

    @abstractmethod
    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop records (absent keys are ignored); returns how many were dropped. A reader that
        already holds a record finishes with its own reference; later reads miss."""

    def stats(self) -> TierStats:
        """A snapshot of usage and counters.

        Monitoring path: takes only the counter lock (a leaf) and reads the index's plain integers
        without its lock, so it never waits for a write, read or eviction in progress (and a writer
        holding the index lock, which counts under the counter lock, can never wait for it). Usage
        and counters are each consistent; together they may be one operation apart.
        """
        with self._stats_lock:
            s = TierStats(**{**asdict(self._stats), "extra": dict(self._stats.extra)})
        s.capacity_bytes = self.index.capacity
        s.used_bytes = self.index.used
        s.entries = len(self.index)
        s.pinned = self.index.total_pins
        return s

    def counter_snapshot(self) -> TierStats:
        """The counters only (no usage), under the counters' leaf lock alone: for metrics scrapes,
        which must never wait for an index lock."""
        with self._stats_lock:
            return TierStats(**{**asdict(self._stats), "extra": dict(self._stats.extra)})

    def _count(self, **deltas: int) -> None:
        """Add to counters. Leaf lock: may be called with the index lock held; calls nothing."""
        with self._stats_lock:
            for k, v in deltas.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    def _count_reads(self, hits: int, misses: int, damaged: int, nbytes: int) -> None:
        """:meth:`_count` of one read call, without the keyword plumbing (the disk read path)."""
        with self._stats_lock:
            st = self._stats
            st.hits += hits
            st.misses += misses
            st.damaged += damaged
            st.bytes_read += nbytes

    def close(self) -> None:
        """Release resources (files, environments). The tier is unusable afterwards."""

    @staticmethod
    def _check_outs(keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> None:
        if len(outs) != len(keys):
            raise ValueError(f"read_into got {len(keys)} keys but {len(outs)} buffers")
        for o in outs:
            if not isinstance(o, torch.Tensor) or o.dtype != torch.uint8 or o.dim() != 1 or not o.is_cpu \
                    or not o.is_contiguous():
                raise ValueError("read_into buffers must be contiguous 1-D uint8 host tensors")


def prefix_present(index: Any, keys: Sequence[bytes]) -> int:
    """How many of ``keys``, from the first, ``index`` holds (up to the first it does not)."""
    n = 0
    for k in keys:
        if k not in index:
            break
        n += 1
    return n
