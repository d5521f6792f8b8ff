"""The host arena: host memory mapped and faulted in once, carved into blocks by a page allocator.

Why: a fresh 221 MB host tensor is page-faulted on every use (1-2 GB/s whatever the copy does;
DESIGN.md, measured), and faulting a page in costs about as much as copying it several times. The
arena maps its memory once, faults every page in once (``MADV_POPULATE_WRITE``, or a write per page
on kernels without it), and never gives pages back to the kernel: a block freed and handed out again
is already there.

Memory: anonymous shared memory from :class:`kvtier.memfd.SharedMemory` (a sealed memfd,
``MAP_SHARED``; the same primitive the pools' arenas use), nothing named in ``/dev/shm``, so nothing is
left behind even after ``kill -9``. :attr:`HostArena.fd` and :attr:`HostBlock.offset` could be passed
to another process over a unix socket (``SCM_RIGHTS``) to map the same bytes -- but the host arena holds
every tenant's records, so local attach never passes it (it passes a pool's own arenas, and per-session
staging buffers). On a CUDA machine (``pin=None``: when CUDA is available) the whole mapping is
page-locked once with ``cudaHostRegister`` (through ``torch.cuda.cudart()``), so copies to and from
the device are real DMA and ``tensor.is_pinned()`` is true for every block.
:meth:`HostArena.registration_range` is the one contiguous range a transfer engine registers.

Blocks: :meth:`HostArena.alloc` returns a :class:`HostBlock` whose ``tensor`` is a ``(nbytes,)``
uint8 view of its pages. **A block is freed when its tensor and every view of it are gone** (a
finalizer on the numpy array the tensor wraps; CPython frees at once when the last reference
drops, a reference cycle waits for the garbage collector). There is no explicit free: nothing can
use a block after it was given back. When no free run is long enough, ``alloc`` returns None and
the caller falls back to ordinary memory (counted in :attr:`ArenaStats.fallbacks` by the callers
that do).

Fork: the memory is shared with a forked child. An arena used in a process other than the one that
made it hands out nothing (``alloc`` returns None, so callers fall back to private memory).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.memfd import SharedMemory
from kvtier.server.hostmem.cuda import cuda_host_register, cuda_host_unregister
from kvtier.server.hostmem.extents import ExtentAllocator

log = logging.getLogger(__name__)

PAGE_BYTES = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_PREFAULT_CHUNK = 64 << 20


@dataclass(frozen=True)
class ArenaStats:
    """Bytes of an arena (``used``/``free`` in whole pages), its largest free run, blocks live now,
    blocks handed out and requests refused so far, callers' fallbacks to ordinary memory, and how
    much of it is faulted in / page-locked."""

    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    largest_free_bytes: int
    live_blocks: int
    allocs: int
    failed_allocs: int
    fallbacks: int
    prefaulted_bytes: int
    pinned: bool


class HostBlock:
    """Pages ``[offset, offset + nbytes)`` of an arena, as a tensor; freed when the tensor is gone.

    Attributes:
        tensor: ``(nbytes,)`` uint8 host tensor over the block (the only handle that keeps it).
        offset: byte offset in the arena (and in its memfd).
        nbytes: bytes asked for (the block holds whole pages: ``nbytes`` rounded up).
    """

    __slots__ = ("tensor", "offset", "nbytes")

    def __init__(self, tensor: torch.Tensor, offset: int, nbytes: int) -> None:
        self.tensor = tensor
        self.offset = offset
        self.nbytes = nbytes


class HostArena:
    """One mapping of anonymous shared host memory, faulted in once, carved into page runs.

    Args:
        nbytes: capacity (rounded up to whole pages).
        page_bytes: allocation granule (default the OS page, 4 KiB); blocks hold whole granules.
        pin: page-lock the mapping for CUDA (``cudaHostRegister``); None: when CUDA is available.
        prefault: fault every page in now (``True``), in a background thread at the lowest CPU
            priority (``"background"``; a block used before it gets there faults on first touch, as
            plain memory would), or not at all (``False``: each page faults on first use, once).
        prefault_limit: fault in at most this many bytes (the lowest addresses, where best fit puts
            blocks first); the rest faults on first use, once. None: all of it.
        name: the memfd's name (shown in ``/proc/PID/maps`` as ``/memfd:NAME``).

    Raises:
        ValueError: ``nbytes`` < 1 or ``page_bytes`` not a multiple of the OS page.
        OSError: the kernel refused the memory.
        RuntimeError: ``cudaHostRegister`` failed.
    """

    def __init__(self, nbytes: int, *, page_bytes: int = PAGE_BYTES, pin: bool | None = None,
                 prefault: bool | str = True, prefault_limit: int | None = None,
                 name: str = "kvtier-host-arena") -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise ValueError(f"a host arena needs at least one byte, got {nbytes!r}")
        if page_bytes < PAGE_BYTES or page_bytes % PAGE_BYTES:
            raise ValueError(f"page_bytes must be a multiple of the OS page ({PAGE_BYTES}), got {page_bytes}")
        if prefault not in (True, False, "background"):
            raise ValueError(f"prefault must be True, False or 'background', got {prefault!r}")
        self.page_bytes = page_bytes
        pages = -(-nbytes // page_bytes)
        self.capacity = pages * page_bytes
        self._pid = os.getpid()
        shm = SharedMemory.create(self.capacity, name)
        self._mem = _Memory(shm)
        self.base_ptr = shm.address
        self._extents = ExtentAllocator(pages)
        self._prefault_end = self.capacity if prefault_limit is None else min(self.capacity, max(0, int(prefault_limit)))
        self._fallbacks = 0
        self._stop = threading.Event()
        self.pinned = torch.cuda.is_available() if pin is None else bool(pin)
        if prefault is True:
            _prefault(self._mem, self._prefault_end, self._stop, background=False)
        if self.pinned:
            cuda_host_register(self.base_ptr, self.capacity)
        self._mem.pinned_ptr = self.base_ptr if self.pinned else 0
        self._finalizer = weakref.finalize(self, _close_memory, self._mem, self._stop, self._extents)
        if prefault == "background":  # the thread holds the memory, not the arena: a dropped arena stops it
            threading.Thread(target=_prefault, args=(self._mem, self._prefault_end, self._stop), kwargs={"background": True},
                             name=f"{name}-prefault", daemon=True).start()

    @property
    def fd(self) -> int:
        """The memfd behind the arena (``-1`` once closed)."""
        return self._mem.shm.fd

    # ----- blocks -----------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> HostBlock | None:
        """A block of ``nbytes`` (whole pages, uninitialised), or None when no free run holds it (or in
        a forked child). Freed when its tensor and all views of it are gone.

        Raises:
            ValueError: ``nbytes`` < 0.
        """
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        array = self._mem.array
        if os.getpid() != self._pid or array is None:
            return None
        pages = max(1, -(-nbytes // self.page_bytes))
        start = self._extents.alloc(pages)
        if start is None:
            return None
        offset = start * self.page_bytes
        arr = array[offset:offset + nbytes]  # a new ndarray object: the block's own handle
        weakref.finalize(arr, self._extents.free_later, start, pages)
        return HostBlock(torch.from_numpy(arr), offset, nbytes)

    def alloc_tensor(self, nbytes: int) -> torch.Tensor | None:
        """:meth:`alloc`'s tensor (None when it returns None)."""
        block = self.alloc(nbytes)
        return None if block is None else block.tensor

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes lie inside this arena."""
        if t.device.type != "cpu":
            return False
        p = t.data_ptr()
        return self.base_ptr <= p and p + t.numel() * t.element_size() <= self.base_ptr + self.capacity

    def offset_of(self, t: torch.Tensor) -> int:
        """Byte offset of ``t``'s first byte in the arena (and its memfd).

        Raises:
            ValueError: ``t`` does not lie in this arena.
        """
        if not self.owns(t):
            raise ValueError("the tensor does not lie in this host arena")
        return t.data_ptr() - self.base_ptr

    def count_fallback(self, n: int = 1) -> None:
        """A caller used ordinary memory because :meth:`alloc` returned None (counted in stats)."""
        self._fallbacks += n  # a plain int: monitoring reads it without a lock

    def registration_range(self) -> tuple[int, int]:
        """``(ptr, nbytes)``: the whole arena, to register once with a transfer engine."""
        return self.base_ptr, self.capacity

    def stats(self) -> ArenaStats:
        """A snapshot (frees of blocks already dropped are applied first)."""
        s = self._extents.stats()
        pb = self.page_bytes
        return ArenaStats(self.capacity, s.used_pages * pb, s.free_pages * pb, s.largest_free_run * pb, s.live_extents,
                          s.allocs, s.failed_allocs, self._fallbacks, self._mem.prefaulted, self.pinned)

    def close(self) -> None:
        """Stop handing out blocks and unmap the memory once no block is alive any more (blocks
        alive now stay valid until they are dropped)."""
        self._finalizer()


class _Memory:
    """The shared memory and the ndarray over it (every block's array is a view of it: the mapping
    lives while a block does)."""

    def __init__(self, shm: SharedMemory) -> None:
        self.shm = shm
        self.array: np.ndarray | None = shm.array
        self.pinned_ptr = 0
        self.prefaulted = 0


def _prefault(mem: _Memory, end: int, stop: threading.Event, *, background: bool) -> None:
    """Fault ``mem`` in up to byte ``end``, lowest addresses first, in 64 MiB steps; stops when the
    arena closes (or is dropped). In the background at the lowest CPU priority (this thread only)."""
    if background:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
    for start in range(0, end, _PREFAULT_CHUNK):
        array = mem.array
        if stop.is_set() or array is None:
            return
        n = min(_PREFAULT_CHUNK, end - start)
        try:
            mem.shm.madvise(MADV_POPULATE_WRITE, start, n)
        except (OSError, ValueError):  # older kernel: write one byte of each page (its bytes stay)
            chunk = array[start:start + n]
            chunk[::PAGE_BYTES] = chunk[::PAGE_BYTES]
        mem.prefaulted = start + n


def _close_memory(mem: _Memory, stop: threading.Event, extents: ExtentAllocator) -> None:
    stop.set()
    mem.array = None  # hands out nothing more; blocks still alive keep the mapping through their views
    live = extents.stats().live_extents
    if mem.pinned_ptr and not live:
        cuda_host_unregister(mem.pinned_ptr)  # with blocks alive the range stays registered (and mapped)
    if live:
        log.debug("host arena closed with blocks alive; the mapping goes with the last of them")
    mem.shm.close_fd()
