"""CUDA IPC handles of device memory, shared by the daemon and the client (no server imports here).

The daemon exports each arena of a CUDA pool with :func:`export_arena`: the CUDA driver's
``cuIpcGetMemHandle`` of the allocation holding it, the arena's offset in that allocation, its size
and the device's UUID. A worker on the same machine opens it with :func:`open_arena`
(``cuIpcOpenMemHandle`` on the device with that UUID, whatever its index under the worker's
``CUDA_VISIBLE_DEVICES``) and gets a uint8 tensor over the very same device memory. Nothing is
named in ``/dev/shm`` (torch's own ``reduce_tensor`` path keeps reference counts in named shared
memory; this does not need them: the daemon keeps the pool alive for as long as it exists).

The driver API is reached through ctypes (``libcuda.so.1``, present wherever CUDA runs), so the
same code works with any torch build. Memory from torch's expandable segments
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) is not IPC-capable with these calls:
:func:`export_arena` then fails with a clear error.

After :meth:`CudaArena.close` (a worker's ``detach()``) the worker's mapping is gone: a stale tensor
over it faults in the worker (a CUDA error there), never in the daemon, whose memory stays intact.
"""

from __future__ import annotations

import base64
import ctypes
from dataclasses import dataclass
from typing import Any

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_HANDLE_BYTES = 64
_driver: Any = None


class CudaIpcError(RuntimeError):
    """A CUDA driver call failed (the message names it and its error code)."""


def _cuda() -> Any:
    global _driver
    if _driver is None:
        try:
            _driver = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaIpcError(f"the CUDA driver (libcuda.so.1) cannot be loaded: {e}") from None
    return _driver


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _cuda().cuGetErrorName(rc, ctypes.byref(name))
        raise CudaIpcError(f"{what} failed with CUDA error {rc} ({(name.value or b'?').decode()})")


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * _HANDLE_BYTES)]


def _device_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def export_arena(t: Any) -> dict[str, Any]:
    """What a worker needs to open the CUDA arena ``t`` (a contiguous uint8 device tensor).

    Returns:
        ``{"handle": base64 of the 64-byte cudaIpcMemHandle, "offset": byte offset of ``t`` in that
        allocation, "nbytes", "device_uuid"}`` (JSON-ready).

    Raises:
        CudaIpcError: the memory cannot be shared (e.g. torch's expandable segments).
    """
    import torch

    torch.cuda.synchronize(t.device)  # the context is current and the arena's zero fill is done
    drv = _cuda()
    ptr = ctypes.c_uint64(t.data_ptr())
    handle = _Handle()
    _check(drv.cuIpcGetMemHandle(ctypes.byref(handle), ptr),
           "cuIpcGetMemHandle (is PYTORCH_CUDA_ALLOC_CONF=expandable_segments set? IPC needs plain allocations)")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
    return {"handle": base64.b64encode(bytes(handle.reserved)).decode(), "offset": t.data_ptr() - base.value,
            "nbytes": int(t.numel()), "device_uuid": _device_uuid(t.device.index or 0)}


class _DeviceBuffer:
    """An object with ``__cuda_array_interface__`` over raw device memory (``torch.as_tensor`` takes it)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None}


@dataclass
class CudaArena:
    """An opened CUDA arena: ``tensor`` (uint8, on ``device``) over the daemon's memory."""

    tensor: Any
    device: Any
    _base: int

    def close(self) -> None:
        """Unmap the daemon's memory from this process (``cuIpcCloseMemHandle``). Idempotent."""
        if self._base:
            import torch

            torch.cuda.synchronize(self.device)  # nothing of this process still runs on the mapping
            base, self._base = self._base, 0
            _check(_cuda().cuIpcCloseMemHandle(ctypes.c_uint64(base)), "cuIpcCloseMemHandle")


def open_arena(desc: dict[str, Any]) -> CudaArena:
    """Open an arena :func:`export_arena` described, on the local device with its UUID.

    Raises:
        CudaIpcError: no local device has that UUID (attach needs the same device), or the driver refused.
    """
    import torch

    if not torch.cuda.is_available():
        raise CudaIpcError("the pool lives on a CUDA device, but this process sees none (attach needs the same device)")
    index = next((i for i in range(torch.cuda.device_count()) if _device_uuid(i) == desc["device_uuid"]), None)
    if index is None:
        raise CudaIpcError(f"the pool's CUDA device {desc['device_uuid']} is not visible here; attach needs the same device")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    torch.empty(1, device=device)  # the primary context exists and is current on this thread
    handle = _Handle()
    raw = base64.b64decode(desc["handle"])
    if len(raw) != _HANDLE_BYTES:
        raise CudaIpcError(f"a CUDA IPC handle has {_HANDLE_BYTES} bytes, got {len(raw)}")
    ctypes.memmove(handle.reserved, raw, _HANDLE_BYTES)
    base = ctypes.c_uint64()
    _check(_cuda().cuIpcOpenMemHandle_v2(ctypes.byref(base), handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
           "cuIpcOpenMemHandle")
    t = torch.as_tensor(_DeviceBuffer(base.value + int(desc["offset"]), int(desc["nbytes"])), device=device)
    return CudaArena(t, device, base.value)
