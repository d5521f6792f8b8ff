"""The native parts compile without a warning (``-Wall -Werror``, as CI wants), while ``setup.py``
builds them with ``-Wall`` only so that a newer compiler's new warning never fails a user's
``pip install``. Each C file is compiled on its own to an object in a temp dir with the flags
setup.py gives it plus ``-Werror``."""

from __future__ import annotations

import shutil
import subprocess
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
