"""Ranked LRU: keys filed by a small integer rank, least recently filed first within a rank.

The building block of kvtier's ``duel`` policy: each of its eviction orders is one
:class:`RankedLRU` (plain LRU is every key at rank 0), and so is each shadow cache of its referee.
The next victim is the oldest key of the lowest rank.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator


class RankedLRU:
    """Keys by rank, oldest first within a rank. Not thread-safe (its owner locks)."""

    __slots__ = ("ranks", "rank_of")

    def __init__(self) -> None:
        self.ranks: dict[int, OrderedDict[Hashable, None]] = {}
        self.rank_of: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self.rank_of)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.rank_of

    def put(self, key: Hashable, rank: int) -> bool:
        """File ``key`` as the newest of ``rank`` (moving it if present); True if it was present."""
        old = self.rank_of.get(key)
        if old is not None:
            q = self.ranks[old]
            del q[key]
            if not q:
                del self.ranks[old]
        self.rank_of[key] = rank
        q = self.ranks.get(rank)
        if q is None:
            q = self.ranks[rank] = OrderedDict()
        q[key] = None
        return old is not None

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` if present."""
        rank = self.rank_of.pop(key, None)
        if rank is not None:
            q = self.ranks[rank]
            del q[key]
            if not q:
                del self.ranks[rank]

    def pop_oldest(self) -> Hashable:
        """Remove and return the next victim. Raises KeyError when empty."""
        if not self.ranks:
            raise KeyError("empty")
        low = min(self.ranks)
        q = self.ranks[low]
        key, _ = q.popitem(last=False)
        if not q:
            del self.ranks[low]
        del self.rank_of[key]
        return key

    def lowest_rank(self) -> int | None:
        """The rank of the next victim, or None when empty."""
        return min(self.ranks) if self.ranks else None

    def __iter__(self) -> Iterator[Hashable]:
        """Keys, next victim first."""
        for rank in sorted(self.ranks):
            yield from self.ranks[rank]
