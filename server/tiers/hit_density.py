"""kvtier's own eviction candidate: least *hit density* first, learned online, ghosts included.

The idea (after Beckmann, Chen and Cidon, "LHD: Improving Cache Hit Rate by Maximizing Hit Density",
NSDI 2018): a cache should keep what earns the most hits per byte of space per unit of time. An
entry's *hit density* is the probability that it is used again before it leaves, divided by the time
it is expected to stay until then. Both are learned from what the cache itself saw, per *class* of
entry and per *age* (accesses to this tier since the entry's last use), so nothing is tuned to a trace:

* classes are the entry's reuse count in this tier (0: never reused, 1, 2, 3 or more): in a
  multi-turn conversation trace a block reused once belongs to a conversation that goes on, and a
  block never reused may be the last turn of one that ended; how much that is worth is measured,
  not assumed;
* every use of an entry records a *hit* at its class and age; every eviction records an *end*;
* **ghosts** correct the view of a cache that is too small: a key evicted (or not admitted) and
  inserted again while still remembered is a hit the cache missed, so its eviction's end is taken
  back and a hit is recorded at the age it would have had. Without this a long reuse distance (a
  conversation's next turn after a long think time) would look like no reuse at all;
* every :attr:`RECONFIGURE` events the counts are halved by :attr:`DECAY` and the density table is
  recomputed, so the policy follows a workload that changes.

Eviction compares, for each class, its least recently used unpinned entry (the oldest of the class)
and evicts the one of lowest density; ties (a cold cache with no statistics) fall to the oldest, so
the policy starts as LRU. Admission (:meth:`admit`): a newcomer is admitted when its expected
density (its class at age 0: a remembered ghost starts one class up) is at least that of the entry it
would replace; a refused key is remembered as a ghost with an end at age 0, so a return corrects the
estimate as for an eviction. Ages use log2 bins. Constants are the generic ones of the LHD paper
(a decay of 0.9, classes by reuse count), not fitted to any trace.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvtier.server.tiers.policy import CachePolicy, Key
from kvtier.server.tiers.reuse import ReuseHistory

CLASSES = 4
BINS = 48


def _bin(age: int) -> int:
    """Log2 bin of an age in accesses."""
    return min(age.bit_length(), BINS - 1)


#: Representative age of each bin (the middle of [2**(b-1), 2**b)).
_AGE = [0.0] + [1.5 * (1 << (b - 1)) for b in range(1, BINS)]


class HitDensityPolicy(CachePolicy):
    """Least hit density first (``hitdensity``): see the module docstring."""

    name = "hitdensity"
    DECAY = 0.9
    RECONFIGURE = 4096
    ADMISSION = True

    def __init__(self) -> None:
        self.queues: list[OrderedDict[Key, int]] = [OrderedDict() for _ in range(CLASSES)]
        self.cls: dict[Key, int] = {}
        self.stamp: dict[Key, int] = {}
        self.ghost: OrderedDict[Key, tuple[int, int, int]] = OrderedDict()  # key -> (class, stamp, end bin)
        self.ghost_bytes = 0
        self.ghost_size: dict[Key, int] = {}
        self.clock = 0
        self.capacity = 0
        self.hits = [[0.0] * BINS for _ in range(CLASSES)]
        self.ends = [[0.0] * BINS for _ in range(CLASSES)]
        self.density = [[0.0] * BINS for _ in range(CLASSES)]
        self.hit_chance = [[1.0] * BINS for _ in range(CLASSES)]  # P(used again | class, age)
        self._events = 0
        self.history: ReuseHistory | None = None
        self._key_of: Callable[[Key], Key] = lambda k: k

    def use_history(self, history: object, key_of: Callable[[Key], Key] = lambda k: k, *,
                    own_pages: int | None = None) -> None:
        if isinstance(history, ReuseHistory):
            self.history, self._key_of = history, key_of

    def _class(self, key: Key, fallback: int) -> int:
        """The key's class: from the prefix cache's history when there is one, else ``fallback``
        (this tier's own reuse count)."""
        return self.history.class_of(self._key_of(key)) if self.history is not None else fallback

    def bind(self, capacity: int) -> None:
        self.capacity = capacity

    # ----- learning ---------------------------------------------------------------------------------
    def _event(self) -> None:
        self._events += 1
        if self._events >= self.RECONFIGURE:
            self._reconfigure()

    def _reconfigure(self) -> None:
        """Recompute the density table from the counts, then decay the counts."""
        self._events = 0
        for c in range(CLASSES):
            hits, ends, dens, chance = self.hits[c], self.ends[c], self.density[c], self.hit_chance[c]
            h_ge = n_ge = life_ge = 0.0
            for b in range(BINS - 1, -1, -1):
                n = hits[b] + ends[b]
                h_ge += hits[b]
                n_ge += n
                life_ge += n * _AGE[b]
                remaining = life_ge - n_ge * _AGE[b]  # expected accesses left, summed over entries this old
                dens[b] = h_ge / max(remaining, n_ge, 1e-9) if n_ge else -1.0
                chance[b] = h_ge / n_ge if n_ge else -1.0
                hits[b] *= self.DECAY
                ends[b] *= self.DECAY
            # ages past any lifetime seen (no data): the density of the oldest age with data
            known = next((d for d in dens if d >= 0.0), None)
            for b in range(BINS):
                if dens[b] < 0.0:
                    dens[b] = known if known is not None else 0.0
                else:
                    known = dens[b]
            known = next((p for p in chance if p >= 0.0), None)
            for b in range(BINS):
                if chance[b] < 0.0:
                    chance[b] = known if known is not None else 1.0
                else:
                    known = chance[b]

    def _score(self, key: Key) -> float:
        return self.density[self.cls[key]][_bin(self.clock - self.stamp[key])]

    # ----- the strategy -------------------------------------------------------------------------------
    def touch(self, key: Key) -> None:
        c = self.cls[key]
        self.hits[c][_bin(self.clock - self.stamp[key])] += 1
        size = self.queues[c].pop(key)
        c2 = self._class(key, min(c + 1, CLASSES - 1))
        self.queues[c2][key] = size
        self.cls[key] = c2
        self.stamp[key] = self.clock
        self.clock += 1
        self._event()

    def _start_class(self, key: Key) -> int:
        g = self.ghost.get(key)
        return self._class(key, 0 if g is None else min(g[0] + 1, CLASSES - 1))

    def insert(self, key: Key, nbytes: int) -> None:
        if key in self.cls:
            raise KeyError(f"{key!r} is already in the policy")
        c = 0
        g = self.ghost.pop(key, None)
        if g is not None:  # a hit this tier missed: take back its end, record the hit at its age
            gc, gstamp, gbin = g
            self.ghost_bytes -= self.ghost_size.pop(key)
            self.ends[gc][gbin] = max(0.0, self.ends[gc][gbin] - 1)
            self.hits[gc][_bin(self.clock - gstamp)] += 1
            c = min(gc + 1, CLASSES - 1)
            self._event()
        c = self._class(key, c)
        self.queues[c][key] = nbytes
        self.cls[key] = c
        self.stamp[key] = self.clock
        self.clock += 1

    def remove(self, key: Key) -> None:
        c = self.cls.pop(key)
        del self.queues[c][key]
        del self.stamp[key]

    def _remember(self, key: Key, c: int, stamp: int, nbytes: int) -> None:
        b = _bin(self.clock - stamp)
        self.ends[c][b] += 1
        self.ghost[key] = (c, stamp, b)
        self.ghost_size[key] = nbytes
        self.ghost_bytes += nbytes
        while self.ghost_bytes > self.capacity and self.ghost:
            old, _ = self.ghost.popitem(last=False)
            self.ghost_bytes -= self.ghost_size.pop(old)
        self._event()

    def evicted(self, key: Key) -> None:
        c, stamp, size = self.cls[key], self.stamp[key], self.queues[self.cls[key]][key]
        self.remove(key)
        self._remember(key, c, stamp, size)

    def _candidates(self, taken: set[Key], can_evict: Callable[[Key], bool]) -> Key | None:
        best: Key | None = None
        best_score = best_stamp = 0.0
        for q in self.queues:
            k = next((k for k in q if k not in taken and can_evict(k)), None)
            if k is None:
                continue
            s, st = self._score(k), self.stamp[k]
            if best is None or s < best_score or (s == best_score and st < best_stamp):
                best, best_score, best_stamp = k, s, st
        return best

    def victims(self, nbytes: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        if nbytes <= 0:
            return []
        chosen: list[Key] = []
        taken: set[Key] = set()
        freed = 0
        while freed < nbytes:
            k = self._candidates(taken, can_evict)
            if k is None:
                return None
            chosen.append(k)
            taken.add(k)
            freed += self.queues[self.cls[k]][k]
        return chosen

    def admit(self, key: Key, nbytes: int) -> bool:
        if not self.ADMISSION:
            return True
        victim = self._candidates(set(), lambda k: True)
        if victim is None:
            return True
        c = self._start_class(key)
        vc, vbin = self.cls[victim], _bin(self.clock - self.stamp[victim])
        if self.hit_chance[c][0] >= self.hit_chance[vc][vbin]:
            return True
        g = self.ghost.pop(key, None)  # refused: remembered as a ghost (an end at age 0)
        if g is not None:
            self.ghost_bytes -= self.ghost_size.pop(key)
        self._remember(key, c, self.clock, nbytes)
        return False

    def order(self) -> list[Key]:
        return sorted(self.cls, key=lambda k: (self._score(k), self.stamp[k]))
