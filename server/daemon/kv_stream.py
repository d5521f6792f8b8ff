"""A KV read as a stream of messages built straight from the pool's memory (ReadKV).

A read is a consistent snapshot: its bytes are those of one moment, taken under the pool's shared
lock. The messages are built in a worker thread that holds the lock: where a segment's slots make
runs of consecutive slots (whole pages do) on a CPU pool, each message's bytes are joined straight
from views of the pool's rows (:meth:`~kvtier.server.pool.mla.MLATokenToKVPool.latent_row_views`):
one copy of each byte in the daemon, the one a plain byte server makes too; other segments (a
device pool, scattered slots, the indexer's keys and scales) are gathered into host memory first.

The worker builds at most ``lead`` messages ahead of the sender (a bounded queue: no more memory
than that in flight, and that memory stays hot), so while the reader keeps up the lock is held
for the stream's duration. A reader that falls behind must not keep writers out: when the queue
stays full for ``patience_s``, or the lock has been held ``max_hold_s``, the worker copies every
byte not yet sent into one host block, releases the lock and builds the rest from that copy (the
same snapshot). A reader that goes away (the iterator is closed or dropped) stops the worker.

Lock order: the pool's shared lock only (taken by the worker; the queue is not a lock).
"""

from __future__ import annotations

import bisect
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.server.daemon.kv_ops import LATENT, KVSelection, Segment, plan_segments
from kvtier.server.daemon.errors import InvalidArgument
from kvtier.server.daemon.pools import PoolEntry, PoolRegistry
from kvtier.server.daemon.tenants import Caller

VIEW_MIN_RUN_ROWS = 16
"""Segments are read as views of the pool's rows when their slots' runs hold this many rows on
average (10 KB of 656-byte rows); shorter runs are gathered (a Python slice a run costs more)."""


@dataclass(frozen=True)
class Piece:
    """One message of a read: ``data`` is ``(segment index, start, end)`` byte ranges of segments.

    Per-segment form: ``layer_id``/``component`` name the segment and ``offset`` is the piece's
    byte in it. Packed form: ``component`` is ``""`` and ``offset`` is the byte in the whole stream.
    """

    layer_id: int
    component: str
    offset: int
    data: tuple[tuple[int, int, int], ...]


def plan_pieces(segments: Sequence[Segment], chunk: int, *, packed: bool) -> list[Piece]:
    """The messages of a read of ``segments`` with ``chunk`` data bytes a message: a sequence of
    messages a segment, or ``packed``: the segments back to back cut into full ``chunk``-byte
    messages (the last shorter) that run across segment boundaries (``ReadKVResponse`` in pool.proto)."""
    pieces: list[Piece] = []
    if not packed:
        for i, seg in enumerate(segments):
            for off in range(0, seg.nbytes, chunk):
                pieces.append(Piece(seg.layer_id, seg.component, off, ((i, off, min(off + chunk, seg.nbytes)),)))
        return pieces
    parts: list[tuple[int, int, int]] = []
    have = start = 0
    for i, seg in enumerate(segments):
        pos = 0
        while pos < seg.nbytes:
            take = min(chunk - have, seg.nbytes - pos)
            parts.append((i, pos, pos + take))
            have += take
            pos += take
            if have == chunk:
                pieces.append(Piece(0, "", start, tuple(parts)))
                start, parts, have = start + have, [], 0
    if have:
        pieces.append(Piece(0, "", start, tuple(parts)))
    return pieces


class _Source:
    """A segment's bytes as one or more uint8 views in order (views of the pool, or of a host copy)."""

    def __init__(self, views: list[torch.Tensor]) -> None:
        self.views = [memoryview(v.numpy()) for v in views]
        self.starts = [0]
        for v in self.views:
            self.starts.append(self.starts[-1] + len(v))

    def slice(self, start: int, end: int) -> list[memoryview]:
        """Views of bytes ``[start, end)`` of the segment."""
        out = []
        i = bisect.bisect_right(self.starts, start) - 1
        while start < end:
            v, base = self.views[i], self.starts[i]
            take = min(end, base + len(v)) - start
            out.append(v[start - base:start - base + take])
            start += take
            i += 1
        return out


