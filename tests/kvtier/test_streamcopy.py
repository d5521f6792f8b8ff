"""``kvtier._streamcopy.copy_into`` (kvtier/_streamcopy.c): the client's ReadKV receive copy with
streaming stores. Checked against plain slicing at every alignment of both buffers and lengths around
the 32-byte head, the 128-byte step of the loop and the streaming threshold; bad arguments write nothing."""

from __future__ import annotations

import platform

import numpy as np
import pytest

from kvtier import _streamcopy


def _cpu_has_avx2() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and " avx2" in line for line in f)


def test_streaming_stores_are_used_where_the_cpu_has_avx2():
    assert _streamcopy.STREAMING == int(platform.machine() == "x86_64" and _cpu_has_avx2())
    assert _streamcopy.STREAM_MIN_BYTES == 64 * 1024


M = 64 * 1024


@pytest.mark.parametrize("n", [0, 1, 31, 127, 128, 129, M - 1, M, M + 1, M + 31, M + 127, M + 129, (1 << 20) + 5])
def test_the_bytes_land_at_the_offset_and_nothing_else_changes(n):
    rng = np.random.default_rng(n)
    for d_off, s_off in ((0, 0), (1, 7), (31, 33), (32, 63), (100, 0)):
        dst = rng.integers(0, 256, size=n + 256, dtype=np.uint8)
        src_all = rng.integers(0, 256, size=n + 128, dtype=np.uint8)
        before = dst.copy()
        src = src_all[s_off:s_off + n]
        _streamcopy.copy_into(dst, d_off, src)
        want = before.copy()
        want[d_off:d_off + n] = src
        assert np.array_equal(dst, want), (n, d_off, s_off)


def test_bytes_and_memoryviews_are_sources():
    dst = np.zeros(M + 10, np.uint8)
    src = bytes(range(256)) * (M // 256) + b"abcdefghij"
    _streamcopy.copy_into(dst, 0, memoryview(src))
    assert dst.tobytes() == src
    _streamcopy.copy_into(dst, 3, src[:7])
    assert dst[3:10].tobytes() == src[:7]


def test_bad_arguments_write_nothing():
    dst = np.arange(256, dtype=np.uint8)
    d0 = dst.copy()
    with pytest.raises(ValueError, match="do not fit"):
        _streamcopy.copy_into(dst, 200, bytes(57))
    with pytest.raises(ValueError, match="do not fit"):
        _streamcopy.copy_into(dst, -1, bytes(1))
    with pytest.raises(ValueError, match="do not fit"):
        _streamcopy.copy_into(dst, 257, b"")
    with pytest.raises(ValueError, match="overlap"):
        _streamcopy.copy_into(dst, 10, dst[0:20])
    with pytest.raises(TypeError):
        _streamcopy.copy_into(bytes(256), 0, b"x")  # not writable
    with pytest.raises(TypeError):
        _streamcopy.copy_into(dst[::2], 0, b"x")  # not contiguous
    assert np.array_equal(dst, d0)
    _streamcopy.copy_into(dst, 256, b"")  # an empty copy at the end fits
    assert np.array_equal(dst, d0)
