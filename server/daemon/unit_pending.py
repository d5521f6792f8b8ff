"""The pending table of the unit store: parts of units whose other part has not arrived yet.

An engine may write a page's KV and its indexer rows in separate calls (SGLang writes the indexer
pool first, then the KV pool). The first part waits here, in host memory, invisible to every lookup
and read, until its other part completes the unit (then both leave together as one record) or it is
dropped: after ``timeout_s`` (``partial_expired``) or, oldest first, when the table passes its byte
budget (``partial_evicted``).

A waiting KV part is held as a record-sized tensor with the latent rows already in place (the
index part, a few KiB a layer, is copied in when it comes); a waiting index part as its own small
tensor. A part sent again replaces the waiting one.

Locking: one leaf-level lock for the table's dict (level 4 of the daemon's order, beside the offload
store's lock, never held together with it); nothing is called, logged or allocated under it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class PendingPart:
    """What waits for a key: ``kv_rec`` (a record-sized tensor holding the KV part) or ``index``
    (the index part), never both."""

    kv_rec: torch.Tensor | None
    index: torch.Tensor | None
    since: float

    @property
    def nbytes(self) -> int:
        return int(self.kv_rec.numel() if self.kv_rec is not None else 0) + \
            int(self.index.numel() if self.index is not None else 0)


@dataclass
class Match:
    """A completed unit: the record-sized tensor with the KV part and the index part to copy in."""

    kv_rec: torch.Tensor
    index: torch.Tensor | None


class PendingTable:
    """Half-arrived units by tier key.

    Args:
        budget_bytes: bytes the waiting parts may take together.
        timeout_s: seconds a part may wait.
        clock: monotonic seconds (tests may pass their own).
    """

    def __init__(self, budget_bytes: int, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget_bytes = budget_bytes
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._parts: OrderedDict[bytes, PendingPart] = OrderedDict()
        self.nbytes = 0
        self.expired = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._parts)

    def __contains__(self, key: bytes) -> bool:
        return key in self._parts

    def offer(self, key: bytes, *, kv_rec: torch.Tensor | None = None, index: torch.Tensor | None = None) -> Match | None:
        """Give one part of ``key``'s unit. If the other part waits, it is taken out and the completed
        unit returned; else this part waits (returns None). A part larger than the whole budget is
        not kept (returns None and counts it evicted)."""
        assert (kv_rec is None) != (index is None)
        now = self._clock()
        with self._lock:
            self._expire(now)
            waiting = self._parts.get(key)
            if waiting is not None and (waiting.kv_rec is None) != (kv_rec is None):
                del self._parts[key]
                self.nbytes -= waiting.nbytes
                return Match(kv_rec if kv_rec is not None else waiting.kv_rec,  # type: ignore[arg-type]
                             index if index is not None else waiting.index)
            if waiting is not None:  # the same part again: the newer one waits
                del self._parts[key]
                self.nbytes -= waiting.nbytes
            part = PendingPart(kv_rec, index, now)
            if part.nbytes > self.budget_bytes:
                self.evicted += 1
                return None
            self._parts[key] = part
            self.nbytes += part.nbytes
            while self.nbytes > self.budget_bytes:
                _, old = self._parts.popitem(last=False)
                self.nbytes -= old.nbytes
                self.evicted += 1
            return None

    def sweep(self) -> None:
        """Drop the parts that waited past the timeout."""
        now = self._clock()
        with self._lock:
            self._expire(now)

    def _expire(self, now: float) -> None:
        while self._parts:
            key, part = next(iter(self._parts.items()))
            if now - part.since < self.timeout_s:
                break
            del self._parts[key]
            self.nbytes -= part.nbytes
            self.expired += 1

    def drop_prefix(self, prefix: bytes) -> int:
        """Drop every waiting part whose key starts with ``prefix``; returns how many."""
        with self._lock:
            gone = [k for k in self._parts if k.startswith(prefix)]
            for k in gone:
                self.nbytes -= self._parts.pop(k).nbytes
            return len(gone)

    def count_prefix(self, prefix: bytes) -> tuple[int, int]:
        """``(parts, bytes)`` waiting under keys that start with ``prefix``."""
        with self._lock:
            parts = [p for k, p in self._parts.items() if k.startswith(prefix)]
        return len(parts), sum(p.nbytes for p in parts)
