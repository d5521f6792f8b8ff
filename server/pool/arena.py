"""Backing memory for pool buffers: one arena per component, carved into per-layer views.

Every per-layer buffer of a component (latent KV, indexer) is a view into a single allocation, so

* registered ranges never overlap and a transfer engine may register one range per component;
* a local worker maps the whole component at once (local attach: on the CPU the arena is
  anonymous shared memory, :class:`kvtier.memfd.SharedMemory`, whose descriptor the daemon passes
  to the worker; on a GPU one CUDA IPC handle) while the daemon keeps tiering it;
* all-layer copies run as one gather/scatter over a ``(layers, rows, words)`` view.

A pool either allocates its arenas (:func:`alloc_arena`, :func:`shared_arena`) or is built over
arenas that already exist (:func:`check_arena`: an attached worker's mapping of the daemon's).
"""

from __future__ import annotations

import math

import torch

from kvtier.memfd import SharedMemory

ARENA_ALIGN = 64  # bytes: every word view (up to int64) of an arena starts aligned


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"auto"``/None -> ``cuda`` when a CUDA device exists, else ``cpu``; others are validated.

    Raises:
        ValueError: an unknown device string, or ``cuda`` asked for where none exists.
    """
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but no CUDA device is available (use 'cpu' or 'auto')")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    return dev


def word_dtype(*byte_counts: int) -> torch.dtype:
    """Widest integer dtype (int64, int32, int16, uint8) whose size divides every byte count.

    Scatters on uint8 run byte by byte in torch; on an int64 view of the same rows they run ~7x
    faster (DESIGN.md, measured), so every copy goes through the widest view the layout allows.
    """
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if all(b % size == 0 for b in byte_counts):
            return dt
    return torch.uint8


def as_words(t: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """The bytes of ``t`` viewed as ``word`` along the last dimension (last dim scaled accordingly).

    Copies ``t`` first when it is not contiguous or its first byte is not ``word``-aligned within its
    storage (e.g. a chunk parsed out of a wire payload at an odd offset), so the view never fails.
    """
    t = t.contiguous()
    if word.itemsize > 1 and (t.storage_offset() * t.element_size()) % word.itemsize:
        t = t.clone()
    return t.view(torch.uint8).view(word)


def alloc_arena(nbytes: int, device: torch.device) -> torch.Tensor:
    """Zero-filled uint8 ``(nbytes,)`` buffer on ``device`` (private to this process)."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def shared_arena(nbytes: int, name: str) -> tuple[torch.Tensor, SharedMemory]:
    """Zero-filled uint8 ``(nbytes,)`` host buffer in anonymous shared memory (a sealed memfd named
    ``name``) and the region behind it, whose descriptor a local worker can map.

    Raises:
        ValueError: ``nbytes`` < 1. OSError: the kernel refused the memory.
    """
    shm = SharedMemory.create(nbytes, name)
    return shm.tensor(), shm


def check_arena(t: object, nbytes: int, device: torch.device, what: str) -> torch.Tensor:
    """``t`` if it can back a pool component of ``nbytes`` on ``device``: a contiguous 1-D uint8
    tensor of exactly ``nbytes`` bytes on that device, starting :data:`ARENA_ALIGN`-byte aligned.

    Raises:
        TypeError/ValueError: naming the first mismatch (the pool is not built then).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"arenas[{what!r}] must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"arenas[{what!r}] must be a contiguous 1-D uint8 tensor, got {tuple(t.shape)} {t.dtype}")
    if t.numel() != nbytes:
        raise ValueError(f"arenas[{what!r}] holds {t.numel()} bytes but the pool's {what} component needs {nbytes}")
    if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
        raise ValueError(f"arenas[{what!r}] lies on {t.device}, not on the pool's device {device}")
    if nbytes and t.data_ptr() % ARENA_ALIGN:
        raise ValueError(f"arenas[{what!r}] must start {ARENA_ALIGN}-byte aligned")
    return t


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised host tensor for copies off ``device``: pinned when the pool lives on CUDA.

    Raises:
        MemoryError: the host (or pinned) memory cannot be allocated. torch's allocators raise a
            plain ``RuntimeError`` ("DefaultCPUAllocator: can't allocate memory", CUDA's pinned
            "out of memory"); a caller -- a ReadKV stream copying its rest off the pool, a
            ``get_cpu_copy`` -- gets the type that says "no memory now, retry" (the daemon's
            RESOURCE_EXHAUSTED), never one that reads as a bug.
    """
    pin = device.type == "cuda"
    try:
        return torch.empty(shape, dtype=dtype, pin_memory=pin)
    except RuntimeError as e:  # shape and dtype are ours: an allocation failure
        nbytes = math.prod(shape) * dtype.itemsize
        reason = " ".join(str(e).split())
        raise MemoryError(f"cannot allocate {nbytes} bytes of {'pinned ' if pin else ''}host memory for a copy off "
                          f"the pool ({reason[:200]}); retry when memory is free, or copy fewer slots a call") from e
