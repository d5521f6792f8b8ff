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


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["plain", "xdist"])
def test_the_final_line_names_slow_and_cuda_tests_left_out(workers):
    # worked out from the sources: test_replay.py marks one test slow; test_attach_cuda.py marks the module cuda
    replay = (TESTS / "cli" / "test_replay.py").read_text()
    cuda = (TESTS / "client" / "test_attach_cuda.py").read_text()
    assert replay.count("@pytest.mark.slow") == 1 and "pytestmark = pytest.mark.cuda" in cuda
    n_cuda = len(re.findall(r"^def test_", cuda, re.M))
    line = _final_line(*workers, "tests/cli/test_replay.py", "tests/client/test_attach_cuda.py", "-k",
                       "refuses_to_attach or cuda")
    assert "1 left out as slow (run: -m slow)" in line
    assert f"{n_cuda} left out as cuda (need a GPU: -m cuda)" in line
    assert "1 passed" in line
    assert re.search(r"\b\d+ deselected\b", line)  # what -k left out is still "deselected"
