"""Eviction as a small strategy, and the byte-budget index every tier keeps.

:class:`CachePolicy` is ``touch / insert / remove / evict``; ``evict`` either frees enough bytes and
removes exactly its victims, or returns None and changes nothing. A second policy is a new small
class, not a flag. :class:`TierIndex` adds a byte budget and pins (reference counts) on top; the real
tiers and the cache simulator share it, so a simulation evicts exactly what a real run evicts.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager

from kvtier.server.tiers.errors import TierFullError

Key = Hashable


class CachePolicy(ABC):
    """Which entry to evict next. Entries carry their charged size in bytes.

    The index that owns a policy tells it its budget once (:meth:`bind`), records uses
    (:meth:`touch`), adds entries (:meth:`insert`), takes the :meth:`victims` it needs and then
    drops them with :meth:`evicted` (an eviction: a policy may remember the key as a *ghost*, a
    recently evicted key whose return says its reuse distance exceeded the budget) or forgets an
    entry with :meth:`remove` (an explicit removal: no ghost). :meth:`admit` answers whether a
    newcomer is worth storing at all (the disk tier's admission rule).
    """

    #: The name :func:`kvtier.server.tiers.policies.make_policy` knows this policy by.
    name: str = ""

    def bind(self, capacity: int) -> None:
        """Learn the owner's budget in charged bytes (called once, before any entry). Policies with
        size targets (a small queue of 10%, ghost lists as long as the cache) use it; default: nothing."""

    def use_history(self, history: object, key_of: Callable[[Key], Key] = lambda k: k, *,
                    own_pages: int | None = None) -> None:
        """Read request-level facts about keys from ``history`` (a
        :class:`~kvtier.server.tiers.reuse.ReuseHistory`, keyed by ``key_of(key)``): the prefix cache
        offers it to every tier's policy. ``own_pages``: this tier heads a cache of its own of that
        many pages (the device pool, whose hits are the cheapest), to be judged at that size rather
        than the whole stack's. Default: ignored."""

    @abstractmethod
    def touch(self, key: Key) -> None:
        """Record a use of ``key`` (present)."""

    @abstractmethod
    def insert(self, key: Key, nbytes: int) -> None:
        """Add ``key`` (absent) charged ``nbytes``."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """Forget ``key`` (present)."""

    @abstractmethod
    def victims(self, nbytes: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        """Entries whose eviction frees at least ``nbytes``, skipping those ``can_evict`` refuses;
        None if that is impossible. Never changes which keys are held; a policy with second chances
        (S3-FIFO, CLOCK) may apply them while it looks (move a used entry to its main queue), which
        is a decision it would take at this point anyway, so calling it twice returns the same keys."""

    def evicted(self, key: Key) -> None:
        """Drop ``key`` (present) as an eviction victim. Default: :meth:`remove` (no ghost)."""
        self.remove(key)

    def admit(self, key: Key, nbytes: int) -> bool:
        """Whether ``key`` (absent), offered to a full owner, is expected back before it would be
        evicted here; the disk tier stores only admitted pages. Default: always."""
        return True

    def watch_above(self, held_above: Callable[[Key], bool]) -> None:
        """The stack says how to ask whether a faster tier holds a copy of a key now (this tier is
        below another: the disk under the host). Default: ignored."""

    def copied_up(self, key: Key) -> None:
        """A faster tier took a copy of ``key`` (present here): while that copy lasts, evicting this
        one loses no hit. Default: nothing."""

    def close(self) -> None:
        """The tier is gone (its pool deleted): give back what :meth:`use_history` took from the
        history (a referee of the tier's own size). Default: nothing."""

    @abstractmethod
    def order(self) -> list[Key]:
        """Keys, next victim first."""

    def evict(self, nbytes: int, can_evict: Callable[[Key], bool] = lambda k: True) -> list[Key] | None:
        """Remove and return the :meth:`victims` for ``nbytes``; None (nothing changed) if impossible."""
        chosen = self.victims(nbytes, can_evict)
        if chosen is not None:
            for key in chosen:
                self.evicted(key)
        return chosen


class LRUPolicy(CachePolicy):
    """Least recently used first (``lru``): kvtier's behaviour before policies had names, and the
    peers' default (Mooncake Store, SGLang's radix cache, vLLM's CPU offload, LMCache)."""

    name = "lru"

    def __init__(self) -> None:
        self._entries: OrderedDict[Key, int] = OrderedDict()

    def touch(self, key: Key) -> None:
        self._entries.move_to_end(key)

    def insert(self, key: Key, nbytes: int) -> None:
        if key in self._entries:
            raise KeyError(f"{key!r} is already in the policy")
        self._entries[key] = nbytes

    def remove(self, key: Key) -> None:
        del self._entries[key]

    def victims(self, nbytes: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        if nbytes <= 0:
            return []
        chosen, freed = [], 0
        for key, size in self._entries.items():
            if can_evict(key):
                chosen.append(key)
                freed += size
                if freed >= nbytes:
                    return chosen
        return None

    def order(self) -> list[Key]:
        return list(self._entries)


#: Uses :meth:`TierIndex.touch_later` keeps before a call applies them itself (bounded memory).
TOUCH_LATER_MAX = 4096


class TierIndex:
    """What a tier holds, its byte budget, its policy and its pins.

    Args:
        capacity: budget in charged bytes.
        policy: eviction policy (default :class:`LRUPolicy`); told ``capacity`` (or ``policy_capacity``)
            through :meth:`CachePolicy.bind`.
        policy_capacity: the budget the policy should size its targets by, when the index's own
            byte budget is not the real limit (the device tier: its pool's pages).

    Pins are reference counts: a pinned key is never chosen as a victim. Take them with
    :meth:`pinned` (a context manager), so they return to zero on every path, exceptions included.
    All methods are thread-safe (one lock per index; callers may hold :attr:`lock` across calls).
    ``used``, ``total_pins`` and ``len()`` are plain integers a monitoring reader may take without
    the lock (they are updated under it, one operation at a time).

    Groups (optional, :meth:`set_groups`): keys may belong to groups (the caller's function of the
    key; the index never interprets keys itself) with a byte quota each. A group over its quota makes
    room from its *own* least recently used entries first; other groups' entries are evicted only for
    the shared budget. The daemon uses this for per-tenant tier quotas (keys carry the tenant).
    """

    def __init__(self, capacity: int, policy: CachePolicy | None = None, *, policy_capacity: int | None = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be a non-negative integer of bytes, got {capacity!r}")
        self.capacity = capacity
        self.policy = policy or LRUPolicy()
        self.policy.bind(capacity if policy_capacity is None else policy_capacity)
        self.lock = threading.RLock()
        self._charge: dict[Key, int] = {}
        self._pins: dict[Key, int] = {}
        self.used = 0
        self.total_pins = 0
        self._group_of: Callable[[Key], str | None] | None = None
        self._quota_of: Callable[[str], int | None] = lambda g: None
        self._key_group: dict[Key, str] = {}
        self._group_used: dict[str, int] = {}
        self._later: deque[Key] = deque()  # uses recorded by touch_later, not applied yet
        self._copied_later: deque[Key] = deque()  # copies up recorded by copied_up, not applied yet
        #: Called with the keys a drain of :meth:`touch_later`'s uses found present (lock held).
        self.on_touch: Callable[[list[Key]], None] | None = None

    def __contains__(self, key: Key) -> bool:
        return key in self._charge

    def __len__(self) -> int:
        return len(self._charge)

    def charge_of(self, key: Key) -> int | None:
        """Charged bytes of ``key``, None if absent."""
        return self._charge.get(key)

    def keys(self) -> list[Key]:
        """Keys, next victim first."""
        with self.lock:
            self._apply_later()
            return self.policy.order()

    # ----- deferred touches ------------------------------------------------------------------------
    def touch_later(self, keys: Iterable[Key]) -> None:
        """Record a use of each of ``keys`` without taking the lock (a read path's hits: one deque
        append instead of a lock, an order update and a cache miss or two a record, ~5 us of a
        ~40 us disk read under load; BENCHMARKS.md, fix 7). The uses are applied, in order, by the
        next method that reads or changes the order (:meth:`keys`, :meth:`plan_insert`, inserts,
        touches, removals) or :meth:`apply_touches`; a key gone by then is skipped. ``policy``
        read directly sees them only after :meth:`apply_touches`. At most :data:`TOUCH_LATER_MAX` wait:
        past that (a stretch of reads with no write) this call applies them under the lock."""
        q = self._later
        q.extend(keys)
        if len(q) > TOUCH_LATER_MAX:
            with self.lock:
                self._apply_later()

    def apply_touches(self) -> None:
        """Apply the uses :meth:`touch_later` recorded."""
        with self.lock:
            self._apply_later()

    def _apply_later(self) -> None:
        """(lock held) Drain the deferred uses into the policy, then tell :attr:`on_touch`; then the
        deferred copies up (:meth:`copied_up`)."""
        cq = self._copied_later
        if cq:
            charge, copied, pop = self._charge, self.policy.copied_up, cq.popleft
            while cq:
                k = pop()
                if k in charge:
                    copied(k)
        q = self._later
        if not q:
            return
        present: list[Key] = []
        charge, touch, pop = self._charge, self.policy.touch, q.popleft
        while q:
            k = pop()  # only this drain pops (under the lock); readers only append
            if k in charge:
                touch(k)
                present.append(k)
        if present and self.on_touch is not None:
            self.on_touch(present)

    def copied_up(self, keys: Iterable[Key]) -> None:
        """A faster tier took a copy of each of ``keys``; those held here are told to the policy
        (:meth:`CachePolicy.copied_up`) by the next method that reads or changes the order, as
        :meth:`touch_later`'s uses: recorded without the lock, so a StorePrefix or LoadPrefix, which
        calls this holding its pool and cache, never waits for a disk tier's index lock that a slow
        commit holds (attack pass 8, A8-4: 6 s). Past :data:`TOUCH_LATER_MAX` waiting, they are
        applied here if the lock is free at once (never waited for)."""
        q = self._copied_later
        q.extend(keys)
        if len(q) > TOUCH_LATER_MAX and self.lock.acquire(blocking=False):
            try:
                self._apply_later()
            finally:
                self.lock.release()

    def pin_count(self, key: Key) -> int:
        """Current pins on ``key``."""
        return self._pins.get(key, 0)

    @property
    def pinned_keys(self) -> int:
        """Keys with at least one pin (a plain read)."""
        return len(self._pins)

    # ----- groups ---------------------------------------------------------------------------------
    def set_groups(self, group_of: Callable[[Key], str | None], quota_of: Callable[[str], int | None]) -> None:
        """Account entries per group: ``group_of(key)`` names a key's group (None: no group) and
        ``quota_of(group)`` its byte quota (None: none). Entries already held are counted now."""
        with self.lock:
            self._group_of, self._quota_of = group_of, quota_of
            self._key_group, self._group_used = {}, {}
            for key, charge in self._charge.items():
                self._add_to_group(key, charge)

    def group_used(self, group: str) -> int:
        """Charged bytes of ``group``'s entries (a plain read; monitoring may call it without the lock)."""
        return self._group_used.get(group, 0)

    def group_of(self, key: Key) -> str | None:
        """The group of ``key`` (None without groups or for a key of no group)."""
        return self._group_of(key) if self._group_of is not None else None

    def _add_to_group(self, key: Key, charge: int) -> None:
        g = self.group_of(key)
        if g is not None:
            self._key_group[key] = g
            self._group_used[g] = self._group_used.get(g, 0) + charge

    def _drop_from_group(self, key: Key, charge: int) -> None:
        g = self._key_group.pop(key, None)
        if g is not None:
            left = self._group_used[g] - charge
            if left:
                self._group_used[g] = left
            else:
                del self._group_used[g]

    # ----- inserting ---------------------------------------------------------------------------------
    def plan_insert(self, key: Key, charge: int, exclude: Iterable[Key] = ()) -> list[Key]:
        """Victims to evict so ``key`` (absent) charged ``charge`` fits; changes nothing. With groups,
        a group over its quota gives up its own least recently used entries first.

        Raises:
            TierFullError: larger than the whole budget or the key's group quota, or too much of the
                tier (or of the group's share) is pinned.
        """
        with self.lock:
            self._apply_later()
            if charge > self.capacity:
                raise TierFullError(f"a record of {charge} bytes exceeds the tier's budget of {self.capacity} bytes")
            if self._group_of is None and self.used + charge <= self.capacity:
                return []  # it fits: no victims (the common case of a tier that is not full)
            held = set(exclude)

            def free(k: Key) -> bool:
                return self._pins.get(k, 0) == 0 and k not in held

            chosen: list[Key] = []
            group = self.group_of(key)
            quota = self._quota_of(group) if group is not None else None
            if quota is not None:
                if charge > quota:
                    raise TierFullError(f"a record of {charge} bytes exceeds its group's quota of {quota} bytes")
                own_need = self.group_used(group) + charge - quota  # type: ignore[arg-type]
                own = self.policy.victims(own_need, lambda k: free(k) and self._key_group.get(k) == group)
                if own is None:
                    raise TierFullError(f"no room for {charge} bytes within its group's quota of {quota} bytes: "
                                        f"{self.group_used(group)} used (of which the rest is pinned)")  # type: ignore[arg-type]
                chosen = own
            picked = set(chosen)
            need = self.used + charge - self.capacity - sum(self._charge[k] for k in chosen)
            more = self.policy.victims(need, lambda k: free(k) and k not in picked)
            if more is None:
                raise TierFullError(f"no room for {charge} bytes: {self.used} of {self.capacity} bytes used "
                                    f"and the rest is pinned")
            return chosen + more

    def commit_insert(self, key: Key, charge: int, victims: Iterable[Key] = ()) -> None:
        """Remove ``victims`` and add ``key`` (after the storage write succeeded)."""
        with self.lock:
            self._apply_later()
            for v in victims:
                self.evict(v)
            self.policy.insert(key, charge)
            self._charge[key] = charge
            self.used += charge
            self._add_to_group(key, charge)

    def clear(self) -> None:
        """Forget every entry (pins stay with their holders and are dropped by them)."""
        with self.lock:
            self._apply_later()
            for key in self.policy.order():
                self.policy.remove(key)
            self._charge.clear()
            self.used = 0
            self._key_group.clear()
            self._group_used.clear()

    def touch(self, key: Key) -> None:
        """Record a use of ``key`` if present."""
        with self.lock:
            self._apply_later()
            if key in self._charge:
                self.policy.touch(key)

    def touch_many(self, keys: Iterable[Key]) -> list[Key]:
        """Record a use of each present key of ``keys``, in order, under one lock; returns them."""
        with self.lock:
            self._apply_later()
            present = [k for k in keys if k in self._charge]
            touch = self.policy.touch
            for k in present:
                touch(k)
            return present

    def remove(self, key: Key) -> bool:
        """Forget ``key``; False if it was absent."""
        with self.lock:
            self._apply_later()
            charge = self._charge.pop(key, None)
            if charge is None:
                return False
            self.policy.remove(key)
            self.used -= charge
            self._drop_from_group(key, charge)
            return True

    def evict(self, key: Key) -> bool:
        """Drop ``key`` as an eviction victim (the policy may keep it as a ghost); False if absent."""
        with self.lock:
            self._apply_later()
            charge = self._charge.pop(key, None)
            if charge is None:
                return False
            self.policy.evicted(key)
            self.used -= charge
            self._drop_from_group(key, charge)
            return True

    def admit(self, key: Key, charge: int) -> bool:
        """Whether the policy admits ``key`` charged ``charge``: always while it fits without an
        eviction, else :meth:`CachePolicy.admit`."""
        with self.lock:
            self._apply_later()
            if self.used + charge <= self.capacity:
                return True
            return self.policy.admit(key, charge)

    def pin(self, keys: Iterable[Key]) -> list[Key]:
        """Pin the present keys among ``keys``; returns those pinned (pass them to :meth:`unpin`)."""
        with self.lock:
            got = [k for k in keys if k in self._charge]
            for k in got:
                self._pins[k] = self._pins.get(k, 0) + 1
            self.total_pins += len(got)  # sum of all pins: 0 whenever no read or load is in flight
            return got

    def unpin(self, keys: Iterable[Key]) -> None:
        """Drop one pin from each key."""
        with self.lock:
            for k in keys:
                left = self._pins[k] - 1
                if left:
                    self._pins[k] = left
                else:
                    del self._pins[k]
                self.total_pins -= 1

    @contextmanager
    def pinned(self, keys: Iterable[Key]) -> Iterator[list[Key]]:
        """Pin the present keys for the ``with`` block; unpinned on every exit path."""
        got = self.pin(keys)
        try:
            yield got
        finally:
            self.unpin(got)
