"""Belady's optimal (MIN) policy: the hit count no replacement policy can beat for a capacity.

Used as the upper bound for a replay: one cache of the tiers' combined page capacity, every page
access in arrival order, evicting the page whose next use is furthest away (a page used never again
is not cached at all). It counts a page as a hit whenever it is present, prefix or not, so it bounds
the prefix cache's hits from above.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence


def belady_hits(accesses: Sequence[Hashable], capacity: int) -> int:
    """Hits of Belady's MIN over ``accesses`` with room for ``capacity`` items (bypass allowed).

    Raises:
        ValueError: negative capacity.
    """
    if capacity < 0:
        raise ValueError("capacity must be >= 0")
    n = len(accesses)
    never = n + 1
    nxt = [never] * n
    last: dict[Hashable, int] = {}
    for i in range(n - 1, -1, -1):
        nxt[i] = last.get(accesses[i], never)
        last[accesses[i]] = i
    cached: dict[Hashable, int] = {}  # item -> its next use
    heap: list[tuple[int, Hashable]] = []  # (-next use, item), stale entries skipped
    hits = 0
    for i, x in enumerate(accesses):
        if x in cached:
            hits += 1
            cached[x] = nxt[i]
            heapq.heappush(heap, (-nxt[i], x))
            continue
        if capacity == 0 or nxt[i] == never:
            continue
        if len(cached) >= capacity:
            while True:
                neg, y = heap[0]
                if cached.get(y) == -neg:
                    break
                heapq.heappop(heap)
            if -neg <= nxt[i]:
                continue  # the newcomer is needed last: do not cache it
            heapq.heappop(heap)
            del cached[y]
        cached[x] = nxt[i]
        heapq.heappush(heap, (-nxt[i], x))
    return hits
