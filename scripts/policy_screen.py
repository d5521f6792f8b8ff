#!/usr/bin/env python3
"""Screen an eviction order in seconds before running the policy lab (minutes per capacity).

One key-only cache of ``capacity`` trace blocks (no tiers), ranked LRU
(:class:`~kvtier.server.tiers.ranked.RankedLRU`: lowest rank first, least recently used first within a
rank), prefix hits counted as ``kvtier replay`` counts them (a block hits while the request's earlier
blocks hit). Each order is a rank function of ``(uses, leaf, depth, seen)``: requests that asked for
the block so far (this one included), whether it was the leaf of the first request that brought it
(and asked for once), its position in the request's chain, and how many leading blocks of the request
had been seen before. ``-rev`` files a request's blocks deepest first (a chain's root most recent).

On the conversation trace a single cache of each order is close to what the tier stack gets with
``duel`` (LRU 5.32% here against 5.31% in the lab at 1e6 tokens), so a new order that does not beat
the existing ones here will not beat them in the lab.

    .venv/bin/python scripts/policy_screen.py 1e6,3e6,1e7,3e7 lru,leaves,once,freq
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvtier.server.tiers.ranked import RankedLRU
from kvtier.server.tiers.referee import FREQUENCY, LEAVES_FIRST, ONCE_FIRST, rank

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "conversation_trace.jsonl"

ORDERS = {
    "lru": lambda u, leaf, d, s: 0,
    "leaves": lambda u, leaf, d, s: rank(LEAVES_FIRST, u, leaf),
    "once": lambda u, leaf, d, s: rank(ONCE_FIRST, u, leaf),
    "freq": lambda u, leaf, d, s: rank(FREQUENCY, u, leaf),
    "lfu": lambda u, leaf, d, s: u.bit_length(),  # no leaf split
    "few": lambda u, leaf, d, s: 0 if leaf else min(u.bit_length(), 3),  # leaf | 1 | 2-3 | 4+
    "cont": lambda u, leaf, d, s: 0 if leaf else (1 if s <= 1 else 2) if u <= 1 else 2 + u.bit_length(),
}


def hit_rate(requests: list[list[int]], capacity: int, order, reverse: bool = False) -> float:
    cache, uses, leaf_of, hits, blocks = RankedLRU(), {}, {}, 0, 0
    for chain in requests:
        seen = next((i for i, k in enumerate(chain) if k not in uses), len(chain))
        ok, filed = True, []
        for i, k in enumerate(chain):
            u = uses[k] = uses.get(k, 0) + 1
            if u == 1:
                leaf_of[k] = i == len(chain) - 1
            if k in cache:
                hits += ok
            else:
                ok = False
            filed.append((k, order(u, leaf_of[k] and u <= 1, i, seen)))
        for k, r in reversed(filed) if reverse else filed:
            cache.put(k, r)
        while len(cache) > capacity:
            cache.pop_oldest()
        blocks += len(chain)
    return hits / blocks


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
        print(f"usage: {sys.argv[0]} CAPACITIES ORDERS [TRACE]   e.g. 1e6,3e6 lru,leaves,once,freq "
              f"(orders: {', '.join(sorted(ORDERS))}; add -rev to file a request's blocks deepest first)")
        sys.exit(0 if len(sys.argv) > 1 else 2)
    caps = [int(float(x)) // 512 for x in sys.argv[1].split(",")]
    names = sys.argv[2].split(",")
    trace = Path(sys.argv[3]) if len(sys.argv) > 3 else TRACE
    requests = [json.loads(line)["hash_ids"] for line in trace.open()]
    for cap in caps:
        row = []
        for name in names:
            base = name.removesuffix("-rev")
            row.append(f"{name} {100 * hit_rate(requests, cap, ORDERS[base], base != name):.2f}%")
        print(f"{cap} blocks: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
