"""A KV read as a stream of messages built straight from the pool's memory (ReadKV).

A read is a consistent snapshot: its bytes are those of one moment, taken under the pool's shared
lock. Each message is built on the thread that sends it, just before it is sent: where a segment's
slots make runs of consecutive slots (whole pages do) on a CPU pool, its bytes are joined straight
from views of the pool's rows (:meth:`~kvtier.server.pool.mla.MLATokenToKVPool.latent_row_views`):
one copy of each byte in the daemon, the one a plain byte server makes too; other segments (a
device pool, scattered slots) are gathered into host memory first, and the indexer's keys and
scales when the stream reaches them (:class:`_Sources`).
No other thread and no queue stand between the pool and gRPC (a worker thread handing messages over
a queue cost ~25 ms of CPU a 221 MB read: BENCHMARKS.md, fix 16).

While the reader keeps up, the lock is held for the stream's duration. A reader that falls behind
must not keep writers out: when the sending thread has been away in gRPC's send for ``patience_s``
(the reader stopped reading and flow control holds the send), or the lock has been held
``max_hold_s``, every byte not yet sent is copied into one host block, the lock is released and the
rest is built from that copy (the same snapshot). The sender itself does this between messages; for
a sender stuck in a send, the *hold watch* (one daemon thread, ``kvtier-readkv-watch``, awake only
while reads hold a lock) does it. A reader that goes away (the iterator is closed or dropped)
releases the lock at once.

Lock order: the pool's shared lock (level 2), then the read's own mutex (held to build a message or
to copy the rest out; under it only the host arena's allocation and the release of the pool's shared
lock), then the hold watch's registry lock (a leaf).
"""

from __future__ import annotations

import bisect
import threading
import time
import weakref
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


