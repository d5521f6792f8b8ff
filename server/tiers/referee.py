"""Which eviction order a tier stack should follow now, judged by shadow caches (``duel``'s referee).

Each *order* ranks a page by two facts the prefix cache records per page key
(:class:`~kvtier.server.tiers.reuse.ReuseHistory`): how many requests asked for it (``uses``), and
whether it is a *leaf* (asked for by one request, whose last page it was). Lowest rank goes first,
least recently used first within a rank (:class:`~kvtier.server.tiers.ranked.RankedLRU`):

========================  =========================================================================
order                     rank
========================  =========================================================================
``recency`` (LRU)         0 for every page
``leaves first``          0 for a leaf, 1 for the rest
``once first`` (2Q-like)  0 for a leaf, 1 for another page asked for once, 2 for the rest
``frequency`` (LFU)       0 for a leaf, else the bit length of ``uses`` (1; 2-3; 4-7; ...)
========================  =========================================================================

A :class:`ShadowReferee` runs every order as a key-only shadow cache of the stack's size (device
pages plus every cascade tier's pages) over every request, and counts each shadow's *prefix* hits
(a page counts while the request's earlier pages hit too, as the prefix cache serves them) with
exponential decay, half-life one stack's worth of page requests. The order with the most decayed
hits is the :attr:`~ShadowReferee.leader` (the earlier order in the table on a tie); every tier's
:class:`~kvtier.server.tiers.duel.DuelPolicy` evicts in it.

The one scale is the stack's size in pages; nothing is fitted to a trace. Cost per page requested:
one ``OrderedDict`` move per order; memory: four key sets of the stack's size.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable

from kvtier.server.tiers.ranked import RankedLRU

RECENCY, LEAVES_FIRST, ONCE_FIRST, FREQUENCY = 0, 1, 2, 3
#: The rank of a record no request asked for (an Offload copy, an SGLang unit): the caller's own
#: request to keep it, so under every ranked order it goes after the prefix cache's pages.
CALLERS_RECORD = 1 << 16
#: Display names of the orders, by index.
ORDERS = ("recency", "leaves first", "once first", "frequency")


def rank(order: int, uses: int, leaf: bool) -> int:
    """The rank ``order`` gives a page asked for by ``uses`` requests (``leaf``: see the module docstring)."""
    if order == RECENCY:
        return 0
    if leaf:
        return 0
    if order == LEAVES_FIRST:
        return 1
    if order == ONCE_FIRST:
        return 1 if uses <= 1 else 2
    return max(uses, 1).bit_length()


class ShadowReferee:
    """Key-only shadow caches of ``pages`` keys, one per order, and their decayed prefix hits.

    Args:
        pages: the size of each shadow, in page keys (the stack's pages); must be positive.

    Thread-safe (a leaf lock: it calls nothing while held); :attr:`leader` is a plain integer a
    reader may take without the lock.
    """

    def __init__(self, pages: int) -> None:
        if isinstance(pages, bool) or not isinstance(pages, int) or pages <= 0:
            raise ValueError(f"pages must be a positive integer, got {pages!r}")
        self.pages = pages
        self.decay = 0.5 ** (1 / pages)
        self.scores = [0.0] * len(ORDERS)
        self.leader = RECENCY
        self._shadows = [RankedLRU() for _ in ORDERS]
        self._lock = threading.Lock()

    def resize(self, pages: int) -> None:
        """Make each shadow ``pages`` keys (a policy without a stack sizes its own referee to what it holds)."""
        pages = max(int(pages), 1)
        with self._lock:
            if pages != self.pages:
                self.pages = pages
                self.decay = 0.5 ** (1 / pages)

    def observe(self, keys: Iterable[tuple[Hashable, int, bool]]) -> None:
        """A request asked for these ``(key, requests that asked for it so far, leaf)``, in order."""
        with self._lock:
            scores, d = self.scores, self.decay
            n = len(ORDERS)
            ok = [1.0] * n  # 1 while the request's pages so far hit in that shadow
            for key, uses, leaf in keys:
                for o in range(n):
                    s = scores[o] * d
                    if self._shadows[o].put(key, rank(o, uses, leaf)):
                        s += ok[o]
                    else:
                        ok[o] = 0.0
                    scores[o] = s
            for shadow in self._shadows:
                while len(shadow) > self.pages:
                    shadow.pop_oldest()
            best = max(scores)
            self.leader = scores.index(best)
