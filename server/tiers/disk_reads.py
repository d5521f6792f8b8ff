"""The disk tier's read path, at the cost of a plain file read: each record is copied once out of
LMDB's map into a buffer (inside the read transaction, the py-lmdb way) and checked there while its
bytes are still in the CPU's cache (BENCHMARKS.md, fix 6: a page record costs ~30 us to read;
bookkeeping of ~40 us a record made restores 0.3-0.5x a plain read, and hashing a record the kernel
had copied with ``preadv`` read it back from memory). The copy and the checks of a whole window of
records are one native call (fix 11: ~20 Python operations a record, each made dearer by the cache
the copy evicts, cost ~15 us of a ~45 us record).

* :func:`copy_records`: copy a window of records out of LMDB's views and check each (the native
  helper ``_recordio``, built from ``_recordio.c`` by ``pip install``; where it could not be built,
  its pure-Python stand-in ``recordio_py``, same results, slower: :mod:`kvtier.native`);
* :func:`writable_bytes`: a caller's tensor as a buffer to copy into, without numpy;
* :class:`ReadChunks`: buffers for records a caller borrows, carved as a stack out of chunks of the
  tier's read arena: the next record lands where the last dropped one was (still in the cache);
  each record is a tensor view that keeps its chunk alive, and a chunk goes back to the arena when
  the tier has moved on and every view of it is gone (one arena block a chunk, not one a record).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from sys import getrefcount

import numpy as np
import torch

from kvtier.server.hostmem import HostArena
from kvtier.native import load

_recordio = load("kvtier.server.tiers._recordio")

from_numpy = torch.from_numpy

#: :func:`copy_records`' code for a window slot without a record (the key was absent).
ABSENT = _recordio.NONE_SOURCE
#: The code of a record too short for its header (a zero-length value among them).
SHORT = _recordio.ERR_SHORT

_DAMAGE = {
    _recordio.ERR_SHORT: "the record is shorter than its 56-byte header",
    _recordio.ERR_MAGIC: "bad record magic",
    _recordio.ERR_VERSION: "record format version is not the supported one",
    _recordio.ERR_LENGTH: "the record's length differs from what its header accounts for",
    _recordio.ERR_SRC_LOC: "record src_loc bytes differ from 8 per token",
    _recordio.ERR_CHECKSUM: "record checksum (xxh3_64) mismatch: the record is damaged",
}


def copy_records(views: list, dsts: list, verify: bool) -> list[int]:
    """Copy each record of ``views`` into the buffer of ``dsts`` at the same index and, with
    ``verify``, check it as :func:`~kvtier.server.tiers.record.verify_record` does (magic, version,
    lengths, src_loc bytes, xxh3_64 with the checksum field read as zeros), in one native call with
    the GIL released (each record hashed right after its copy, while it is in L2).

    Args:
        views: C-contiguous byte buffers (LMDB's ``buffers=True`` values; valid for the call) or None.
        dsts: writable C-contiguous byte buffers, at least as long as their views (None where the
            view is None).
        verify: check each record; False: copy only.

    Returns:
        One int per record: ``>= 0`` a good record (its ``n_tokens``; 0 without ``verify``),
        :data:`ABSENT` for a None view, any other negative value a failed check
        (:func:`damage_reason` names it; the buffer then holds bytes not to be handed out).

    Raises:
        ValueError: a destination smaller than its record, or lists of different lengths (before
            anything is copied).
    """
    return _recordio.copy_check(views, dsts, verify)


def damage_reason(code: int) -> str:
    """What a negative :func:`copy_records` code (other than :data:`ABSENT`) says failed."""
    return _DAMAGE.get(code, f"record check failed (code {code})")

#: Records borrowed from one chunk start at multiples of this (payload views stay int64-aligned).
RECORD_ALIGN = 4096


#: Writable views of callers' buffers by (address, bytes): a reused buffer's view is made once.
_VIEWS: dict[tuple[int, int], memoryview] = {}
_VIEWS_MAX = 256


def writable_bytes(t: torch.Tensor, nbytes: int) -> memoryview:
    """The first ``nbytes`` of a contiguous uint8 host tensor as a writable ``B`` memoryview (a ctypes
    array over its memory: no copy, about 0.8 us against 3 us for ``memoryview(t.numpy())``; valid
    while ``t`` is alive). The view of an (address, size) is kept and handed out again: a caller
    that reads into one reused buffer pays for it once (a view is only ever used for the tensor
    that lives at its address now, whose bytes it covers)."""
    key = (t.data_ptr(), nbytes)
    mv = _VIEWS.get(key)
    if mv is None:
        if len(_VIEWS) >= _VIEWS_MAX:
            _VIEWS.clear()
        mv = _VIEWS[key] = memoryview((ctypes.c_char * nbytes).from_address(key[0])).cast("B")
    return mv


#: ``sys.getrefcount`` of a record's array held by nothing but its chunk's stack entry (the entry,
#: and the call's own argument): no tensor or view of the record is left.
_ONLY_STACK = 2


class _Chunk:
    """One arena block carved as a stack: records are bumped off ``top`` and ``top`` falls back as
    the records on top of it are dropped."""

    __slots__ = ("arr", "mv", "top", "stack")

    def __init__(self, arr: np.ndarray) -> None:
        self.arr, self.mv = arr, memoryview(arr)
        self.top = 0
        # (offset, the record's array) in the order handed out; the record's tensor (and every view
        # of it) holds that array, so the array's reference count says whether the record is alive
        self.stack: list[tuple[int, np.ndarray]] = []

    def pop_dropped(self) -> None:
        """Let ``top`` fall back past the records on top of the stack that nothing holds any more."""
        stack = self.stack
        while stack and sys.getrefcount(stack[-1][1]) <= _ONLY_STACK:
            self.top = stack.pop()[0]


class ReadChunks:
    """Host buffers for borrowed records, carved out of read-arena chunks as a stack.

    A record is a view of the current chunk at its top; when the records on top are dropped the top
    falls back, so the next record lands where the last one was: one record a call reuses one
    buffer, still in the CPU's cache, as a plain read into a reused buffer does (copies into a
    buffer cycling over 1 MiB ran 0.89x of copies into one reused buffer, over 4 MiB 0.75x), and a
    window of records reuses one window's bytes. A chunk that fills up is left to the records in it
    (it goes back to the arena when they are all dropped) and a new one is taken.

    A record counts as dropped when the chunk's stack holds the only reference to its numpy array
    (``torch.from_numpy`` keeps the array referenced for as long as the tensor's storage lives, so
    any tensor view or ``.numpy()`` of the record keeps it held): no weak references, callbacks or
    drop queue (those cost ~2 us a record; BENCHMARKS.md, fix 11).

    Args:
        arena: the tier's read arena (faulted in once); None: every buffer is fresh memory.
        chunk_bytes: bytes of a chunk (at most the arena's capacity); a record larger than a chunk
            gets an arena block of its own (or fresh memory when the arena has no room).

    Thread safety: one leaf lock around the bookkeeping (nothing is taken or called while it is
    held; a new chunk is allocated outside it). A record dropped in another thread while a take
    looks is seen then or at the next take (reference counts are read under the GIL).
    """

    def __init__(self, arena: HostArena | None, chunk_bytes: int = 8 << 20) -> None:
        self.arena = arena
        self.chunk_bytes = max(RECORD_ALIGN, min(chunk_bytes, arena.capacity if arena is not None else chunk_bytes))
        self._lock = threading.Lock()
        self._chunk: _Chunk | None = None

    def take(self, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        """A ``(nbytes,)`` uint8 host tensor and a writable memoryview of the same bytes (to fill).
        The tensor (and every view of it) keeps its chunk alive; dropping it frees its place."""
        size = -(-nbytes // RECORD_ALIGN) * RECORD_ALIGN
        if size <= self.chunk_bytes:
            for _ in range(2):
                with self._lock:
                    c = self._chunk
                    if c is not None:
                        c.pop_dropped()
                        off = c.top
                        if off + size <= c.arr.size:
                            c.top = off + size
                            arr = c.arr[off:off + nbytes]
                            c.stack.append((off, arr))
                            return torch.from_numpy(arr), c.mv[off:off + nbytes]
                    self._chunk = None  # full: it goes back once its records are gone
                    del c
                chunk = self._new_block(self.chunk_bytes)
                if chunk is None:
                    break
                with self._lock:
                    if self._chunk is None:
                        self._chunk = _Chunk(chunk)
                del chunk
        arr = self._new_block(nbytes)
        if arr is None:
            if self.arena is not None:
                self.arena.count_fallback()
            arr = np.empty(nbytes, dtype=np.uint8)
        return torch.from_numpy(arr), memoryview(arr)

    def take_many(self, sizes: list[int]) -> tuple[list[torch.Tensor | None], list[memoryview | None]]:
        """:meth:`take` of each size of a window in one lock section (None for a size of 0): the
        records lie back to back in the current chunk, in order; from the first that does not fit
        on, each is a :meth:`take` of its own (a new chunk). (The data path of every disk read:
        written out flat, ~1 us a record of Python around ``torch.from_numpy``.)"""
        k = len(sizes)
        tensors: list[torch.Tensor | None] = [None] * k
        mvs: list[memoryview | None] = [None] * k
        i = 0
        with self._lock:
            c = self._chunk
            if c is not None:
                stack = c.stack
                top = c.top
                while stack and getrefcount(stack[-1][1]) <= _ONLY_STACK:  # Chunk.pop_dropped, inline
                    top = stack.pop()[0]
                cap, push, arr_all, mv_all = c.arr.size, stack.append, c.arr, c.mv
                for i, n in enumerate(sizes):
                    if n:
                        end = top + ((n + RECORD_ALIGN - 1) & -RECORD_ALIGN)
                        if end > cap:
                            break
                        arr = arr_all[top:top + n]
                        push((top, arr))
                        tensors[i], mvs[i] = from_numpy(arr), mv_all[top:top + n]
                        top = end
                else:
                    c.top = top
                    return tensors, mvs
                c.top = top
        for j in range(i, k):
            if sizes[j] and tensors[j] is None:
                tensors[j], mvs[j] = self.take(sizes[j])
        return tensors, mvs

    def _new_block(self, nbytes: int) -> np.ndarray | None:
        block = self.arena.alloc(nbytes) if self.arena is not None else None
        return None if block is None else block.tensor.numpy()

    def release(self) -> None:
        """Forget the current chunk (it goes back to the arena once its records are dropped)."""
        with self._lock:
            self._chunk = None