class _Sources:
    """Each segment's bytes (the pool's lock is held while any is read from the pool).

    The latent rows are found when the read starts: views of the pool's rows where possible (no
    copy), else gathered into one host block. The indexer's keys and scales are gathered into one
    host block when the read first reaches them (they follow every latent layer in the stream), so
    the first message does not wait for that gather (~3 ms of a GLM-5.2 4,096-token read here:
    BENCHMARKS.md, fix 22). Index a :class:`_Sources` with a segment's number for its :class:`_Source`.
    """

    def __init__(self, entry: PoolEntry, sel: KVSelection, slots: torch.Tensor, segs: list[Segment]) -> None:
        self.entry, self.sel, self.slots = entry, sel, slots
        self.segs = segs
        pool = entry.pool
        n = slots.numel()
        lat = list(sel.latent_layers)
        found = pool.latent_row_views(lat, slots, max(1, n // VIEW_MIN_RUN_ROWS)) if lat else []
        if found is not None:
            views = dict(zip(lat, found))
        else:
            lat_bytes = n * pool.row_bytes
            flat = pool.host_block(lat_bytes * len(lat))
            views = {x: [pool.get_kv_buffer_rows(x, slots, out=flat[i * lat_bytes:(i + 1) * lat_bytes]).view(torch.uint8).reshape(-1)]
                     for i, x in enumerate(lat)}
        self.items: list[_Source | None] = [_Source(views[seg.layer_id]) if seg.component == LATENT else None for seg in segs]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> _Source:
        src = self.items[i]
        if src is None:
            self._gather_index()
            src = self.items[i]
            assert src is not None
        return src

    def _gather_index(self) -> None:
        """Gather every selected live layer's keys and scales into one host block (the lock is held).

        Raises:
            MemoryError: no host memory for the block (the read ends with RESOURCE_EXHAUSTED).
        """
        layers = list(self.sel.index_layers)
        index = dict(zip(layers, self.entry.pool.get_index_k_scale_layers(layers, self.slots)))
        for i, seg in enumerate(self.segs):
            if self.items[i] is None:
                keys, scales = index[seg.layer_id]
                t = keys if seg.component == "index_k" else scales
                self.items[i] = _Source([t.cpu().contiguous().view(torch.uint8).reshape(-1)])

    def copy_out(self, first: int) -> None:
        """Copy segments ``first`` onward into one host block (the lock is still held; the indexer's
        gathered now if the read has not reached it), so the rest of the read no longer needs the pool.

        Raises:
            MemoryError: no host memory for the block (or the gather); nothing is replaced.
        """
        rest = [self[i] for i in range(first, len(self.items))]
        block = self.entry.pool.host_block(sum(src.starts[-1] for src in rest))
        pos = 0
        for i, src in enumerate(rest, start=first):
            size = src.starts[-1]
            dst = block[pos:pos + size]
            done = 0
            for v in src.views:
                dst[done:done + len(v)].copy_(torch.frombuffer(v, dtype=torch.uint8) if len(v) else torch.empty(0, dtype=torch.uint8))
                done += len(v)
            self.items[i] = _Source([dst])
            pos += size


@dataclass
class StreamedRead:
    """A :func:`read_kv_messages` read: ``nbytes`` data bytes in all; iterate for each message's bytes."""

    nbytes: int
    messages: Iterator[bytes]

    def __iter__(self) -> Iterator[bytes]:
        return self.messages


class _Snapshot:
    """One read's pieces and where their bytes are: the pool (under its shared lock) or, once the rest
    was copied out, one host block. Shared by the sending thread and the hold watch (``mutex``)."""

    def __init__(self, entry: PoolEntry, lock: ExitStack, sources: _Sources, pieces: list[Piece],
                 encode: Callable[[Piece, list[memoryview]], bytes], patience_s: float, max_hold_s: float) -> None:
        self.mutex = threading.RLock()  # re-entrant: a dropped read closed by the GC on the thread that holds it
        self.entry, self.lock, self.sources, self.pieces, self.encode = entry, lock, sources, pieces, encode
        self.patience_s, self.max_hold_s = patience_s, max_hold_s
        self.since = time.monotonic()  # when the lock was taken
        self.holding = True
        self.next = 0  # the next piece to build
        self.away_since = self.since  # the sender is away (in gRPC's send, or not started) since
        self.error: BaseException | None = None  # the hold watch's copy-out failed: the sender raises it

    def build(self, i: int) -> bytes:
        """Piece ``i``'s message (the sender, in order).

        Raises:
            MemoryError: the indexer's gather, or the copy-out (here or by the hold watch), could
                not get host memory; the lock is released and the read ends (RESOURCE_EXHAUSTED at
                the client, after the messages already sent).
        """
        with self.mutex:
            if self.error is not None:
                raise self.error
            p = self.pieces[i]
            msg = self.encode(p, [v for s, a, b in p.data for v in self.sources[s].slice(a, b)])
            self.next = i + 1
            now = time.monotonic()
            if self.holding and now - self.since >= self.max_hold_s:
                self._release_rest()
            self.away_since = now
        return msg

    def check(self, now: float) -> None:
        """The hold watch: copy the rest out and release the lock if the sender has been away too
        long, or the lock held too long."""
        if not self.holding:
            return
        with self.mutex:
            if self.holding and (now - self.away_since >= self.patience_s or now - self.since >= self.max_hold_s):
                try:
                    self._release_rest()
                except BaseException as e:  # noqa: BLE001 - no memory for the copy: the read ends, the lock goes
                    self.error = e
                    self.close()

    def _release_rest(self) -> None:  # mutex held
        if self.next < len(self.pieces):  # the segment the next piece starts in, onward
            self.sources.copy_out(self.pieces[self.next].data[0][0])
        self.holding = False
        self.lock.close()

    def close(self) -> None:
        """Release the lock if it is still held (the read ended, failed or was dropped)."""
        with self.mutex:
            self.holding = False
            self.lock.close()


class _HoldWatch:
    """The daemon's one thread that releases the locks of reads whose sender is stuck in a send."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())  # leaf: a set update or a copy of it
        self._reads: weakref.WeakSet[_Snapshot] = weakref.WeakSet()
        self._thread: threading.Thread | None = None

    def add(self, snap: _Snapshot) -> None:
        start = None
        with self._cond:
            self._reads.add(snap)
            if self._thread is None:
                start = self._thread = threading.Thread(target=self._run, name="kvtier-readkv-watch", daemon=True)
            self._cond.notify()
        if start is not None:  # started outside the leaf lock (it takes that lock itself)
            start.start()

    def remove(self, snap: _Snapshot) -> None:
        with self._cond:
            self._reads.discard(snap)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._reads:
                    self._cond.wait()
                tick = min(0.05, max(0.005, min(r.patience_s for r in self._reads) / 2))
                self._cond.wait(tick)
            self._check_all(time.monotonic())

    def _check_all(self, now: float) -> None:
        """One tick: check every read. Its own frame, so that no reference to a read (a snapshot
        keeps its pool entry and its host copy alive) outlives the tick while the watch waits."""
        with self._cond:
            reads = list(self._reads)
        for r in reads:
            if not r.holding:
                self.remove(r)
                continue
            r.check(now)


_watch = _HoldWatch()


def read_kv_messages(registry: PoolRegistry, caller: Caller, sel: KVSelection, chunk: int, *, packed: bool,
                     encode: Callable[[Piece, list[memoryview]], bytes], patience_s: float = 0.1,
                     max_hold_s: float = 1.0) -> StreamedRead:
    """Read ``sel`` as messages of ``chunk`` data bytes (:func:`plan_pieces`), each built by
    ``encode(piece, data views)`` (which must copy the views: they are valid only during the call)
    on the thread that iterates, just before it is yielded.

    Args:
        patience_s, max_hold_s: a sender away in a send this long, or the shared lock held this long,
            and the rest is copied out and the lock released (see the module doc).

    Returns:
        :class:`StreamedRead`; every check has passed and the snapshot is taken when it is returned.

    Raises:
        NotFound, InvalidArgument, FailedPrecondition: see :func:`~kvtier.server.daemon.kv_ops.plan_segments`
            and :meth:`PoolEntry.slots`, before returning.
    """
    lock = ExitStack()  # the pool's shared lock while it is held
    try:
        entry = lock.enter_context(registry.locked(caller, sel.pool_id, exclusive=False))
        slots = entry.slots(sel.slots)
        if slots.numel() == 0:
            raise InvalidArgument("a KV read needs at least one slot")
        segs = plan_segments(entry, sel, slots.numel())
        pieces = plan_pieces(segs, chunk, packed=packed)
        snap = _Snapshot(entry, lock, _Sources(entry, sel, slots, segs), pieces, encode, patience_s, max_hold_s)
    except BaseException:
        lock.close()
        raise
    _watch.add(snap)

    def messages() -> Iterator[bytes]:
        try:
            for i in range(len(pieces)):
                yield snap.build(i)
        finally:
            snap.close()
            _watch.remove(snap)

    return StreamedRead(sum(s.nbytes for s in segs), messages())
