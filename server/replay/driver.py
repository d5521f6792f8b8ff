"""Replay a trace against a prefix-cache backend: load, verify, write misses, store, release.

The driver talks to a :class:`ReplayBackend`: :class:`InProcessBackend` (the domain objects in this
process, real LMDB; or, with ``simulate``, the same policy on size-only tiers) or the client backends
in ``kvtier.cli.replay_backend`` (attached to a daemon's pool, or KV bytes over gRPC). Hit counts are
pages served per tier times the page size. A request's load answers what a lookup would (the
longest present prefix, per page the tier it came from), so the driver asks no lookup first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from kvtier.server.pool import PagedTokenAllocator, create_pool
from kvtier.server.replay.belady import belady_hits
from kvtier.server.replay.fill import PageFill, pool_words
from kvtier.server.replay.scale import ReplayScale
from kvtier.server.replay.trace import PageRef, RequestKeys, TraceRequest
from kvtier.server.tiers import PrefixCache, RecordCodec, TierStack

TIERS = ("device", "host", "disk")


class ReplayBackend(Protocol):
    """What the driver needs from a prefix-cache service."""

    simulate: bool

    def load(self, keys: Sequence[bytes]) -> tuple[str, np.ndarray, list[str]]:
        """``(lease, slots (len(keys) * page_size,) int64, tier of each loaded page)``."""

    def verify(self, fill: PageFill, pages: Sequence[tuple[int, int]], slots: np.ndarray) -> int:
        """How many of ``pages`` ``[(hash id, page in block)]``, loaded on whole-page ``slots``, differ
        anywhere from ``fill``'s bytes."""

    def write(self, fill: PageFill, pages: Sequence[tuple[int, int]], slots: np.ndarray) -> None:
        """Write ``fill``'s bytes of ``pages`` into whole-page ``slots``."""

    def store(self, lease: str, keys: Sequence[bytes], slots: np.ndarray, release: bool = False) -> None:
        """Hand the pages at ``slots`` to the cache under ``keys`` (with ``release``: then end the request)."""

    def release(self, lease: str) -> None:
        """End the request."""

    def moves(self) -> dict[str, dict[str, int]]:
        """Tier move counters ``{"src->dst": {"count", "bytes"}}``."""


