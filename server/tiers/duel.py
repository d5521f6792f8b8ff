"""Recency against frequency, refereed online by regret (``duel``).

On the Mooncake conversation trace neither classic order wins everywhere: at small budgets (1e6-3e6
tokens) keeping the pages many requests asked for (frequency) hits about twice what LRU hits, because
a page's next use is mostly hundreds of requests away and only the often-asked pages are worth
holding that long; from about 1e7 tokens LRU catches those reuses itself and frequency holds stale
pages. Which regime a tier is in depends on its budget, the traffic and the tiers above it, so the
policy learns it instead of being told:

* two *experts* order the same entries: **recency** (least recently used first) and **frequency**
  (fewest requests first, in power-of-two buckets of the request count the prefix cache records in
  :class:`~kvtier.server.tiers.reuse.ReuseHistory`, least recently used first within a bucket; without
  a history the tier's own use count);
* each eviction follows the expert with the larger weight and remembers the victim as that expert's
  *ghost* (ghosts of each expert up to the budget's bytes, oldest forgotten first);
* a key inserted again while it is an expert's ghost is that expert's regret: its weight is
  multiplied by ``exp(-LEARNING_RATE * DISCOUNT ** evictions_since)`` and the weights renormalised,
  so a recent mistake costs more than an old one.

Source of the update rule: Vietri et al., "Driving Cache Replacement with ML-based LeCaR",
HotStorage 2018 (learning rate 0.45, discount ``0.005 ** (1 / cache entries)``: the paper's values,
not fitted here). Unlike LeCaR the expert is chosen by the larger weight, not at random, so a
simulation and a daemon replay take the same decisions. The only scale is the tier's own size.

Admission (the disk tier): a page is stored when the frequency expert would not evict it before
the page it would displace (its request count's bucket is at least the frequency victim's) or when it
is a ghost (it came back once already); the rest is counted as not admitted.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable

from kvtier.server.tiers.policy import CachePolicy, Key
from kvtier.server.tiers.reuse import ReuseHistory

RECENCY, FREQUENCY = 0, 1


class DuelPolicy(CachePolicy):
    """Recency or frequency, whichever has regretted less lately (``duel``): see the module docstring."""

    name = "duel"
    LEARNING_RATE = 0.45
    DISCOUNT_BASE = 0.005
    ADMISSION = True

    def __init__(self) -> None:
        self.recency: OrderedDict[Key, int] = OrderedDict()  # key -> charged bytes, oldest first
        self.buckets: dict[int, OrderedDict[Key, None]] = {}  # frequency bucket -> keys, oldest first
        self.bucket: dict[Key, int] = {}
        self.own_uses: dict[Key, int] = {}
        self.ghosts: tuple[OrderedDict[Key, int], OrderedDict[Key, int]] = (OrderedDict(), OrderedDict())
        self.ghost_bytes = [0, 0]
        self.ghost_size: dict[Key, int] = {}
        self.weights = [0.5, 0.5]
        self.evictions = 0
        self.capacity = 0
        self.history: ReuseHistory | None = None
        self._key_of: Callable[[Key], Key] = lambda k: k

    def bind(self, capacity: int) -> None:
        self.capacity = capacity

    def use_history(self, history: object, key_of: Callable[[Key], Key] = lambda k: k) -> None:
        if isinstance(history, ReuseHistory):
            self.history, self._key_of = history, key_of

    # ----- the frequency expert's buckets -----------------------------------------------------------
    def _uses(self, key: Key) -> int:
        if self.history is not None:
            return max(self.history.uses(self._key_of(key)), 1)
        return self.own_uses.get(key, 1)

    def _file(self, key: Key) -> None:
        """(Re)file ``key`` at the newest end of its frequency bucket."""
        b = self._uses(key).bit_length()
        old = self.bucket.get(key)
        if old is not None:
            del self.buckets[old][key]
            if not self.buckets[old]:
                del self.buckets[old]
        self.bucket[key] = b
        self.buckets.setdefault(b, OrderedDict())[key] = None

    # ----- CachePolicy ------------------------------------------------------------------------------
    @property
    def leader(self) -> int:
        """The expert evictions follow now (recency on a tie)."""
        return FREQUENCY if self.weights[FREQUENCY] > self.weights[RECENCY] else RECENCY

    def touch(self, key: Key) -> None:
        self.recency.move_to_end(key)
        if self.history is None:
            self.own_uses[key] += 1
        self._file(key)

    def insert(self, key: Key, nbytes: int) -> None:
        if key in self.recency:
            raise KeyError(f"{key!r} is already in the policy")
        self._regret(key)
        self.recency[key] = nbytes
        if self.history is None:
            self.own_uses[key] = 1
        self._file(key)

    def _regret(self, key: Key) -> None:
        """``key`` is back: each expert that evicted it (it is that expert's ghost) loses weight."""
        changed = False
        for e in (RECENCY, FREQUENCY):
            at = self.ghosts[e].pop(key, None)
            if at is None:
                continue
            self.ghost_bytes[e] -= self.ghost_size[key]
            discount = self.DISCOUNT_BASE ** (1 / max(len(self.recency), 1))
            self.weights[e] *= math.exp(-self.LEARNING_RATE * discount ** (self.evictions - at))
            changed = True
        if changed:
            self.ghost_size.pop(key, None)
            total = sum(self.weights)
            self.weights = [w / total for w in self.weights] if total > 0 else [0.5, 0.5]

    def remove(self, key: Key) -> None:
        del self.recency[key]
        b = self.bucket.pop(key)
        del self.buckets[b][key]
        if not self.buckets[b]:
            del self.buckets[b]
        self.own_uses.pop(key, None)

    def evicted(self, key: Key) -> None:
        e = self.leader
        size = self.recency[key]
        self.remove(key)
        self.evictions += 1
        other = self.ghosts[1 - e].pop(key, None)  # a key is one expert's ghost at a time
        if other is not None:
            self.ghost_bytes[1 - e] -= size
        self.ghosts[e][key] = self.evictions
        self.ghost_size[key] = size
        self.ghost_bytes[e] += size
        ghosts = self.ghosts[e]
        while self.ghost_bytes[e] > self.capacity and ghosts:
            old, _ = ghosts.popitem(last=False)
            self.ghost_bytes[e] -= self.ghost_size.pop(old)

    def _frequency_order(self):
        for b in sorted(self.buckets):
            yield from self.buckets[b]

    def victims(self, nbytes: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        if nbytes <= 0:
            return []
        chosen: list[Key] = []
        freed = 0
        for key in (self.recency if self.leader == RECENCY else self._frequency_order()):
            if can_evict(key):
                chosen.append(key)
                freed += self.recency[key]
                if freed >= nbytes:
                    return chosen
        return None

    def admit(self, key: Key, nbytes: int) -> bool:
        if not self.ADMISSION:
            return True
        if key in self.ghost_size or not self.buckets:
            return True
        return self._uses(key).bit_length() >= min(self.buckets)

    def order(self) -> list[Key]:
        return list(self.recency if self.leader == RECENCY else self._frequency_order())
