"""Anonymous shared memory (a memfd) mapped into this process: the one primitive for kvtier's shared host memory.

Shared by the daemon and the client (nothing of ``kvtier.server`` is imported here). The daemon puts
every CPU pool's arenas in it and passes the descriptors to attached workers over a unix socket
(``SCM_RIGHTS``); a worker maps the descriptors it received. The host arena (``server/hostmem``)
is meant to sit on the same primitive.

Why a memfd (``memfd_create(2)``): the memory has no name in ``/dev/shm`` or anywhere else, so
nothing is left behind when anyone exits, crashes or is killed with SIGKILL; it lives as long as a
descriptor or a mapping of it does. Every region the daemon makes is *sealed* against shrinking and
growing (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``): a worker holding the descriptor cannot
``ftruncate`` it, which would make the daemon's next access to the cut-off pages a SIGBUS.

Mappings are made with ``mmap(2)`` through ctypes (not Python's ``mmap`` module, which keeps a
duplicate of the descriptor open for as long as the mapping lives): the region owns exactly one
descriptor, :meth:`SharedMemory.close_fd` closes it, and the mapping stays valid without it. The
mapping is unmapped when the region and every array or tensor made from it are gone.

:meth:`SharedMemory.revoke` replaces the mapping *in place* with private anonymous memory
(``MAP_FIXED``): tensors over it stay valid Python objects but from then on read zeros and write
into memory no one else sees. A worker does this at detach, so a stale tensor can never touch the
daemon's pool again.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import stat
import threading
import weakref
from typing import Any

import numpy as np

PROT_READ, PROT_WRITE = mmap.PROT_READ, mmap.PROT_WRITE
MAP_SHARED, MAP_PRIVATE = mmap.MAP_SHARED, mmap.MAP_PRIVATE
MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0x20)
MAP_FIXED = 0x10  # Linux; not exported by Python's mmap module
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
MAX_NAME_CHARS = 240  # memfd names are at most 249 bytes

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MAP_FAILED = ctypes.c_void_p(-1).value


def _mmap(addr: int | None, nbytes: int, prot: int, flags: int, fd: int) -> int:
    p = _libc.mmap(addr, nbytes, prot, flags, fd, 0)
    if p is None or p == _MAP_FAILED:
        e = ctypes.get_errno()
        raise OSError(e, f"mmap of {nbytes} bytes failed: {os.strerror(e)}")
    return int(p)


class _Mapping:
    """An address range this process mapped; unmapped by :func:`_unmap` (a finalizer) exactly once."""

    __slots__ = ("address", "nbytes", "__weakref__")

    def __init__(self, address: int, nbytes: int) -> None:
        self.address, self.nbytes = address, nbytes


def _unmap(address: int, nbytes: int) -> None:
    _libc.munmap(address, nbytes)


def _close_box(box: list[int]) -> None:
    fd, box[0] = box[0], -1
    if fd >= 0:
        try:
            os.close(fd)
        except OSError as e:  # pragma: no cover - a descriptor closed behind our back
            if e.errno != errno.EBADF:
                raise


class SharedMemory:
    """``nbytes`` of anonymous shared memory mapped read-write at :attr:`address`.

    Make one with :meth:`create` (new memory) or :meth:`open` (a descriptor another process passed);
    don't call the constructor.

    Attributes:
        fd: the memfd descriptor (``-1`` once :meth:`close_fd` ran; closed at garbage collection
            otherwise). Pass it with ``socket.send_fds``.
        nbytes: size in bytes (the memfd's size; sealed when made by :meth:`create`).
        address: where it is mapped in this process.
        array: ``(nbytes,)`` uint8 numpy view of the mapping (every tensor made by :meth:`tensor` is a
            view of it; the mapping lives while any of them does).
        revoked: True once :meth:`revoke` replaced the mapping with private memory.
    """

    def __init__(self, fd: int, nbytes: int, *, _token: object = None) -> None:
        if _token is not _PRIVATE:
            raise TypeError("use SharedMemory.create(nbytes) or SharedMemory.open(fd, nbytes)")
        self._fd = [fd]  # a box the finalizer shares: the descriptor is closed once, at close_fd() or at GC
        self.nbytes = nbytes
        self.address = _mmap(None, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd)
        self._mapping = _Mapping(self.address, nbytes)
        weakref.finalize(self._mapping, _unmap, self.address, nbytes)
        buf = (ctypes.c_uint8 * nbytes).from_address(self.address)
        buf._kvtier_mapping = self._mapping  # type: ignore[attr-defined]  # the buffer keeps the mapping alive
        self.array: np.ndarray = np.frombuffer(buf, dtype=np.uint8)
        self.revoked = False
        self._lock = threading.Lock()
        weakref.finalize(self, _close_box, self._fd)

    @property
    def fd(self) -> int:
        """The memfd descriptor, ``-1`` once closed."""
        return self._fd[0]

    @classmethod
    def create(cls, nbytes: int, name: str = "kvtier") -> SharedMemory:
        """New zero-filled shared memory of ``nbytes`` (a memfd named ``name``, sealed against
        shrinking and growing, close-on-exec), mapped here.

        Raises:
            ValueError: ``nbytes`` < 1.
            OSError: the kernel refused (no memory, no memfd support).
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise ValueError(f"shared memory needs at least one byte, got {nbytes!r}")
        fd = os.memfd_create(name[:MAX_NAME_CHARS], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            return cls(fd, nbytes, _token=_PRIVATE)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open(cls, fd: int, nbytes: int) -> SharedMemory:
        """Map the shared memory behind descriptor ``fd`` (e.g. received with ``socket.recv_fds``);
        the region takes ownership of ``fd`` (closed on failure too).

        Raises:
            ValueError: ``fd`` is not a regular file (memfd) of exactly ``nbytes`` bytes.
            OSError: the mapping failed.
        """
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError("the descriptor is not shared memory (not a regular file)")
            if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1 or st.st_size != nbytes:
                raise ValueError(f"the shared memory holds {st.st_size} bytes, not the {nbytes} announced")
            return cls(fd, nbytes, _token=_PRIVATE)
        except BaseException:
            os.close(fd)
            raise

    @property
    def sealed(self) -> bool:
        """Whether the memfd can no longer shrink or grow (False once the descriptor is closed)."""
        if self.fd < 0:
            return False
        try:
            seals = fcntl.fcntl(self.fd, fcntl.F_GET_SEALS)
        except OSError:
            return False
        return seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) == fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW

    def tensor(self) -> Any:
        """The mapping as a ``(nbytes,)`` uint8 torch tensor (a view: no copy)."""
        import torch

        return torch.from_numpy(self.array)

    def madvise(self, advice: int, start: int = 0, length: int | None = None) -> None:
        """``madvise(2)`` on ``[start, start + length)`` of the mapping (page-aligned ``start``),
        e.g. ``MADV_POPULATE_WRITE`` (23) to fault it in at once.

        Raises:
            OSError: the kernel refused the advice.
        """
        length = self.nbytes - start if length is None else length
        if _libc.madvise(self.address + start, length, advice) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"madvise({advice}) failed: {os.strerror(e)}")

    def revoke(self) -> None:
        """Replace the mapping in place with private anonymous memory (zeros) and close the
        descriptor: arrays and tensors over it stay usable but no longer reach the shared memory.
        Idempotent.

        Raises:
            OSError: the kernel refused the replacement mapping (the shared mapping is then kept).
        """
        with self._lock:
            if not self.revoked:
                _mmap(self.address, self.nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1)
                self.revoked = True
        self.close_fd()

    def close_fd(self) -> None:
        """Close the descriptor (the mapping stays valid). Idempotent."""
        with self._lock:
            _close_box(self._fd)

    def __repr__(self) -> str:
        state = "revoked" if self.revoked else ("fd closed" if self.fd < 0 else f"fd {self.fd}")
        return f"SharedMemory({self.nbytes} bytes at {self.address:#x}, {state})"


_PRIVATE = object()
