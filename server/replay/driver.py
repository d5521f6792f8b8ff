"""Replay a trace against a prefix-cache backend: look up, load, verify, write misses, store, release.

The driver talks to a :class:`ReplayBackend`: :class:`InProcessBackend` (the domain objects in this
process, real LMDB; or, with ``simulate``, the same policy on size-only tiers) or the gRPC client
backend in ``kvtier.cli.replay``. Hit counts are pages served per tier times the page size.
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
from kvtier.server.replay.fill import PageFill
from kvtier.server.replay.scale import ReplayScale
from kvtier.server.replay.trace import PageRef, RequestKeys, TraceRequest
from kvtier.server.tiers import PrefixCache, RecordCodec, TierStack

TIERS = ("device", "host", "disk")


class ReplayBackend(Protocol):
    """What the driver needs from a prefix-cache service."""

    simulate: bool

    def lookup(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Per tier, the longest prefix of ``keys`` present (pages)."""

    def load(self, keys: Sequence[bytes]) -> tuple[str, np.ndarray, list[str]]:
        """``(lease, slots (len(keys) * page_size,) int64, tier of each loaded page)``."""

    def read(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """KV of whole-page ``slots``: ``(latent (L, n, row_bytes), index (live, n / page_size, page_bytes))`` uint8."""

    def write(self, slots: np.ndarray, latent: np.ndarray, index: np.ndarray) -> None:
        """Write KV (shapes as :meth:`read`) into whole-page ``slots``."""

    def store(self, lease: str, keys: Sequence[bytes], slots: np.ndarray) -> None:
        """Hand the pages at ``slots`` to the cache under ``keys``."""

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
                                 namespace=bytes.fromhex(model.fingerprint_digest()))
        self.page_size = model.page_size
        self.layers = model.num_layers
        self.live = self.codec.live_layers

    def lookup(self, keys: Sequence[bytes]) -> dict[str, int]:
        return self.cache.lookup(keys).per_tier

    def load(self, keys: Sequence[bytes]) -> tuple[str, np.ndarray, list[str]]:
        ld = self.cache.load(keys)
        return ld.lease, ld.slots.numpy(), ld.tiers

    def read(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        assert self.pool is not None
        n = len(slots)
        p = n // self.page_size
        flat = self.pool.get_cpu_copy(torch.from_numpy(slots))
        lat = np.stack([torch.cat(c).reshape(n, -1).view(torch.uint8).numpy() for c in flat["kv"]]) if n else \
            np.empty((self.layers, 0, self.codec.row_bytes), np.uint8)
        idx = np.stack([torch.cat(flat["index_k"][layer]).numpy() for layer in self.live]) if p and self.live else \
            np.empty((len(self.live), p, self.codec.index_page_bytes), np.uint8)
        return lat, idx

    def write(self, slots: np.ndarray, latent: np.ndarray, index: np.ndarray) -> None:
        assert self.pool is not None
        loc = torch.from_numpy(slots)
        for layer in range(self.layers):
            self.pool.set_kv_buffer(layer, loc, torch.from_numpy(latent[layer]))
        ps, hd = self.page_size, self.pool.index_head_dim
        for pos, layer in enumerate(self.live):
            rows = index[pos]
            keys = np.ascontiguousarray(rows[:, :ps * hd]).reshape(-1, hd)
            scales = np.ascontiguousarray(rows[:, ps * hd:]).view(np.float32).reshape(-1)
            self.pool.set_index_k_scale_buffer(layer, loc, torch.from_numpy(keys), torch.from_numpy(scales))

    def store(self, lease: str, keys: Sequence[bytes], slots: np.ndarray) -> None:
        self.cache.store(lease, keys, torch.from_numpy(slots))

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
        backend.lookup(keys)
        lease, slots, tiers = backend.load(keys)
        try:
            n = len(tiers)
            if fill is not None and n:
                lat, idx = backend.read(slots[:n * ps])
                res.verify_failures += fill.count_bad_pages([(p.hash_id, p.page_in_block) for p in pages[:n]], lat, idx)
                res.verified_pages += n
            if n < len(pages):
                if fill is not None:
                    lat, idx = fill.expected([(p.hash_id, p.page_in_block) for p in pages[n:]])
                    backend.write(slots[n * ps:], lat, idx)
                backend.store(lease, keys[n:], slots[n * ps:])
        finally:
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
