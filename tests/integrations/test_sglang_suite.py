"""Runs tests/integrations/sglang in its own environment (SGLang 0.5.23 wants torch 2.14.1).

The environment is built by ``scripts/build-sglang-env`` (``.ci/run`` does it); ``KVTIER_SGLANG_PYTHON``
points at another interpreter. Missing is a failure, not a skip: SGLang support is part of kvtier.
Tests marked ``slow`` there are left out, as in the default suite (run them with ``-m slow``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sglang_integration_suite_passes_in_its_environment():
    python = Path(os.environ.get("KVTIER_SGLANG_PYTHON", ROOT / ".venv-sglang" / "bin" / "python"))
    assert python.exists(), (f"{python} is missing: build the SGLang test environment with scripts/build-sglang-env "
                             f"(or set KVTIER_SGLANG_PYTHON)")
    r = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                        "-m", "not slow", "tests/integrations/sglang"], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"SGLang integration tests failed (rc {r.returncode}):\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
