"""kvtier's own eviction policy (``duel``): four orders of the same entries, and a referee that
picks the one that would have hit most lately.

Measured on the Mooncake conversation trace, no single order wins at every budget:

* **recency** (LRU) wins from about 1e7 tokens of cache: a conversation's next turn comes a
  median of ~500 requests later, and a large LRU cache still holds its pages;
* **frequency** (fewest requests first) wins at small budgets: a single cache of 1,953 blocks
  (1e6 tokens) hits 10.9% keeping the pages many requests asked for, against LRU's 5.3%, because
  only the often-asked pages are worth holding for hundreds of requests; **once first** (pages asked
  for once go before the rest, a 2Q-like split) wins between them (18.0% against LRU's 13.6% at
  5,859 blocks);
* **leaves first** (a page that was the last page of the one request that asked for it goes first)
  gains at every budget on this trace: a request's input rarely ends on a page boundary, so the next
  turn's chain differs from its last page on (0.8% of such pages are asked for again, 25% of the
  others). On a trace whose prompts end on page boundaries it would lose; then the referee does not
  pick it.

Which order fits depends on the budget, the traffic and what the tiers above hold, so the policy is
not told: the stack's :class:`~kvtier.server.tiers.referee.ShadowReferee` runs each order as a
key-only shadow cache of the stack's size over every request the prefix cache sees, and names the
order whose shadow hit most lately (decayed, half-life one stack's worth of page requests). Every
tier of the stack (device, host, disk; each its own ``DuelPolicy``) evicts in that order at that
moment. The one scale is the stack's size; nothing is fitted to a trace. The ranks of each order
are in :mod:`kvtier.server.tiers.referee`.

The device tier is refereed at its own size (:meth:`~kvtier.server.tiers.reuse.ReuseHistory.referee_for`
the pool's pages): the hits it alone serves are the cheapest, and a page it lets go falls to the host
anyway, so it keeps what a cache of its size would hit most. On the conversation trace at the default
budgets this is frequency-like while the stack follows leaves first: device hits 4.74% -> 7.45% of
blocks, total 30.12% -> 30.25%.

Copies held above go first (:meth:`DuelPolicy.copied_up`, in tiers below the first cascade tier:
the disk under the host). Loads copy a page up and leave the lower copy in place, so the disk holds
copies of pages a device pool or the host holds too (about 2,000 of its 16,362 pages at the default
budgets). While the faster copy lasts, evicting the disk's copy loses no hit; so the disk evicts
those first, oldest copy first (checked at eviction time through the stack's
:meth:`~kvtier.server.tiers.stack.TierStack.held_above`), then in the leader's order. The stack
holds more distinct pages for it: total 30.25% -> 31.09%, at the price of writing the page again
when the host lets it go (224,469 disk writes instead of 189,484). The host keeps its copies of
device pages (measured: evicting those first there loses 0.1 point).

Each order over the entries this tier holds is a :class:`~kvtier.server.tiers.ranked.RankedLRU`,
refiled on every use (the request count and leaf flag come from
:class:`~kvtier.server.tiers.reuse.ReuseHistory`; without one, the tier's own use count and no
leaves).

Admission to the disk tier (:meth:`DuelPolicy.admit`): a page whose rank in the leader's order is
below every rank the tier holds would be the tier's very next victim, so it is not expected back
before it is evicted there and is not stored (under recency every page is admitted, as with LRU).

A record that is not a prefix cache's page (an Offload copy, an SGLang unit: its tier key lies in no
prefix cache's namespace, :meth:`~kvtier.server.tiers.reuse.ReuseHistory.is_page`) is the caller's
own request to keep it: every ranked order puts it after the prefix cache's pages
(rank :data:`~kvtier.server.tiers.referee.CALLERS_RECORD`, least recently used first among such
records), and admission never refuses it for its rank; under recency it is one entry among all.

Without a history (a bare :class:`~kvtier.server.tiers.policy.TierIndex`) the policy keeps a referee
of its own, fed by its own uses and inserts and sized to the entries it holds.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvtier.server.tiers.policy import CachePolicy, Key
from kvtier.server.tiers.ranked import RankedLRU
from kvtier.server.tiers.referee import CALLERS_RECORD, ORDERS, RECENCY, ShadowReferee, rank
from kvtier.server.tiers.reuse import LEAF, ReuseHistory


class DuelPolicy(CachePolicy):
    """Evict in the order the referee names (``duel``): see the module docstring."""

    name = "duel"

    def __init__(self) -> None:
        self.sizes: dict[Key, int] = {}  # key -> charged bytes
        self.orders = [RankedLRU() for _ in ORDERS]
        self.own_uses: dict[Key, int] = {}
        self.history: ReuseHistory | None = None
        self._key_of: Callable[[Key], Key] = lambda k: k
        self.referee = ShadowReferee(1)  # its own until a history with the stack's referee comes
        self._own_referee = True
        self._above: Callable[[Key], bool] | None = None  # whether a faster tier holds a key now
        self._copied: OrderedDict[Key, None] = OrderedDict()  # keys a faster tier took a copy of, oldest first
        self._own_pages: int | None = None  # the size of the history's referee this tier asked for

    def watch_above(self, held_above: Callable[[Key], bool]) -> None:
        self._above = held_above

    def copied_up(self, key: Key) -> None:
        if self._above is not None and key in self.sizes:
            self._copied[key] = None
            self._copied.move_to_end(key)

    def _held_above(self) -> Iterator[Key]:
        """The keys a faster tier still holds, oldest copy first, looked at only as far as the caller
        reads (a victims() call stops at its first few); those found no longer held above are
        forgotten once the caller stops. (Checking every copy at each eviction cost the whole
        trace's simulation 2.4x LRU's time.)"""
        above, copied = self._above, self._copied
        if above is None or not copied:
            return
        gone: list[Key] = []
        try:
            for k in copied:
                if above(k):
                    yield k
                else:
                    gone.append(k)
        finally:
            for k in gone:
                copied.pop(k, None)

    def use_history(self, history: object, key_of: Callable[[Key], Key] = lambda k: k, *,
                    own_pages: int | None = None) -> None:
        if isinstance(history, ReuseHistory):
            self.history, self._key_of = history, key_of
            referee = history.referee if own_pages is None else history.referee_for(own_pages)
            if own_pages is not None:
                self._own_pages = own_pages
            if isinstance(referee, ShadowReferee):
                self.referee, self._own_referee = referee, False

    def close(self) -> None:
        if self._own_pages is not None and isinstance(self.history, ReuseHistory):
            self.history.release_referee(self._own_pages)
            self._own_pages = None

    @property
    def leader(self) -> int:
        """The order evictions follow now (an index of :data:`~kvtier.server.tiers.referee.ORDERS`)."""
        return self.referee.leader

    def _facts(self, key: Key) -> tuple[int, bool, bool]:
        """``(requests that asked for key, leaf, a prefix page)``; with a history, a key no request
        asked for (0 uses: an Offload copy, an SGLang unit) is the caller's record, not a prefix page."""
        if self.history is not None:
            k = self._key_of(key)
            return max(self.history.uses(k), 1), self.history.class_of(k) == LEAF, self.history.is_page(k)
        return self.own_uses.get(key, 1), False, True

    @staticmethod
    def _rank(order: int, facts: tuple[int, bool, bool]) -> int:
        uses, leaf, page = facts
        return rank(order, uses, leaf) if page or order == RECENCY else CALLERS_RECORD

    def _file(self, key: Key) -> None:
        facts = self._facts(key)
        for o, order in enumerate(self.orders):
            order.put(key, self._rank(o, facts))
        if self._own_referee:
            self.referee.observe([(key, facts[0], facts[1])])

    def touch(self, key: Key) -> None:
        if key not in self.sizes:
            raise KeyError(key)
        if self.history is None:
            self.own_uses[key] += 1
        self._file(key)

    def insert(self, key: Key, nbytes: int) -> None:
        if key in self.sizes:
            raise KeyError(f"{key!r} is already in the policy")
        self.sizes[key] = nbytes
        if self.history is None:
            self.own_uses[key] = 1
        self._file(key)

    def remove(self, key: Key) -> None:
        del self.sizes[key]
        for order in self.orders:
            order.discard(key)
        self.own_uses.pop(key, None)
        self._copied.pop(key, None)

    def victims(self, nbytes: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        if nbytes <= 0:
            return []
        if self._own_referee:
            self.referee.resize(len(self.sizes))  # full when asked for victims: its size in entries
        chosen: list[Key] = []
        freed = 0
        first = self._held_above()  # copies a faster tier holds go first: evicting them loses no hit
        rest = (k for k in self.orders[self.leader] if k not in self._copied)
        for key in itertools.chain(first, rest):
            if can_evict(key):
                chosen.append(key)
                freed += self.sizes[key]
                if freed >= nbytes:
                    return chosen
        return None

    def admit(self, key: Key, nbytes: int) -> bool:
        o = self.leader
        lowest = self.orders[o].lowest_rank()
        return lowest is None or self._rank(o, self._facts(key)) >= lowest

    def order(self) -> list[Key]:
        first = list(self._held_above())
        return first + [k for k in self.orders[self.leader] if k not in self._copied]