def _sources(entry: PoolEntry, sel: KVSelection, slots: torch.Tensor, segs: list[Segment]) -> list[_Source]:
    """Each segment's bytes (the pool's lock is held by the caller): views of the pool's latent rows
    where possible, else gathered into host memory."""
    pool = entry.pool
    n = slots.numel()
    max_runs = max(1, n // VIEW_MIN_RUN_ROWS)
    views = {x: pool.latent_row_views(x, slots, max_runs) for x in sel.latent_layers}
    gather = [x for x in sel.latent_layers if views[x] is None]
    lat_bytes = n * pool.row_bytes
    flat = pool.host_block(lat_bytes * len(gather)) if gather else None
    for i, x in enumerate(gather):
        views[x] = [pool.get_kv_buffer_rows(x, slots, out=flat[i * lat_bytes:(i + 1) * lat_bytes]).view(torch.uint8).reshape(-1)]
    index: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    out = []
    for seg in segs:
        if seg.component == LATENT:
            out.append(_Source(views[seg.layer_id]))
            continue
        if seg.layer_id not in index:
            index[seg.layer_id] = pool.get_index_k_scale(seg.layer_id, slots)
        keys, scales = index[seg.layer_id]
        t = keys if seg.component == "index_k" else scales
        out.append(_Source([t.cpu().contiguous().view(torch.uint8).reshape(-1)]))
    return out


def _copy_rest(entry: PoolEntry, sources: list[_Source], pieces: list[Piece], nxt: int) -> list[_Source]:
    """``sources`` with every segment from the one piece ``nxt`` starts in onward copied into one host
    block (the lock is still held): the rest of the read no longer needs the pool."""
    if nxt >= len(pieces):
        return sources
    first = pieces[nxt].data[0][0]
    total = sum(s.starts[-1] for s in sources[first:])
    block = entry.pool.host_block(total)
    out, pos = list(sources[:first]), 0
    for src in sources[first:]:
        size = src.starts[-1]
        dst = block[pos:pos + size]
        done = 0
        for v in src.views:
            dst[done:done + len(v)].copy_(torch.frombuffer(v, dtype=torch.uint8) if len(v) else torch.empty(0, dtype=torch.uint8))
            done += len(v)
        out.append(_Source([dst]))
        pos += size
    return out


@dataclass
class StreamedRead:
    """A :func:`read_kv_messages` read: ``nbytes`` data bytes in all; iterate for each message's bytes."""

    nbytes: int
    messages: Iterator[bytes]

    def __iter__(self) -> Iterator[bytes]:
        return self.messages


def read_kv_messages(registry: PoolRegistry, caller: Caller, sel: KVSelection, chunk: int, *, packed: bool,
                     encode: Callable[[Piece, list[memoryview]], bytes], lead: int = 8, patience_s: float = 0.1,
                     max_hold_s: float = 1.0) -> StreamedRead:
    """Read ``sel`` as messages of ``chunk`` data bytes (:func:`plan_pieces`), each built by
    ``encode(piece, data views)`` (which must copy the views: they are valid only during the call).

    Args:
        lead: messages built ahead of the reader at most.
        patience_s, max_hold_s: a queue full for this long, or the shared lock held this long, and
            the rest is copied out and the lock released (see the module doc).

    Returns:
        :class:`StreamedRead`; every check has passed when it is returned.

    Raises:
        NotFound, InvalidArgument, FailedPrecondition: see :func:`~kvtier.server.daemon.kv_ops.plan_segments`
            and :meth:`PoolEntry.slots`, before returning.
    """
    q: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=max(1, lead))
    closed = threading.Event()

    def put(item: tuple[str, Any], timeout: float | None) -> bool:
        """False: the queue stayed full for ``timeout`` (None: wait until the reader takes it or goes away)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not closed.is_set():
            wait = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if wait <= 0:
                return False
            try:
                q.put(item, timeout=wait)
                return True
            except queue.Full:
                continue
        return True  # the reader went away: nothing more to deliver

    def work() -> None:
        lock = ExitStack()  # the pool's shared lock while it is held
        try:
            entry = lock.enter_context(registry.locked(caller, sel.pool_id, exclusive=False))
            since, holding = time.monotonic(), True
            slots = entry.slots(sel.slots)
            if slots.numel() == 0:
                raise InvalidArgument("a KV read needs at least one slot")
            segs = plan_segments(entry, sel, slots.numel())
            pieces = plan_pieces(segs, chunk, packed=packed)
            q.put(("planned", sum(s.nbytes for s in segs)))
            sources = _sources(entry, sel, slots, segs)
            for i, p in enumerate(pieces):
                if closed.is_set():
                    return
                msg = encode(p, [v for s, a, b in p.data for v in sources[s].slice(a, b)])
                if holding:
                    if put(("message", msg), min(patience_s, max(0.0, max_hold_s - (time.monotonic() - since)))):
                        continue
                    sources = _copy_rest(entry, sources, pieces, i + 1)  # the reader fell behind
                    lock.close()
                    holding = False
                put(("message", msg), None)
            lock.close()
            put(("done", None), None)
        except BaseException as e:  # noqa: BLE001 - handed to the reading thread
            lock.close()
            put(("error", e), None)
        finally:
            lock.close()

    threading.Thread(target=work, name="kvtier-readkv", daemon=True).start()
    kind, value = q.get()
    if kind == "error":
        raise value

    def messages() -> Iterator[bytes]:
        try:
            while True:
                kind, value = q.get()
                if kind == "message":
                    yield value
                elif kind == "done":
                    return
                else:
                    raise value
        finally:
            closed.set()

    return StreamedRead(value, messages())
