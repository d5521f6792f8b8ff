"""SGLang's own pool as a baseline: find an interpreter that imports SGLang, drive its worker.

SGLang 0.5.23 needs torch 2.14.1, kvtier's environment may have another torch, so the pool runs in
a worker process (:mod:`kvtier.bench.sglang_worker`) of an interpreter that imports SGLang: the one
given (``--sglang-python`` / ``KVTIER_SGLANG_PYTHON``), else this one if it imports SGLang. Each
call is timed inside the worker (no pipe in the figure); the main process waits, idle, meanwhile,
so a round of the copy case still runs kvtier, the plain copy and SGLang one after another.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("sglang_worker.py")
ENV_VAR = "KVTIER_SGLANG_PYTHON"
START_TIMEOUT_S = 300.0


def find_sglang_python(given: str | None) -> tuple[str | None, str]:
    """``(interpreter, why)``: the interpreter to run SGLang's pool with, or None and the reason."""
    if given:
        return (given, "given") if Path(given).exists() else (None, f"{given} does not exist")
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return (env, f"${ENV_VAR}") if Path(env).exists() else (None, f"${ENV_VAR}={env} does not exist")
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable, "this interpreter imports sglang"
    return None, (f"sglang is not importable here; pass --sglang-python PATH (or set {ENV_VAR}) to an "
                  "interpreter with sglang==0.5.23 to compare with SGLang's own pool")


class SGLangPool:
    """A worker process holding SGLang's ``DSATokenToKVPool`` with kvtier's geometry and slots.

    Args:
        python: interpreter that imports SGLang.
        setup: the worker's first line (see :mod:`kvtier.bench.sglang_worker`).

    Raises:
        RuntimeError: the worker died or answered something else than ready (its stderr tail says why).
    """

    def __init__(self, python: str, setup: dict[str, Any]) -> None:
        self._stderr = tempfile.TemporaryFile(mode="w+")  # SGLang warns a lot on import: never a full pipe
        self._proc = subprocess.Popen([python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, text=True)
        self.info = self._ask(json.dumps(setup))
        if not self.info.get("ready"):
            raise RuntimeError(f"SGLang worker did not start: {self.info}")

    def _ask(self, line: str) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
            answer = self._proc.stdout.readline()
        except BrokenPipeError:
            answer = ""
        if not answer:
            self._proc.kill()
            self._proc.wait()
            self._stderr.seek(0)
            raise RuntimeError(f"SGLang worker exited: {self._stderr.read().strip().splitlines()[-5:]}")
        return json.loads(answer)

    def get(self) -> float:
        """Seconds of one ``pool.get_cpu_copy(src)``."""
        return float(self._ask("get")["seconds"])

    def load(self) -> float:
        """Seconds of one ``pool.load_cpu_copy(copy, dst)``."""
        return float(self._ask("load")["seconds"])

    def check(self) -> bool:
        """Whether the destination slots hold the source's bytes."""
        return bool(self._ask("check")["ok"])

    def close(self) -> None:
        """Stop the worker (it frees its pool)."""
        if self._proc.poll() is None and self._proc.stdin is not None:
            try:
                self._proc.stdin.write("quit\n")
                self._proc.stdin.flush()
            except BrokenPipeError:
                pass
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for f in (self._proc.stdin, self._proc.stdout, self._stderr):
            if f is not None:
                f.close()
