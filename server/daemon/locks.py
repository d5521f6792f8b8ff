"""A readers-writer lock (many readers at once, one writer alone, writers not starved) and a lock per key."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class LockBusy(Exception):
    """A bounded wait for a lock ran out (:meth:`RWLock.shared` with a timeout)."""


class RWLock:
    """Shared/exclusive lock. A waiting writer blocks new readers, so a stream of reads cannot
    starve a write. Not re-entrant: a holder must not take it again."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextmanager
    def shared(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the lock shared (reads: ReadKV, non-freeing Offload, buffer infos, describe).

        Raises:
            LockBusy: ``timeout`` seconds passed without getting it (None: wait as long as it takes).
        """
        with self._cond:
            if not self._cond.wait_for(lambda: not (self._writer or self._writers_waiting), timeout):
                raise LockBusy("the lock is held exclusive")
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the lock alone (writes, moves, restores, slot allocation and free, delete).

        Raises:
            LockBusy: ``timeout`` seconds passed without getting it (None: wait as long as it takes).
        """
        with self._cond:
            self._writers_waiting += 1
            try:
                if not self._cond.wait_for(lambda: not (self._writer or self._readers), timeout):
                    raise LockBusy("the lock is held")
            finally:
                self._writers_waiting -= 1
                if not self._writers_waiting:
                    self._cond.notify_all()  # readers held back by this waiting writer go on
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()



class KeyLocks:
    """One mutex per key, made when first wanted and forgotten when its last holder or waiter leaves:
    calls on the same key go one at a time, calls on different keys never wait for each other (the
    offload store: one tenant's slow disk commit held every tenant's Offload, attack pass 8, A8-7).
    The registry's own lock guards one dict operation only. Not re-entrant per key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[object, list] = {}  # key -> [its mutex, holders and waiters]

    @contextmanager
    def holding(self, key: object) -> Iterator[None]:
        """Hold ``key``'s mutex for the ``with`` block."""
        with self._lock:
            ent = self._locks.get(key)
            if ent is None:
                ent = self._locks[key] = [threading.Lock(), 0]
            ent[1] += 1
        try:
            with ent[0]:
                yield
        finally:
            with self._lock:
                ent[1] -= 1
                if not ent[1]:
                    del self._locks[key]

    def __len__(self) -> int:
        """Keys with a holder or a waiter now."""
        return len(self._locks)
