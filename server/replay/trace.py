"""The Mooncake conversation trace and the keys and token ids kvtier derives from it.

Each line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``;
one hash id is a 512-token block of prefix (equal ids = equal prefix up to that block). A replay
scales blocks down to ``tokens_per_block`` tokens (a multiple of the 64-token page), gives every block
synthetic token ids derived from its hash id, and keys its pages with the chained page hash.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.page_keys import ROOT_KEY, page_keys

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake trace


@dataclass(frozen=True)
class TraceRequest:
    """One request of the trace.

    Attributes:
        index: 0-based position in arrival order.
        timestamp_ms: arrival time.
        input_length, output_length: tokens in the original trace.
        hash_ids: prefix block ids (one per 512-token block of the input).
    """

    index: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Requests of a trace file in arrival order (the first ``limit`` if given).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not a request (the message names the line).
    """
    out = []
    with Path(path).open() as f:
        for i, line in enumerate(f):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                req = TraceRequest(len(out), int(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                                   tuple(int(h) for h in d["hash_ids"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{i + 1}: not a trace request ({e})") from None
            if any(h < 0 for h in req.hash_ids):
                raise ValueError(f"{path}:{i + 1}: negative hash id")
            out.append(req)
    return out


def block_token_ids(hash_id: int, tokens_per_block: int) -> np.ndarray:
    """Synthetic token ids of block ``hash_id``: ``(tokens_per_block,)`` int32, distinct per block."""
    base = (hash_id * tokens_per_block) % (2**31 - tokens_per_block)
    return np.arange(base, base + tokens_per_block, dtype=np.int32)


@dataclass(frozen=True)
class PageRef:
    """A page of a request: its key, the block's hash id and its page index within the block."""

    key: bytes
    hash_id: int
    page_in_block: int


class RequestKeys:
    """Chained page keys of requests, memoised per (parent key, hash id).

    Args:
        tokens_per_block: tokens of one scaled block (a multiple of ``page_size``).
        page_size: tokens per page.
    """

    def __init__(self, tokens_per_block: int, page_size: int) -> None:
        if tokens_per_block <= 0 or tokens_per_block % page_size:
            raise ValueError(f"tokens_per_block must be a positive multiple of page_size={page_size}, got {tokens_per_block}")
        self.tokens_per_block = tokens_per_block
        self.page_size = page_size
        self.pages_per_block = tokens_per_block // page_size
        self._memo: dict[tuple[bytes, int], list[bytes]] = {}

    def pages(self, hash_ids: tuple[int, ...]) -> list[PageRef]:
        """The request's pages in order (``len(hash_ids) * pages_per_block``)."""
        out: list[PageRef] = []
        parent = ROOT_KEY
        for h in hash_ids:
            keys = self._memo.get((parent, h))
            if keys is None:
                keys = page_keys(block_token_ids(h, self.tokens_per_block), self.page_size, parent)
                self._memo[(parent, h)] = keys
            out.extend(PageRef(k, h, j) for j, k in enumerate(keys))
            parent = keys[-1]
        return out


def iter_page_accesses(requests: list[TraceRequest], keys: RequestKeys) -> Iterator[list[PageRef]]:
    """Each request's pages, in arrival order."""
    for r in requests:
        yield keys.pages(r.hash_ids)
