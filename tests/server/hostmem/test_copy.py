"""``kvtier.server.hostmem._copy.replace`` (server/hostmem/_copy.c): WriteKV's in-place write of a run
of rows that keeps the rows it replaces, in one pass (streaming stores into the undo buffer on AVX2).
Checked against plain slicing at every alignment of the three buffers and lengths around the 32- and
64-byte steps of the loop; bad arguments write nothing."""

from __future__ import annotations

import platform

import numpy as np
import pytest

from kvtier.server.hostmem import _copy


def _cpu_has_avx2() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and " avx2" in line for line in f)


def test_streaming_stores_are_used_where_the_cpu_has_avx2():
    expect = int(platform.machine() == "x86_64" and _cpu_has_avx2())
    assert _copy.STREAMING == expect


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 63, 64, 65, 95, 127, 128, 129, 4096 + 5, 656 * 64 + 1, 1 << 20])
def test_undo_gets_the_old_bytes_and_dst_the_new_at_every_alignment(n):
    rng = np.random.default_rng(n)
    for d_off, u_off, s_off in ((0, 0, 0), (1, 7, 13), (31, 33, 2), (5, 32, 63), (64, 3, 0)):
        dst_all = rng.integers(0, 256, size=n + 128, dtype=np.uint8)
        undo_all = rng.integers(0, 256, size=n + 128, dtype=np.uint8)
        src_all = rng.integers(0, 256, size=n + 128, dtype=np.uint8)
        dst0, undo0 = dst_all.copy(), undo_all.copy()
        _copy.replace(dst_all[d_off:d_off + n], undo_all[u_off:u_off + n], src_all[s_off:s_off + n])
        assert np.array_equal(undo_all[u_off:u_off + n], dst0[d_off:d_off + n]), (n, d_off, u_off)
        assert np.array_equal(dst_all[d_off:d_off + n], src_all[s_off:s_off + n])
        # nothing outside the three ranges changed
        assert np.array_equal(dst_all[:d_off], dst0[:d_off]) and np.array_equal(dst_all[d_off + n:], dst0[d_off + n:])
        assert np.array_equal(undo_all[:u_off], undo0[:u_off]) and np.array_equal(undo_all[u_off + n:], undo0[u_off + n:])


def test_bad_arguments_write_nothing():
    dst, undo, src = np.arange(256, dtype=np.uint8), np.zeros(256, np.uint8), np.full(256, 9, np.uint8)
    d0 = dst.copy()
    with pytest.raises(ValueError, match="one length"):
        _copy.replace(dst, undo[:255], src)
    with pytest.raises(ValueError, match="overlap"):
        _copy.replace(dst[:128], dst[64:192], src[:128])
    with pytest.raises(ValueError, match="overlap"):
        _copy.replace(dst[:128], undo[:128], dst[100:228])
    with pytest.raises(TypeError):
        _copy.replace(bytes(256), undo, src)  # dst not writable
    assert np.array_equal(dst, d0) and not undo.any()
