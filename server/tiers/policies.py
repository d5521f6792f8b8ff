"""Scan-resistant eviction policies, and the registry every tier takes its policy from by name.

Each policy is a small :class:`~kvtier.server.tiers.policy.CachePolicy` class, byte-aware (entries
carry their charged size; targets are fractions of the budget :meth:`CachePolicy.bind` gives), so the
device tier (charged 1 a page), the host tier (record bytes) and the disk tier (LMDB charges) run the
same code. :func:`make_policy` builds one by name; every tier of a stack gets its own instance.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvtier.server.tiers.duel import DuelPolicy
from kvtier.server.tiers.hit_density import HitDensityPolicy
from kvtier.server.tiers.policy import CachePolicy, Key, LRUPolicy


def _first(queue: OrderedDict[Key, int], skip: set[Key], can_evict: Callable[[Key], bool]) -> Key | None:
    """The oldest key of ``queue`` not in ``skip`` that ``can_evict`` allows, or None."""
    return next((k for k in queue if k not in skip and can_evict(k)), None)


class S3FIFOPolicy(CachePolicy):
    """S3-FIFO (``s3fifo``): a small FIFO probation queue, a main FIFO with second chances, ghosts.

    Source: Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023. New keys enter
    the small queue S (10% of the budget); a key evicted from S that was used while there moves to the
    main queue M instead, one never used leaves and is remembered in the ghost queue G (bytes up to
    90% of the budget, oldest forgotten first). A key inserted while in G goes straight to M. M is a
    FIFO where a used key gets its use count (at most 3) decremented and goes to the back instead of
    leaving. Most keys are used once (a scan, a one-turn chat): they pass through S alone and never
    push out the keys used again.
    """

    name = "s3fifo"
    SMALL_FRACTION = 0.1  # the paper's size of S
    MAX_FREQ = 3

    def __init__(self) -> None:
        self.small: OrderedDict[Key, int] = OrderedDict()
        self.main: OrderedDict[Key, int] = OrderedDict()
        self.ghost: OrderedDict[Key, int] = OrderedDict()
        self.freq: dict[Key, int] = {}
        self.capacity = 0
        self.small_bytes = self.ghost_bytes = 0

    def bind(self, capacity: int) -> None:
        self.capacity = capacity

    def touch(self, key: Key) -> None:
        self.freq[key] = min(self.freq[key] + 1, self.MAX_FREQ)

    def insert(self, key: Key, nbytes: int) -> None:
        if key in self.freq:
            raise KeyError(f"{key!r} is already in the policy")
        self.freq[key] = 0
        if key in self.ghost:
            self.ghost_bytes -= self.ghost.pop(key)
            self.main[key] = nbytes
        else:
            self.small[key] = nbytes
            self.small_bytes += nbytes

    def remove(self, key: Key) -> None:
        del self.freq[key]
        if key in self.small:
            self.small_bytes -= self.small.pop(key)
        else:
            del self.main[key]

    def evicted(self, key: Key) -> None:
        size = self.small.get(key)
        self.remove(key)
        if size is not None:  # only S's leavers are ghosts (M's were used: their return is no news)
            self.ghost[key] = size
            self.ghost_bytes += size
            while self.ghost_bytes > self.capacity - self.capacity * self.SMALL_FRACTION and self.ghost:
                self.ghost_bytes -= self.ghost.popitem(last=False)[1]

    def victims(self, nbytes: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        if nbytes <= 0:
            return []
        chosen: list[Key] = []
        taken: set[Key] = set()
        freed = small_left = 0
        small_left = self.small_bytes
        while freed < nbytes:
            k = _first(self.small, taken, can_evict) if small_left > self.capacity * self.SMALL_FRACTION else None
            if k is None:
                k = _first(self.main, taken, can_evict)
                if k is None:
                    k = _first(self.small, taken, can_evict)
                    if k is None:
                        return None
            if k in self.small:
                if self.freq[k] > 0:  # used on probation: promote to M (a second chance, applied now)
                    self.small_bytes -= (size := self.small.pop(k))
                    small_left -= size
                    self.main[k] = size
                    self.freq[k] = 0
                    continue
                small_left -= self.small[k]
                size = self.small[k]
            else:
                if self.freq[k] > 0:  # used in M: back of M, one use spent
                    self.freq[k] -= 1
                    self.main.move_to_end(k)
                    continue
                size = self.main[k]
            chosen.append(k)
            taken.add(k)
            freed += size
        return chosen

    def order(self) -> list[Key]:
        return list(self.small) + list(self.main)


class ARCPolicy(CachePolicy):
    """ARC (``arc``): adaptive replacement between recency and frequency, steered by ghosts.

    Source: Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST 2003 (vLLM's
    CPU offload ships it too). T1 holds keys seen once recently, T2 keys seen at least twice; B1 and B2
    remember keys evicted from each (ghosts). A target ``p`` (bytes) for T1 adapts online: a key
    returning from B1 says T1 was too small (``p`` grows by the newcomer's size, times ``|B2|/|B1|``
    when B1 is the smaller list), one returning from B2 that T2 was (``p`` shrinks likewise). Victims
    come from T1 while it is over ``p``, else from T2, least recently used first. Here sizes are bytes
    (every list counted in charged bytes); ghosts are bounded as in the paper (T1+B1 <= c, all <= 2c).
    """

    name = "arc"

    def __init__(self) -> None:
        self.t1: OrderedDict[Key, int] = OrderedDict()
        self.t2: OrderedDict[Key, int] = OrderedDict()
        self.b1: OrderedDict[Key, int] = OrderedDict()
        self.b2: OrderedDict[Key, int] = OrderedDict()
        self.bytes = {"t1": 0, "t2": 0, "b1": 0, "b2": 0}
        self.capacity = 0
        self.p = 0.0

    def bind(self, capacity: int) -> None:
        self.capacity = capacity

    def _pop(self, name: str, key: Key) -> int:
        size = getattr(self, name).pop(key)
        self.bytes[name] -= size
        return size

    def _put(self, name: str, key: Key, size: int) -> None:
        getattr(self, name)[key] = size
        self.bytes[name] += size

    def touch(self, key: Key) -> None:
        if key in self.t1:
            self._put("t2", key, self._pop("t1", key))
        else:
            self.t2.move_to_end(key)

    def insert(self, key: Key, nbytes: int) -> None:
        if key in self.t1 or key in self.t2:
            raise KeyError(f"{key!r} is already in the policy")
        b = self.bytes
        if key in self.b1:
            self.p = min(float(self.capacity), self.p + max(b["b2"] / b["b1"], 1.0) * nbytes)
            self._pop("b1", key)
            self._put("t2", key, nbytes)
        elif key in self.b2:
            self.p = max(0.0, self.p - max(b["b1"] / b["b2"], 1.0) * nbytes)
            self._pop("b2", key)
            self._put("t2", key, nbytes)
        else:
            self._put("t1", key, nbytes)
        self._trim()

    def remove(self, key: Key) -> None:
        self._pop("t1" if key in self.t1 else "t2", key)

    def evicted(self, key: Key) -> None:
        if key in self.t1:
            self._put("b1", key, self._pop("t1", key))
        else:
            self._put("b2", key, self._pop("t2", key))
        self._trim()

    def _trim(self) -> None:
        """Forget the oldest ghosts: T1+B1 within the budget, everything within twice it."""
        b, c = self.bytes, self.capacity
        while self.b1 and b["t1"] + b["b1"] > c:
            self._pop("b1", next(iter(self.b1)))
        while (self.b1 or self.b2) and sum(b.values()) > 2 * c:
            self._pop("b2" if self.b2 else "b1", next(iter(self.b2 or self.b1)))

    def victims(self, nbytes: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        if nbytes <= 0:
            return []
        chosen: list[Key] = []
        taken: set[Key] = set()
        freed, t1_left = 0, self.bytes["t1"]
        while freed < nbytes:
            k = _first(self.t1, taken, can_evict) if t1_left > self.p else None
            if k is None:
                k = _first(self.t2, taken, can_evict)
                if k is None:
                    k = _first(self.t1, taken, can_evict)
                if k is None:
                    return None
            size = self.t1[k] if k in self.t1 else self.t2[k]
            if k in self.t1:
                t1_left -= size
            chosen.append(k)
            taken.add(k)
            freed += size
        return chosen

    def order(self) -> list[Key]:
        return list(self.t1) + list(self.t2)


POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy, "arc": ARCPolicy,
                                          "hitdensity": HitDensityPolicy, "duel": DuelPolicy}


def policy_names() -> list[str]:
    """Every name :func:`make_policy` accepts (``default`` included)."""
    return ["default", *POLICIES]


def resolve_policy(name: str) -> str:
    """The policy ``name`` stands for (``default`` -> :data:`DEFAULT_POLICY`).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    real = DEFAULT_POLICY if name == "default" else name
    if real not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(policy_names())}")
    return real


def make_policy(name: str) -> CachePolicy:
    """A fresh policy instance called ``name`` (see :func:`resolve_policy`)."""
    return POLICIES[resolve_policy(name)]()


#: What ``default`` means (``kvtier serve`` and ``kvtier replay`` use it unless told otherwise):
#: ``duel``, kvtier's own, at or above LRU at every capacity of the policy lab on the conversation
#: trace and on every generated trace shape (docs/concepts/eviction.md).
DEFAULT_POLICY = "duel"
