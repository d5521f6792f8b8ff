"""The native parts compile without a warning (``-Wall -Werror``, as CI wants), while ``setup.py``
builds them with ``-Wall`` only so that a newer compiler's new warning never fails a user's
``pip install``. Each C file is compiled on its own to an object in a temp dir with the flags
setup.py gives it plus ``-Werror``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*ROOT.glob("server/**/*.c"), *ROOT.glob("kvtier/**/*.c"), *ROOT.glob("client/**/*.c")])


def test_the_native_sources_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in SOURCES}
    assert {"server/tiers/_recordio.c", "server/tiers/_copy_xxh3.c", "kvtier/_streamcopy.c"} <= names


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_compiles_without_warnings(src, tmp_path):
    cc = shutil.which("gcc")
    assert cc, "gcc is required to build kvtier's native parts (README, Start here)"
    cmd = [cc, "-c", "-O3", "-std=c11", "-Wall", "-Werror", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
           str(src), "-o", str(tmp_path / "out.o")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_the_install_goes_on_without_a_compiler_and_the_stand_ins_serve(tmp_path):
    """Where the native parts cannot be built (here: a compiler that always fails, as a machine without
    the xxHash headers fails ``_recordio``), ``setup.py build`` still succeeds and builds no extension:
    both are optional (a GPU machine without internet installs kvtier so)."""
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'no compiler here' >&2\nexit 1\n")
    cc.chmod(0o755)
    env = {**os.environ, "CC": str(cc), "LDSHARED": f"{cc} -shared"}
    r = subprocess.run([sys.executable, "setup.py", "-q", "build", "--build-base", str(tmp_path / "build")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not list((tmp_path / "build").rglob("*.so"))
    assert "_recordio" in r.stderr and "_streamcopy" in r.stderr  # each failure is reported, not fatal


def test_the_native_parts_are_built_and_used_here():
    """Where the suite runs (CI, a developer's checkout) the extensions are built: a silently missing
    one would run the slower stand-ins unnoticed."""
    from kvtier.native import status

    assert status() == {"kvtier.server.tiers._recordio": True, "kvtier._streamcopy": True}


def test_with_KVTIER_NATIVE_0_every_user_of_a_native_part_takes_its_stand_in():
    """The disk tier's reads, the daemon's in-place write and the client's ReadKV receive each bind
    the pure-Python module when the native ones are off (the path a machine without them takes)."""
    code = ("import kvtier.server.tiers.disk_reads as d, kvtier.server.daemon.kv_write as w, kvtier.client.pool as c, "
            "kvtier.native as n; print(d._recordio.__name__, w.replace.__module__, c.copy_into.__module__, "
            "sorted(n.status().values()))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "KVTIER_NATIVE": "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["kvtier.server.tiers.recordio_py", "kvtier.streamcopy_py", "kvtier.streamcopy_py",
                                "[False,", "False]"]
