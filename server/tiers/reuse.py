"""What the prefix cache has seen of each page key: a request-level signal every tier's policy may read.

A tier sees only its own traffic: the disk tier sees pages arrive as the host tier's victims and
cannot tell a page requested by five turns of a conversation from one requested once. The prefix
cache sees whole requests, so it records, per tier key, how many requests asked for the page and
whether the page was the *leaf* of the request that first brought it (the last page of its chain:
a request's input rarely ends on a page boundary, so the next turn's chain usually differs from the
leaf on; on the Mooncake conversation trace 0.8% of leaf blocks are asked for again, 25% of the
others). :class:`ReuseHistory` keeps that,
bounded (oldest keys forgotten first), and names a *class* per key that policies learn statistics
for (:class:`~kvtier.server.tiers.hit_density.HitDensityPolicy`). It records facts only; what a class
is worth is measured by the policy, online.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from kvtier.server.tiers.referee import ShadowReferee

#: Classes :meth:`ReuseHistory.class_of` returns.
LEAF, INNER, REUSED_ONCE, REUSED_MORE = 0, 1, 2, 3
CLASS_NAMES = ("leaf", "inner", "reused once", "reused more")


class ReuseHistory:
    """Per page key: requests that asked for it, and whether it was its first request's leaf.

    Args:
        max_keys: keys remembered (the least recently requested forgotten first); must be positive.

    Thread-safe (a leaf lock: it calls nothing while held).
    """

    def __init__(self, max_keys: int) -> None:
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys <= 0:
            raise ValueError(f"max_keys must be a positive integer, got {max_keys!r}")
        self.max_keys = max_keys
        self._seen: OrderedDict[Hashable, tuple[int, bool]] = OrderedDict()
        self._lock = threading.Lock()
        self.referee = None  # a ShadowReferee the stack attaches, told every request after the history
        self._own_referees: dict[int, ShadowReferee] = {}  # pages -> a ShadowReferee a tier heading its own cache asked for
        self._referee_users: dict[int, int] = {}  # pages -> how many tiers use that referee
        self.namespaces: tuple[bytes, ...] = ()  # tier-key prefixes of the prefix caches that report here

    def __len__(self) -> int:
        return len(self._seen)

    def observe(self, keys: Sequence[Hashable]) -> None:
        """A request asked for ``keys`` (its chain, in order)."""
        last = len(keys) - 1
        with self._lock:
            seen = self._seen
            for i, k in enumerate(keys):
                old = seen.pop(k, None)
                seen[k] = (1, i == last) if old is None else (old[0] + 1, old[1])
            while len(seen) > self.max_keys:
                seen.popitem(last=False)
            referees = [r for r in (self.referee, *self._own_referees.values()) if r is not None]
            if referees:
                facts = [(k, u, leaf and u <= 1) for k, u, leaf in  # leaf: class LEAF
                         ((k, *seen[k]) if k in seen else (k, 1, False) for k in keys)]
        for referee in referees:
            referee.observe(facts)

    def referee_for(self, pages: int) -> ShadowReferee:
        """A :class:`ShadowReferee` of ``pages`` keys told every request
        this history sees (one per size: tiers of one size share it), for a tier refereed at the size
        of its own cache instead of the stack's (the device: ``duel``'s device order)."""
        pages = max(int(pages), 1)
        with self._lock:
            got = self._own_referees.get(pages)
            if got is None:
                got = self._own_referees[pages] = ShadowReferee(pages)
            self._referee_users[pages] = self._referee_users.get(pages, 0) + 1
            return got

    def release_referee(self, pages: int) -> None:
        """A tier that asked :meth:`referee_for` ``pages`` is gone (its pool deleted): the referee is
        dropped with its last user, so requests no longer pay for sizes no pool has (attack pass 8,
        A8-2: each pool size ever used added a referee every later request fed)."""
        pages = max(int(pages), 1)
        with self._lock:
            left = self._referee_users.get(pages, 0) - 1
            if left > 0:
                self._referee_users[pages] = left
            else:
                self._referee_users.pop(pages, None)
                self._own_referees.pop(pages, None)

    def add_namespace(self, namespace: bytes) -> None:
        """A prefix cache whose tier keys start with ``namespace`` reports its requests here."""
        with self._lock:
            if namespace not in self.namespaces:
                self.namespaces = (*self.namespaces, namespace)

    def is_page(self, key: Hashable) -> bool:
        """Whether ``key`` is a prefix cache's page (its tier key starts with a registered namespace),
        not a record a caller stored itself (an Offload copy, an SGLang unit). With no namespace
        registered: whether a request asked for it while it was remembered."""
        spaces = self.namespaces
        if spaces and isinstance(key, bytes):
            return key.startswith(spaces)
        return key in self._seen

    def uses(self, key: Hashable) -> int:
        """Requests that asked for ``key`` while it was remembered (0: unknown or forgotten)."""
        got = self._seen.get(key)
        return 0 if got is None else got[0]

    def class_of(self, key: Hashable) -> int:
        """:data:`LEAF`, :data:`INNER`, :data:`REUSED_ONCE` or :data:`REUSED_MORE` (an unknown key: inner)."""
        got = self._seen.get(key)
        if got is None:
            return INNER
        uses, leaf = got
        if uses <= 1:
            return LEAF if leaf else INNER
        return REUSED_ONCE if uses == 2 else REUSED_MORE
