"""glibc malloc settings for the daemon (set at start) and any process that spills records into
LMDB: keep freed memory for reuse.

gRPC's Python runtime receives every message into a fresh bytes object (a 1 MiB KV chunk: above
glibc's initial 128 KiB mmap threshold); with the defaults a 221 MB WriteKV faulted ~35 MB of them in
again every call (8,897 minor faults a write; 82 with the settings below: BENCHMARKS.md, fix 16).

LMDB (without ``writemap``) builds a write transaction in memory it mallocs: a value larger than a
page gets its own run of overflow pages (a 194,048-byte GLM-5.2 page record: one 196 KB block), and
the commit writes them out (``pwritev``) and frees them. With glibc's defaults each such block is a
fresh ``mmap`` (above the 128 KiB threshold), or, once the dynamic threshold has risen past it, a
piece of the heap that ``free`` trims back to the kernel as soon as more than twice the block sits
free at the top (a spill transaction frees megabytes at once). Either way the next transaction
faults every page in again: measured here, raw py-lmdb put + commit of 194 KB values in
transactions of 20 cost 141-185 us a record by default and 51-55 us with the two settings below,
of which the put (the copy into LMDB's pages) 85-97 -> 11-13 us (BENCHMARKS.md, fix 14).

:func:`keep_freed_memory` sets ``M_MMAP_THRESHOLD`` (allocations below it come from the heap) and
``M_TRIM_THRESHOLD`` (free memory the heap keeps at its top) with ``mallopt``; both are needed:
setting either one turns glibc's dynamic adjustment of the other off. Large tensors (above the
threshold) are still mapped and unmapped as before, so a process keeps at most about the trim
threshold of freed heap memory mapped.

The mmap threshold is glibc's largest (32 MiB on 64-bit): an offloaded request copy is one record,
one LMDB value (13.8 MB for 256 GLM-5.2 tokens), and with a 4 MiB threshold every such put faulted
its whole block in again (27,000 minor faults for eight records; the offload to disk ran 0.32x a
plain file write, 0.97x with the block on the heap: BENCHMARKS.md, fix 20). The trim threshold is
twice a write transaction's record bytes (``DiskTierConfig.max_txn_bytes``, 64 MiB), so the blocks
of one commit are kept for the next. Records larger than 32 MiB are still mapped afresh for each put.

Process-wide and idempotent; a no-op on a C library that is not glibc, or when the environment says
``KVTIER_MALLOC_TUNE=0``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

log = logging.getLogger(__name__)

#: Allocations below this come from the heap (glibc's ``M_MMAP_THRESHOLD``, bytes).
MMAP_THRESHOLD_BYTES = 32 << 20
#: Free memory the heap keeps at its top instead of returning it (``M_TRIM_THRESHOLD``, bytes).
TRIM_THRESHOLD_BYTES = 128 << 20

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_done: list[bool] = []
_lock = threading.Lock()


def keep_freed_memory() -> bool:
    """Set glibc's malloc thresholds (:data:`MMAP_THRESHOLD_BYTES`, :data:`TRIM_THRESHOLD_BYTES`) once
    per process, so LMDB's transaction buffers and other blocks of up to a few MiB are reused, not
    faulted in again for every spill.

    Returns:
        True when the settings are in force (now or from an earlier call); False when the C library
        is not glibc, ``mallopt`` refused, or ``KVTIER_MALLOC_TUNE=0`` switched it off. Never raises.
    """
    with _lock:
        if _done:
            return _done[0]
        ok = False
        if os.environ.get("KVTIER_MALLOC_TUNE", "1") != "0":
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                mallopt = libc.mallopt
                mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
                ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and \
                    mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
            except (OSError, AttributeError) as e:  # not glibc (musl, macOS): nothing to tune
                log.debug("malloc thresholds not set: %s", e)
        _done.append(ok)
        return ok
