"""``kvtier._streamcopy`` (kvtier/_streamcopy.c): ``copy_into``, the client's ReadKV receive copy with
streaming stores, and ``replace``, WriteKV's in-place write of a run of rows that keeps the rows it
replaces in one pass (streaming stores into the undo buffer). Both checked against plain slicing at
every alignment of their buffers and lengths around the 32-byte head, the steps of their loops and
(copy_into) the streaming threshold; bad arguments write nothing. Every test runs on the native module
and on its pure-Python stand-in (``kvtier.streamcopy_py``, used where the extension was not built)."""

from __future__ import annotations

import platform

import numpy as np
import pytest

from kvtier import _streamcopy, streamcopy_py


@pytest.fixture(params=[_streamcopy, streamcopy_py], ids=["native", "pure"])
def sc(request):
    return request.param


def _cpu_has_avx2() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and " avx2" in line for line in f)


def test_streaming_stores_are_used_where_the_cpu_has_avx2():
    assert streamcopy_py.STREAMING == 0 and streamcopy_py.STREAM_MIN_BYTES == _streamcopy.STREAM_MIN_BYTES
    assert _streamcopy.STREAMING == int(platform.machine() == "x86_64" and _cpu_has_avx2())
    assert _streamcopy.STREAM_MIN_BYTES == 64 * 1024


M = 64 * 1024


@pytest.mark.parametrize("n", [0, 1, 31, 127, 128, 129, M - 1, M, M + 1, M + 31, M + 127, M + 129, (1 << 20) + 5])
def test_the_bytes_land_at_the_offset_and_nothing_else_changes(sc, n):
    rng = np.random.default_rng(n)
    for d_off, s_off in ((0, 0), (1, 7), (31, 33), (32, 63), (100, 0)):
        dst = rng.integers(0, 256, size=n + 256, dtype=np.uint8)
        src_all = rng.integers(0, 256, size=n + 128, dtype=np.uint8)
        before = dst.copy()
        src = src_all[s_off:s_off + n]
        sc.copy_into(dst, d_off, src)
        want = before.copy()
        want[d_off:d_off + n] = src
        assert np.array_equal(dst, want), (n, d_off, s_off)


def test_bytes_and_memoryviews_are_sources(sc):
    dst = np.zeros(M + 10, np.uint8)
    src = bytes(range(256)) * (M // 256) + b"abcdefghij"
    sc.copy_into(dst, 0, memoryview(src))
    assert dst.tobytes() == src
    sc.copy_into(dst, 3, src[:7])
    assert dst[3:10].tobytes() == src[:7]


def test_copy_into_with_bad_arguments_writes_nothing(sc):
    dst = np.arange(256, dtype=np.uint8)
    d0 = dst.copy()
    with pytest.raises(ValueError, match="do not fit"):
        sc.copy_into(dst, 200, bytes(57))
    with pytest.raises(ValueError, match="do not fit"):
        sc.copy_into(dst, -1, bytes(1))
    with pytest.raises(ValueError, match="do not fit"):
        sc.copy_into(dst, 257, b"")
    with pytest.raises(ValueError, match="overlap"):
        sc.copy_into(dst, 10, dst[0:20])
    with pytest.raises(TypeError):
        sc.copy_into(bytes(256), 0, b"x")  # not writable
    with pytest.raises(TypeError):
        sc.copy_into(dst[::2], 0, b"x")  # not contiguous
    assert np.array_equal(dst, d0)
    sc.copy_into(dst, 256, b"")  # an empty copy at the end fits
    assert np.array_equal(dst, d0)


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 63, 64, 65, 95, 127, 128, 129, 4096 + 5, 656 * 64 + 1, 1 << 20])
def test_undo_gets_the_old_bytes_and_dst_the_new_at_every_alignment(sc, n):
    rng = np.random.default_rng(n)
    for d_off, u_off, s_off in ((0, 0, 0), (1, 7, 13), (31, 33, 2), (5, 32, 63), (64, 3, 0)):
        dst_all = rng.integers(0, 256, size=n + 128, dtype=np.uint8)
        undo_all = rng.integers(0, 256, size=n + 128, dtype=np.uint8)
        src_all = rng.integers(0, 256, size=n + 128, dtype=np.uint8)
        dst0, undo0 = dst_all.copy(), undo_all.copy()
        sc.replace(dst_all[d_off:d_off + n], undo_all[u_off:u_off + n], src_all[s_off:s_off + n])
        assert np.array_equal(undo_all[u_off:u_off + n], dst0[d_off:d_off + n]), (n, d_off, u_off)
        assert np.array_equal(dst_all[d_off:d_off + n], src_all[s_off:s_off + n])
        # nothing outside the three ranges changed
        assert np.array_equal(dst_all[:d_off], dst0[:d_off]) and np.array_equal(dst_all[d_off + n:], dst0[d_off + n:])
        assert np.array_equal(undo_all[:u_off], undo0[:u_off]) and np.array_equal(undo_all[u_off + n:], undo0[u_off + n:])


def test_replace_with_bad_arguments_writes_nothing(sc):
    dst, undo, src = np.arange(256, dtype=np.uint8), np.zeros(256, np.uint8), np.full(256, 9, np.uint8)
    d0 = dst.copy()
    with pytest.raises(ValueError, match="one length"):
        sc.replace(dst, undo[:255], src)
    with pytest.raises(ValueError, match="overlap"):
        sc.replace(dst[:128], dst[64:192], src[:128])
    with pytest.raises(ValueError, match="overlap"):
        sc.replace(dst[:128], undo[:128], dst[100:228])
    with pytest.raises(TypeError):
        sc.replace(bytes(256), undo, src)  # dst not writable
    assert np.array_equal(dst, d0) and not undo.any()
