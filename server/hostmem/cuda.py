"""Page-locking host memory for CUDA DMA: ``cudaHostRegister`` / ``cudaHostUnregister`` through
``torch.cuda.cudart()`` (the CUDA runtime torch itself loaded; no other binding needed).

``cudaHostRegisterDefault`` (0) with ``cudaHostRegisterPortable`` (1): the range counts as pinned in
every CUDA context of the process, so ``tensor.is_pinned()`` is true for tensors over it and copies
to and from any device run as DMA (``non_blocking=True`` really is asynchronous).
"""

from __future__ import annotations

import torch

CUDA_HOST_REGISTER_PORTABLE = 1


def _error_code(rc: object) -> int:
    """cudart calls return a ``cudaError`` enum, a plain int, or a tuple whose first item is one."""
    if isinstance(rc, tuple):
        rc = rc[0]
    return int(getattr(rc, "value", rc))


def cuda_host_register(ptr: int, nbytes: int) -> None:
    """Page-lock ``[ptr, ptr + nbytes)`` for CUDA.

    Raises:
        RuntimeError: CUDA is not available, or ``cudaHostRegister`` returned an error.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("cannot page-lock host memory for CUDA: no CUDA device is available")
    torch.cuda.init()
    rc = _error_code(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister({ptr:#x}, {nbytes}) failed with CUDA error {rc}")


def cuda_host_unregister(ptr: int) -> None:
    """Undo :func:`cuda_host_register` (errors are ignored: the range goes away either way)."""
    if torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(ptr)
