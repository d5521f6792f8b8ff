"""Tests against the real SGLang 0.5.23: they run in .venv-sglang (scripts/build-sglang-env), started
by tests/integrations/test_sglang_suite.py from the default suite. Here SGLang is required: an import
failure is an error, never a skip."""

from __future__ import annotations

import sglang  # noqa: F401  (fails the run at once where SGLang is missing)
