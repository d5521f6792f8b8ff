"""Synthetic traces of other shapes a KV cache meets, to check a policy beyond the one real trace.

Each generator is deterministic for a seed and returns :class:`~kvtier.server.replay.trace.TraceRequest`
lists in the Mooncake trace's format (hash ids of 512-token blocks, chained: a request's ids are its
prefix's ids followed by its own), so ``kvtier replay --simulate`` and the policy lab run them as is:

* ``shared_prompts``: a few system prompts (8-32 blocks), each followed by a short unique suffix;
* ``long_documents``: long documents (64-200 blocks) each read once, none shared (a scan);
* ``chats``: multi-turn conversations with think times: each turn repeats the conversation so far and
  adds 1-6 blocks plus a partial leaf block, interleaved with other conversations;
* ``rereads``: documents (4-40 blocks) re-read whole with Zipf-like popularity, so a request's last
  page comes back as often as its others;
* ``mix``: shared prompts, long documents and chats interleaved in arrival order.
"""

from __future__ import annotations

import random

from kvtier.server.replay.trace import TRACE_BLOCK_TOKENS, TraceRequest

SHAPES = ("shared_prompts", "long_documents", "chats", "rereads", "mix")


class _Ids:
    """Fresh hash ids."""

    def __init__(self, start: int) -> None:
        self.next = start

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _requests(chains: list[tuple[int, list[int]]]) -> list[TraceRequest]:
    """``(arrival ms, hash ids)`` -> requests in arrival order (input ends mid-way through the last block)."""
    chains.sort(key=lambda c: c[0])
    return [TraceRequest(i, t, (len(ids) - 1) * TRACE_BLOCK_TOKENS + TRACE_BLOCK_TOKENS // 2, 128, tuple(ids))
            for i, (t, ids) in enumerate(chains)]


def _shared_prompts(rng: random.Random, ids: _Ids, n: int) -> list[tuple[int, list[int]]]:
    prompts = [ids.take(rng.randint(8, 32)) for _ in range(8)]
    weights = [1.0 / (k + 1) for k in range(len(prompts))]  # a few popular prompts, a tail of rare ones
    return [(rng.randint(0, 3_600_000), rng.choices(prompts, weights)[0] + ids.take(rng.randint(1, 3)))
            for _ in range(n)]


def _long_documents(rng: random.Random, ids: _Ids, n: int) -> list[tuple[int, list[int]]]:
    return [(rng.randint(0, 3_600_000), ids.take(rng.randint(64, 200))) for _ in range(n)]


def _chats(rng: random.Random, ids: _Ids, n: int) -> list[tuple[int, list[int]]]:
    system = ids.take(4)
    out: list[tuple[int, list[int]]] = []
    while len(out) < n:
        t = rng.randint(0, 3_600_000)
        history = list(system)
        for _ in range(rng.randint(1, 8)):
            history += ids.take(rng.randint(1, 6))
            out.append((t, history + ids.take(1)))  # the leaf block: partial, never asked for again
            t += int(rng.expovariate(1 / 60_000))  # think time, mean one minute
    return out[:n]


def _rereads(rng: random.Random, ids: _Ids, n: int) -> list[tuple[int, list[int]]]:
    """Documents of 4-40 blocks re-read whole, with Zipf-like popularity: unlike a chat, a request's
    last page is asked for again as often as its others (a policy that bets on leaves being cold loses)."""
    docs = [ids.take(rng.randint(4, 40)) for _ in range(max(n // 4, 1))]
    weights = [1.0 / (k + 1) ** 0.8 for k in range(len(docs))]
    return [(rng.randint(0, 3_600_000), list(rng.choices(docs, weights)[0])) for _ in range(n)]


def generate(shape: str, n: int, seed: int = 0) -> list[TraceRequest]:
    """``n`` requests of ``shape`` (one of :data:`SHAPES`), the same for the same seed.

    Raises:
        ValueError: an unknown shape or a negative ``n``.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown trace shape {shape!r}; known: {', '.join(SHAPES)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng, ids = random.Random(seed), _Ids(1)
    if shape == "mix":
        k = n // 3
        return _requests(_shared_prompts(rng, ids, k) + _long_documents(rng, ids, k // 4) + _chats(rng, ids, n - k - k // 4))
    make = {"shared_prompts": _shared_prompts, "long_documents": _long_documents, "chats": _chats,
            "rereads": _rereads}[shape]
    return _requests(make(rng, ids, n))
