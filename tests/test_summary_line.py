"""The suite's final line says how many tests the default run left out and why (slow, cuda), instead of
pytest's bare "N deselected" (tests/conftest.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _final_line(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], cwd=TESTS.parent,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip().splitlines()[-1]


def _marked(path: str, mark: str) -> int:
    """How many tests of ``path`` carry ``mark``, by pytest's own collection (no summary hook involved)."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--collect-only",
                        "-o", "addopts=", "-m", mark, path], cwd=TESTS.parent, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return sum("::" in line for line in r.stdout.splitlines())


REPLAY, CUDA = "tests/cli/test_replay.py", "tests/client/test_attach_cuda.py"


@pytest.fixture(scope="module")
def marked() -> tuple[int, int]:
    """Worked out apart from the hook: pytest's own collection with -m counts each file's marked tests
    (once for both parametrizations)."""
    n_slow, n_cuda = _marked(REPLAY, "slow"), _marked(CUDA, "cuda")
    assert n_slow >= 1 and n_cuda >= 1  # else the test would check nothing
    return n_slow, n_cuda


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["plain", "xdist"])
def test_the_final_line_names_slow_and_cuda_tests_left_out(workers, marked):
    n_slow, n_cuda = marked
    line = _final_line(*workers, REPLAY, CUDA, "-k", "refuses_to_attach or cuda")
    assert f"{n_slow} left out as slow (run: -m slow)" in line
    assert f"{n_cuda} left out as cuda (need a GPU: -m cuda)" in line
    assert "1 passed" in line
    assert re.search(r"\b\d+ deselected\b", line)  # what -k left out is still "deselected"
