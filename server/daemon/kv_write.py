"""KV writes into a daemon pool (WriteKV): where a stream's bytes land as they arrive, and the commit.

Every write is all or nothing: a stream that breaks off, or a chunk that does not fit, leaves the
slots' old bytes. Streams are made of the segments of :func:`~kvtier.server.daemon.kv_ops.plan_segments`.

* A write into named slots (:func:`begin_write`, :func:`write_kv`) on a CPU pool **claims** their
  pages (:meth:`PoolEntry.claim`) and writes each latent chunk in place as it arrives, after copying
  the rows it replaces into an undo buffer; every other call that names those pages is refused
  UNAVAILABLE until the write ends, so nobody sees half a write. The commit writes the staged
  indexer part and ends the claim; on any failure :func:`abort_claimed` copies the old rows back.
  Slots on prefix-cache pages, slots in many runs, writes of indexer parts only and device pools
  are staged whole instead and written at commit, under the pool's exclusive lock.
* A write that allocates (:func:`reserve_write`, :func:`write_new_kv`) takes whole pages first,
  writes the latent rows straight into them (nobody can name pages that are not granted; no undo
  needed) and grants them at commit; on any failure :func:`abort_reserved` gives them back.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from kvtier.native import load
from kvtier.server.daemon.config import MIN_CHUNK_BYTES
from kvtier.server.daemon.errors import Cancelled, InvalidArgument, NotFound
from kvtier.server.daemon.kv_ops import INDEX_K, INDEX_SCALE, LATENT, KVSelection, plan_segments
from kvtier.server.daemon.locks import LockBusy
from kvtier.server.daemon.pools import PoolEntry, PoolRegistry
from kvtier.server.daemon.tenants import Caller

replace = load("kvtier._streamcopy").replace  # the native one pass, or its stand-in (kvtier.native)

MAX_CLAIM_RUNS = 16
"""A write into named slots is written in place only when its slots make at most this many runs of
consecutive slots (views of the pool a run and layer); more scattered slots are staged whole."""


class KVWriteBuffer:
    """Where the bytes of one WriteKV stream land as they arrive: host staging, written into the pool
    only at commit (:func:`write_kv`); or the latent rows straight into the pool: into pages the
    write allocated (:func:`reserve_write`), or into named slots whose pages it claims
    (:func:`begin_write`), the rows they replace copied to an undo buffer first.

    The staging is one block of the pool's host arena (faulted in once, reused by every stream;
    fresh memory when the arena is full) holding the staged segments back to back in stream order,
    so a packed stream (:meth:`add_packed`) and a per-segment one (:meth:`add`) land the same way.
    Written in place, each latent segment lands in its layer's rows of the reserved pages (one view
    of the pool a run of consecutive slots, :meth:`~kvtier.server.pool.MLATokenToKVPool.latent_row_views`):
    nobody else reads or writes those pages until the commit grants them, and a stream that breaks
    off gives them back, so its bytes there are never seen. Indexer keys and scales (about 5% of a
    GLM-5.2 stream) are always staged: the pool writes them in its page layout at commit.

    Args:
        entry: the target pool (read only here).
        sel: the stream's header; checked at once (layers, slots) so a bad header fails before any data.
        reserved: ``(n,)`` int64 slots of pages :meth:`PoolEntry.reserve` took for this stream (the
            header names no slots then); None: the header's slots, which must be allocated.
        claim: with named slots, write the latent rows in place (with an undo copy) when the pool
            allows it (a CPU pool, latent layers selected, no prefix-cache page, at most
            :data:`MAX_CLAIM_RUNS` runs); the
            caller then claims :attr:`pages` under the pool's exclusive lock before any data lands.

    Raises:
        InvalidArgument / FailedPrecondition / Busy: see :func:`plan_segments` and
            :meth:`PoolEntry.slots`.
    """

    def __init__(self, entry: PoolEntry, sel: KVSelection, reserved: torch.Tensor | None = None,
                 claim: bool = False) -> None:
        self.selection = sel
        self.entry = entry
        self.slots = entry.slots(sel.slots, unique=True) if reserved is None else reserved
        if self.slots.numel() == 0:
            raise InvalidArgument("a KV write needs at least one slot")
        n = self.slots.numel()
        self.segments = plan_segments(entry, sel, n)
        self.reserved = reserved is not None
        self.pages = torch.unique(self.slots // entry.page_size)
        """``(p,)`` int64 pages the slots lie on."""
        direct = None
        if self.reserved:
            direct = entry.pool.latent_row_views(sel.latent_layers, self.slots, n)
        elif claim and sel.latent_layers and not bool(entry.cache_owned[self.pages].any()):
            # (no latent layer: nothing lands in place, so nothing to claim; the indexer part is staged)
            direct = entry.pool.latent_row_views(sel.latent_layers, self.slots, MAX_CLAIM_RUNS)
        self.in_place = direct is not None
        """True when the latent rows land in the pool as they arrive (a CPU pool, reserved or claimed pages)."""
        self._restored = False  # restore() ran (rows back; the claim may still be held)
        self.claimed = self.in_place and not self.reserved
        """True for named slots written in place: their pages must be claimed, and the rows they
        replace are kept in the undo buffer (:meth:`restore`)."""
        self._starts: dict[tuple[int, str], int] = {}
        self._sizes = {(seg.layer_id, seg.component): seg.nbytes for seg in self.segments}
        total = staged = 0
        seg_starts, lands = [], []
        views = iter(direct or ())
        for seg in self.segments:
            self._starts[(seg.layer_id, seg.component)] = total
            seg_starts.append(total)
            if direct is not None and seg.component == LATENT:
                runs = [v.numpy() for v in next(views)]
                undo = staged if self.claimed else None  # the replaced rows, at the segment's own offsets
                lands.append((undo, list(itertools.accumulate((r.size for r in runs[:-1]), initial=0)), runs))
                staged += seg.nbytes if self.claimed else 0
            else:
                lands.append((staged, None, None))
                staged += seg.nbytes
            total += seg.nbytes
        self.nbytes = total
        """Data bytes the stream must carry."""
        self._seg_starts, self._lands = seg_starts, lands
        self._block = entry.pool.host_block(staged)
        self._buf = self._block.numpy()
        self._staged_at = {(seg.layer_id, seg.component): None if land[2] is not None else land[0]
                           for seg, land in zip(self.segments, lands)}
        self._filled = dict.fromkeys(self._starts, 0)
        self._packed_filled: int | None = None  # set once the stream is packed
        self._undo_end = [0] * len(self.segments)  # claimed: bytes of each segment whose old rows are in undo

    def _land(self, offset: int, data: bytes | memoryview) -> None:
        """Put ``data`` at byte ``offset`` of the whole stream (checked by the caller)."""
        if not self.in_place:  # everything staged, back to back in stream order: one copy
            self._buf[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
            return
        src = np.frombuffer(data, dtype=np.uint8)
        i = bisect.bisect_right(self._seg_starts, offset) - 1
        pos = 0
        while pos < src.size:
            seg_off = offset + pos - self._seg_starts[i]
            take = min(src.size - pos, self.segments[i].nbytes - seg_off)
            staged_at, run_starts, runs = self._lands[i]
            if runs is None:
                self._buf[staged_at + seg_off:staged_at + seg_off + take] = src[pos:pos + take]
            else:  # the layer's rows in the pool, a run of slots at a time (claimed: old rows to undo first)
                r, done = bisect.bisect_right(run_starts, seg_off) - 1, 0
                while done < take:
                    at = seg_off + done - run_starts[r]
                    k = min(take - done, runs[r].size - at)
                    if staged_at is not None:  # old rows to undo and new rows in, one pass (kvtier._streamcopy)
                        u = staged_at + seg_off + done
                        replace(runs[r][at:at + k], self._buf[u:u + k], src[pos + done:pos + done + k])
                        self._undo_end[i] = seg_off + done + k  # restore() covers them (replace never stops half way)
                    else:
                        runs[r][at:at + k] = src[pos + done:pos + done + k]
                    done += k
                    r += 1
            pos += take
            i += 1

    def add(self, layer_id: int, component: str, offset: int, data: bytes | memoryview) -> None:
        """Stage ``data`` at ``offset`` of segment (``layer_id``, ``component``).

        Raises:
            InvalidArgument: a segment not in the header, an offset other than the bytes received so
                far for it (gap, overlap or reordering), more bytes than the segment holds, a piece
                under :data:`MIN_CHUNK_BYTES` that does not end its segment, or a packed stream.
        """
        key = (layer_id, component)
        start = self._starts.get(key)
        if start is None:
            raise InvalidArgument(f"chunk for layer {layer_id} {component}, which the header did not select")
        if self._packed_filled is not None:
            raise InvalidArgument("a packed WriteKV stream carries offsets in the whole stream, not segment pieces")
        size = self._sizes[key]
        filled = self._filled[key]
        if offset != filled:
            raise InvalidArgument(f"chunk for layer {layer_id} {component} at offset {offset}; expected {filled}")
        end = offset + len(data)
        if end > size:
            raise InvalidArgument(f"layer {layer_id} {component} gets {end} bytes; it holds {size}")
        if len(data) < MIN_CHUNK_BYTES and end != size:
            raise InvalidArgument(f"chunk of {len(data)} bytes for layer {layer_id} {component}: pieces must hold at "
                                  f"least {MIN_CHUNK_BYTES} bytes unless they end their segment")
        self._land(start + offset, data)
        self._filled[key] = end

    def add_packed(self, offset: int, data: bytes | memoryview) -> None:
        """Stage ``data`` at byte ``offset`` of the whole stream (every segment back to back, in stream order).

        Raises:
            InvalidArgument: an offset other than the bytes received so far, more bytes than the
                stream holds, a piece under :data:`MIN_CHUNK_BYTES` that does not end the stream, or
                segment pieces received before.
        """
        if self._packed_filled is None:
            if any(self._filled.values()):
                raise InvalidArgument("a WriteKV stream is packed from its first data message or not at all")
            self._packed_filled = 0
        filled = self._packed_filled
        if offset != filled:
            raise InvalidArgument(f"packed chunk at offset {offset}; expected {filled}")
        end = offset + len(data)
        if end > self.nbytes:
            raise InvalidArgument(f"the packed stream gets {end} bytes; what the header selects holds {self.nbytes} "
                                  f"({len(self.segments)} segments of {self.slots.numel()} slots)")
        if len(data) < MIN_CHUNK_BYTES and end != self.nbytes:
            raise InvalidArgument(f"packed chunk of {len(data)} bytes: pieces must hold at least {MIN_CHUNK_BYTES} "
                                  f"bytes unless they end the stream")
        self._land(offset, data)
        self._packed_filled = end

    def check_complete(self) -> None:
        """Raise InvalidArgument naming the first segment that did not receive all its bytes."""
        if self._packed_filled is not None:
            if self._packed_filled != self.nbytes:
                raise InvalidArgument(f"the packed stream got {self._packed_filled} of {self.nbytes} bytes")
            return
        for seg in self.segments:
            got = self._filled[(seg.layer_id, seg.component)]
            if got != seg.nbytes:
                raise InvalidArgument(f"layer {seg.layer_id} {seg.component} got {got} of {seg.nbytes} bytes")

    def tensor(self, layer_id: int, component: str) -> torch.Tensor:
        """The staged bytes of a segment as a ``(nbytes,)`` uint8 tensor (shares memory); not for a
        latent segment written in place."""
        start = self._staged_at[(layer_id, component)]
        if start is None:
            raise ValueError(f"layer {layer_id} {component} was written in place, not staged")
        return self._block[start:start + self._sizes[(layer_id, component)]]

    def restore(self) -> None:
        """Copy back the rows a claimed write replaced (the bytes landed so far of each latent
        segment, from the undo buffer), once: a second call does nothing. The claim, not yet ended,
        keeps every other call off these rows, so this needs no pool lock (:func:`write_kv` restores
        before its caller's deadline when it cannot get the lock in time)."""
        if not self.claimed or self._restored:
            return
        self._restored = True
        for (undo, run_starts, runs), filled in zip(self._lands, self._undo_end):
            if runs is None:
                continue
            for r, run in enumerate(runs):
                lo, hi = run_starts[r], min(run_starts[r] + run.size, filled)
                if hi > lo:
                    run[:hi - lo] = self._buf[undo + lo:undo + hi]


def begin_write(registry: PoolRegistry, caller: Caller, sel: KVSelection) -> KVWriteBuffer:
    """Begin a WriteKV into the header's named slots: check the header and the slots (allocated, the
    caller's to overwrite, not claimed) under the pool's exclusive lock and, when the write goes in
    place (:attr:`KVWriteBuffer.claimed`), claim their pages there. End it with :func:`write_kv`, or
    :func:`abort_claimed` on any failure.

    Raises:
        InvalidArgument / FailedPrecondition: a bad header or slots (:class:`KVWriteBuffer`), slots of
            another worker's attach session. Busy (UNAVAILABLE, "changed nothing"): a page another
            write is writing.
            NotFound: unknown pool, or the caller's attach session ended. Nothing is claimed then.
    """
    with registry.locked(caller, sel.pool_id, exclusive=True) as entry:
        buf = KVWriteBuffer(entry, sel, claim=True)
        entry.check_writable(buf.pages, entry.owner_of(caller))
        if buf.claimed:
            entry.claim(buf.pages)
    return buf


def write_kv(registry: PoolRegistry, caller: Caller, buf: KVWriteBuffer,
             wanted: Callable[[], bool] = lambda: True, time_left: Callable[[], float | None] | None = None) -> int:
    """Commit a complete :class:`KVWriteBuffer` of :func:`begin_write` into its pool; returns the
    bytes written. The caller calls :func:`abort_claimed` when this raises.

    The slots are checked again under the pool's exclusive lock (the allocation may have changed
    while the stream arrived; claimed pages cannot change); all checks run before the first staged
    byte is written, the last of them ``wanted()`` (the call still active: a call cancelled, or
    past its deadline, while the commit waited for the lock writes nothing, as its client was told).
    A claimed write's latent rows are in the pool already; the commit writes the rest and ends the claim.

    Raises:
        InvalidArgument: incomplete stream, or slots no longer allocated. NotFound: pool deleted (or
            made again), or the caller's attach session ended. Cancelled: ``wanted()`` was false.
    """
    buf.check_complete()
    sel = buf.selection
    with _commit_lock(registry, caller, buf, wanted, time_left) as entry:
        _check_same_pool(entry, buf)
        slots = entry.slots(buf.slots, unique=True, claimed_ok=buf.claimed)
        entry.check_writable(buf.pages, entry.owner_of(caller))
        _check_wanted(wanted)
        entry.changed(buf.pages)
        _write_staged(entry, buf, slots)
        if buf.claimed:
            entry.unclaim(buf.pages)
            buf.claimed = False  # committed: nothing to restore
    return buf.nbytes


#: Seconds between two looks at the caller while a claimed write's commit waits for its pool.
COMMIT_POLL_S = 0.05


@contextmanager
def _commit_lock(registry: PoolRegistry, caller: Caller, buf: KVWriteBuffer, wanted: Callable[[], bool],
                 time_left: Callable[[], float | None] | None) -> Iterator[PoolEntry]:
    """The pool's exclusive lock for a commit. A claimed write (its rows already in place) waits in
    slices, looking at its caller: one that left, or whose deadline (``time_left()`` seconds) comes
    within a margin, gets its replaced rows back at once, without the lock (the claim keeps every
    other call off them), and Cancelled, before its client is told the call failed. Restored later,
    under the lock, the old rows went over what an attached worker wrote through its tensors once
    told the write had failed (attack pass 9, A9-2)."""
    if not buf.claimed:
        with registry.locked(caller, buf.selection.pool_id, exclusive=True) as entry:
            yield entry
        return
    entry = registry.get(caller, buf.selection.pool_id)
    while True:
        left = time_left() if time_left is not None else None
        margin = 0.0 if left is None else min(0.25, max(0.05, left / 10))
        if not wanted() or (left is not None and left <= margin):
            buf.restore()  # before the client hears of it: nothing of this write stays
            raise Cancelled("the WriteKV was cancelled or ran past its deadline before its commit; the rows it "
                            "replaced are back; nothing was written")
        wait = COMMIT_POLL_S if left is None else max(0.0, min(COMMIT_POLL_S, left - margin))
        try:
            with entry.lock.exclusive(timeout=wait):
                if entry.deleted:
                    raise NotFound(f"no pool {buf.selection.pool_id!r}")
                yield entry
                return
        except LockBusy:
            continue


def abort_claimed(registry: PoolRegistry, caller: Caller, buf: KVWriteBuffer) -> None:
    """End a write of :func:`begin_write` that failed or broke off: the rows it replaced are copied
    back from the undo buffer and its claim ends, under the pool's exclusive lock. Pages that the
    caller's attach session held when it ended (its end leaves claimed pages to the write) are freed
    then. Nothing for a staged write or a deleted pool. Never raises a daemon error."""
    if not buf.claimed:
        return
    entry = buf.entry
    with entry.lock.exclusive():
        if entry.deleted:
            return
        buf.restore()  # the old rows again: their content stamp stays (PoolEntry.claim_gen)
        entry.end_claim(buf.pages, caller)
        buf.claimed = False


def abort_write(registry: PoolRegistry, caller: Caller, buf: KVWriteBuffer) -> None:
    """End a write that failed or broke off, whichever kind: :func:`abort_reserved` for a write that
    allocates, :func:`abort_claimed` for one into named slots. Never raises a daemon error."""
    if buf.reserved:
        abort_reserved(registry, caller, buf.entry, buf.slots)
    else:
        abort_claimed(registry, caller, buf)


def _check_same_pool(entry: PoolEntry, buf: KVWriteBuffer) -> None:
    """Raise NotFound unless ``entry`` (the pool under the stream's id now) is the one the stream began on."""
    if entry is not buf.entry:
        raise NotFound(f"pool {entry.pool_id!r} was deleted and made again while the stream arrived; nothing was written")


def _check_wanted(wanted: Callable[[], bool]) -> None:
    """Raise Cancelled unless ``wanted()`` (the call is still active); the commit's pool lock is held."""
    if not wanted():
        raise Cancelled("the WriteKV was cancelled or ran past its deadline before its commit; nothing was written")


def _write_staged(entry: PoolEntry, buf: KVWriteBuffer, slots: torch.Tensor) -> None:
    """Write the staged segments of ``buf`` into ``slots`` (the pool's exclusive lock held)."""
    sel, n, pool = buf.selection, slots.numel(), entry.pool
    sw = pool.index_scale_bytes // 4
    # every tensor is made before the first byte is written (all or nothing); every segment
    # starts on a word (a daemon pool's rows are whole 8-byte words: PoolRegistry.create)
    rows = [] if buf.in_place else [buf.tensor(x, LATENT).view(n, pool.row_bytes) for x in sel.latent_layers]
    keys = [buf.tensor(x, INDEX_K).view(n, pool.index_head_dim) for x in sel.index_layers]
    scales = [buf.tensor(x, INDEX_SCALE).view(torch.float32).view(n, sw) for x in sel.index_layers]
    if rows:
        pool.set_kv_buffer_layers(sel.latent_layers, slots, rows)
    if sel.index_layers:
        pool.set_index_k_scale_layers(sel.index_layers, slots, keys, scales)


def reserve_write(registry: PoolRegistry, caller: Caller, sel: KVSelection, num_tokens: int) -> KVWriteBuffer:
    """Begin a WriteKV that allocates: check the header (``sel.slots`` empty), take whole pages for
    ``num_tokens`` (:meth:`PoolEntry.reserve`, under the pool's exclusive lock) and return the
    buffer that writes the stream into them. End it with :func:`write_new_kv`, or
    :func:`abort_reserved` on any failure.

    Raises:
        InvalidArgument: slots named as well, ``num_tokens`` not positive, a bad header
            (:func:`plan_segments`). ResourceExhausted: too few free pages. NotFound: unknown pool,
            or the caller's attach session ended. Nothing is taken then.
    """
    if len(sel.slots):
        raise InvalidArgument("a WriteKV names its slots in the header or asks for allocate_tokens, not both")
    if num_tokens <= 0:
        raise InvalidArgument(f"allocate_tokens must be positive, got {num_tokens}")
    with registry.locked(caller, sel.pool_id, exclusive=True) as entry:
        plan_segments(entry, sel, num_tokens)  # the header checked before any page is taken
        entry.owner_of(caller)  # a session that ended takes nothing
        slots = entry.reserve(num_tokens)
    try:
        return KVWriteBuffer(entry, sel, reserved=slots)
    except BaseException:
        abort_reserved(registry, caller, entry, slots)
        raise


def write_new_kv(registry: PoolRegistry, caller: Caller, buf: KVWriteBuffer,
                 wanted: Callable[[], bool] = lambda: True) -> tuple[torch.Tensor, int]:
    """Commit a complete :class:`KVWriteBuffer` of :func:`reserve_write`: the staged segments
    written, then the reserved pages granted to the caller (its attach session's, if any) in one
    exclusive section, once ``wanted()`` says the call is still active (pages granted to a call
    that was cancelled, or ran past its deadline, while the commit waited for the lock would be
    allocated to no one who knows of them). Returns ``(slots (n,) int64, bytes written)``.

    Raises:
        InvalidArgument: incomplete stream. NotFound: the pool was deleted (or re-created) while
            the stream arrived, or the caller's attach session ended. Cancelled: ``wanted()`` was
            false. The caller then calls :func:`abort_reserved`.
    """
    buf.check_complete()
    with registry.locked(caller, buf.selection.pool_id, exclusive=True) as entry:
        _check_same_pool(entry, buf)
        owner = entry.owner_of(caller)
        _check_wanted(wanted)
        _write_staged(entry, buf, buf.slots)
        entry.grant(buf.slots, owner)
        entry.changed(torch.unique(buf.slots // entry.page_size))  # written, not just allocated (A10-5)
    return buf.slots, buf.nbytes


def abort_reserved(registry: PoolRegistry, caller: Caller, entry: PoolEntry, slots: torch.Tensor) -> None:
    """Give back the pages :func:`reserve_write` took for ``slots`` of ``entry`` (a stream that broke
    off or failed a check); nothing when the pool is gone. Never raises a daemon error."""
    try:
        with registry.locked(caller, entry.pool_id, exclusive=True) as current:
            if current is entry:
                entry.unreserve(slots)
    except NotFound:
        pass  # deleted: its pages went with it
