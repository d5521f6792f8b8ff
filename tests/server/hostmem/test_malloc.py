"""glibc malloc thresholds (server/hostmem/malloc.py), each case in a fresh interpreter (the settings
are process-wide and set once): where a 1 MiB ``malloc`` lands tells whether they are in force. glibc
serves a block above its default ``M_MMAP_THRESHOLD`` (128 KiB) with its own ``mmap``; with the
threshold at 32 MiB (glibc's largest) the block comes from the heap (the ``[heap]`` mapping of
/proc/self/maps), and so does a 16 MiB one (an offloaded request copy of 256 GLM-5.2 tokens is one
13.8 MB LMDB value, which LMDB mallocs for each put)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = r"""
import ctypes, json
from kvtier.server.hostmem.malloc import keep_freed_memory
on = keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
p, q = libc.malloc(1 << 20), libc.malloc(16 << 20)
heap = [l.split()[0].split("-") for l in open("/proc/self/maps") if l.rstrip().endswith("[heap]")]
in_heap = [any(int(a, 16) <= x < int(b, 16) for a, b in heap) for x in (p, q)]
print(json.dumps({"on": on, "again": keep_freed_memory(), "in_heap": in_heap}))
"""


def probe(tune: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_MALLOC_TUNE"}
    if tune is not None:
        env["KVTIER_MALLOC_TUNE"] = tune
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_thresholds_put_a_1_mib_block_on_the_heap():
    """By default (and with KVTIER_MALLOC_TUNE=1) the settings are in force: a 1 MiB and a 16 MiB
    block are pieces of the heap, and a second call says so again without setting anything."""
    for tune in (None, "1"):
        assert probe(tune) == {"on": True, "again": True, "in_heap": [True, True]}


def test_kvtier_malloc_tune_0_leaves_glibc_alone():
    """KVTIER_MALLOC_TUNE=0: nothing is set (False), and both blocks are glibc's own mmaps."""
    assert probe("0") == {"on": False, "again": False, "in_heap": [False, False]}