@dataclass
class ReplayResult:
    """What a replay measured (JSON keys of ``kvtier replay --json``)."""

    requests: int = 0
    tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    miss_tokens: int = 0
    verify_failures: int = 0
    verified_pages: int = 0
    bytes_moved: dict[str, int] = field(default_factory=dict)
    moves: dict[str, dict[str, int]] = field(default_factory=dict)
    seconds: float = 0.0
    simulate: bool = False
    transport: str = ""
    """How KV reached the daemon: ``attach``, ``grpc``, or ``""`` in process / simulated."""
    scale: dict[str, Any] = field(default_factory=dict)
    belady_hit_tokens: int | None = None

    @property
    def hit_rate(self) -> float:
        """All hit tokens over all tokens."""
        return sum(self.hit_tokens.values()) / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict, with ``hit_rate``, per-tier rates and ``belady_hit_rate``."""
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        d["hit_rate_per_tier"] = {t: (v / self.tokens if self.tokens else 0.0) for t, v in self.hit_tokens.items()}
        d["belady_hit_rate"] = (self.belady_hit_tokens / self.tokens if self.tokens and self.belady_hit_tokens is not None
                                else None)
        d["tokens_per_second"] = self.tokens / self.seconds if self.seconds else 0.0
        return d


class InProcessBackend:
    """The prefix cache in this process: real pool, host tier and LMDB disk tier (or size-only twins).

    Args:
        scale: knobs (model, layers, budgets).
        disk_path: LMDB directory (unused when simulating).
        simulate: size-only tiers, no pool, no bytes.
    """

    def __init__(self, scale: ReplayScale, disk_path: str, *, simulate: bool = False) -> None:
        scale.validate()
        self.simulate = simulate
        model = scale.model_config()
        self.codec = RecordCodec(model)
        self.pool = None if simulate else create_pool(model, scale.device_tokens, device="cpu")
        self.allocator = PagedTokenAllocator(scale.device_tokens, model.page_size)
        self.stack = TierStack.from_configs(scale.tier_configs(disk_path), simulate=simulate)
        self.cache = PrefixCache(self.stack, self.allocator, self.codec, pool=self.pool,
                                 namespace=bytes.fromhex(model.fingerprint_digest()), policy=scale.policy)
        self.page_size = model.page_size
        self.layers = model.num_layers
        self.live = self.codec.live_layers

        self._words = pool_words(self.pool) if self.pool is not None else None

    def load(self, keys: Sequence[bytes]) -> tuple[str, np.ndarray, list[str]]:
        ld = self.cache.load(keys)
        return ld.lease, ld.slots.numpy(), ld.tiers

    def verify(self, fill: PageFill, pages: Sequence[tuple[int, int]], slots: np.ndarray) -> int:
        assert self._words is not None
        return fill.count_bad_in_pool(pages, *self._words, slots[::self.page_size] // self.page_size)

    def write(self, fill: PageFill, pages: Sequence[tuple[int, int]], slots: np.ndarray) -> None:
        assert self._words is not None
        fill.fill_pool(pages, *self._words, slots[::self.page_size] // self.page_size)

    def store(self, lease: str, keys: Sequence[bytes], slots: np.ndarray, release: bool = False) -> None:
        self.cache.store(lease, keys, torch.from_numpy(slots))
        if release:
            self.cache.release(lease)

    def release(self, lease: str) -> None:
        self.cache.release(lease)

    def moves(self) -> dict[str, dict[str, int]]:
        return self.stack.stats()["moves"]

    def close(self) -> None:
        self.stack.close()


def belady_bound(requests: Sequence[TraceRequest], scale: ReplayScale) -> int:
    """Hit tokens of Belady's MIN with the tiers' combined page capacity (the upper bound)."""
    keys = RequestKeys(scale.tokens_per_block, scale.model_config().page_size)
    accesses = [p.key for r in requests for p in keys.pages(r.hash_ids)]
    return belady_hits(accesses, sum(scale.capacity_pages().values())) * scale.model_config().page_size


def replay(requests: Sequence[TraceRequest], backend: ReplayBackend, scale: ReplayScale, *,
           on_request: Callable[[int, ReplayResult], None] | None = None) -> ReplayResult:
    """Run ``requests`` in arrival order through ``backend``; verify every loaded byte (not when
    simulating). ``on_request(i, partial_result)`` is called after each request (progress bars)."""
    model = scale.model_config()
    ps = model.page_size
    fill = None if backend.simulate else PageFill(model, [not s for s in model.skip_topk_layers])
    keys_of = RequestKeys(scale.tokens_per_block, ps)
    res = ReplayResult(simulate=backend.simulate, scale=scale.describe())
    t0 = time.perf_counter()
    for i, req in enumerate(requests):
        pages: list[PageRef] = keys_of.pages(req.hash_ids)
        keys = [p.key for p in pages]
        lease, slots, tiers = backend.load(keys)
        released = False
        try:
            n = len(tiers)
            if fill is not None and n:
                res.verify_failures += backend.verify(fill, [(p.hash_id, p.page_in_block) for p in pages[:n]], slots[:n * ps])
                res.verified_pages += n
            if n < len(pages):
                if fill is not None:
                    backend.write(fill, [(p.hash_id, p.page_in_block) for p in pages[n:]], slots[n * ps:])
                backend.store(lease, keys[n:], slots[n * ps:], release=True)  # one call: store, then release
                released = True
        finally:
            if not released:
                backend.release(lease)
        res.requests += 1
        res.tokens += len(pages) * ps
        for t in tiers:
            res.hit_tokens[t] = res.hit_tokens.get(t, 0) + ps
        res.miss_tokens += (len(pages) - len(tiers)) * ps
        if on_request is not None:
            on_request(i, res)
    res.seconds = time.perf_counter() - t0
    res.moves = backend.moves()
    res.bytes_moved = {k: v["bytes"] for k, v in res.moves.items()}
    return res
