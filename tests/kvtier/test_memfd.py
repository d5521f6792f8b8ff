"""The one shared-memory primitive (``kvtier.memfd``): anonymous, sealed, mapped by descriptor,
revocable in place, unmapped when its last view is gone."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvtier.memfd import SharedMemory


def mapped(name: str) -> int:
    """Mappings of memfd ``name`` in this process (``/proc/self/maps`` lines)."""
    return sum(f"/memfd:{name}" in line for line in Path("/proc/self/maps").read_text().splitlines())


def test_new_memory_is_zero_sealed_and_named_nowhere():
    before = sorted(os.listdir("/dev/shm"))
    m = SharedMemory.create(3 * 4096 + 5, "kvtier-test-zero")
    assert m.nbytes == 3 * 4096 + 5 and m.sealed
    assert not m.array.any()
    assert os.readlink(f"/proc/self/fd/{m.fd}").startswith("/memfd:kvtier-test-zero")
    with pytest.raises(PermissionError):
        os.ftruncate(m.fd, 4096)  # sealed: nobody holding the descriptor can shrink it under a mapping
    with pytest.raises(PermissionError):
        os.ftruncate(m.fd, 1 << 30)
    assert sorted(os.listdir("/dev/shm")) == before
    m.close_fd()


def test_a_second_process_maps_the_descriptor_and_sees_the_same_bytes(tmp_path):
    """A child receives the descriptor over a unix socket (SCM_RIGHTS, as a worker does), writes
    through its own mapping, and the parent reads exactly those bytes."""
    m = SharedMemory.create(1 << 20, "kvtier-test-pass")
    rng = np.random.default_rng(7)
    m.array[:4096] = rng.integers(0, 256, 4096, dtype=np.uint8)
    expected_head = m.array[:4096].copy()
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    code = textwrap.dedent("""
        import socket, sys
        import numpy as np
        from kvtier.memfd import SharedMemory
        s = socket.socket(fileno=int(sys.argv[1]))
        msg, fds, _, _ = socket.recv_fds(s, 64, 1)
        m = SharedMemory.open(fds[0], int(msg))
        head = bytes(m.array[:4096])
        m.array[4096:8192] = np.arange(4096, dtype=np.uint64).astype(np.uint8)
        s.send(head)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code, str(child.fileno())], pass_fds=[child.fileno()])
    child.close()
    socket.send_fds(parent, [str(m.nbytes).encode()], [m.fd])
    echoed = parent.recv(8192)
    assert proc.wait(60) == 0
    assert echoed == expected_head.tobytes()
    assert np.array_equal(m.array[4096:8192], np.arange(4096, dtype=np.uint64).astype(np.uint8))
    parent.close()


def test_revoke_replaces_the_mapping_in_place():
    """After revoke a stale tensor reads zeros and its writes reach no one else."""
    m = SharedMemory.create(8192, "kvtier-test-revoke")
    m.array[:] = 5
    other = SharedMemory.open(os.dup(m.fd), 8192)
    stale = other.tensor()
    assert int(stale[100]) == 5
    other.revoke()
    assert other.revoked and other.fd == -1
    assert int(stale.sum()) == 0
    stale[:] = 9
    assert int(m.array.min()) == 5 and int(m.array.max()) == 5
    other.revoke()  # idempotent


def test_unmapped_when_the_region_and_its_views_are_gone():
    m = SharedMemory.create(4096, "kvtier-test-unmap")
    t = m.tensor()
    m.close_fd()
    del m
    gc.collect()
    assert mapped("kvtier-test-unmap") == 1 and int(t[0]) == 0  # the tensor keeps the mapping
    del t
    gc.collect()
    assert mapped("kvtier-test-unmap") == 0


def test_open_refuses_a_size_that_differs_and_what_is_not_memory():
    m = SharedMemory.create(4096, "kvtier-test-size")
    with pytest.raises(ValueError, match="holds 4096 bytes, not the 8192"):
        SharedMemory.open(os.dup(m.fd), 8192)
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(ValueError, match="not shared memory"):
        SharedMemory.open(r, 4096)
    with pytest.raises(OSError):
        os.fstat(r)  # closed by open() on failure: the region owns the descriptor it was given
    with pytest.raises(ValueError):
        SharedMemory.create(0)
    with pytest.raises(TypeError):
        SharedMemory(m.fd, 4096)
