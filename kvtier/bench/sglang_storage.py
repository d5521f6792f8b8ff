"""``kvtier bench --case storage``: kvtier as SGLang's HiCache storage backend -- over shared memory
(``transport: shm``) and over gRPC streams (``transport: grpc``) -- vs SGLang's own file backend
(HiCacheFile) and vs the plain limit (one copy of the same page bytes), v1 + v2 set and get of the
same pages in the same run, bytes/s.

Runs :mod:`kvtier.bench.sglang_storage_worker` in an interpreter that imports SGLang 0.5.23
(``--sglang-python`` / ``KVTIER_SGLANG_PYTHON`` / this one); without one the case reports nothing
and says why. Bytes counted: a unit's KV part plus its live-layer indexer part, per page.
"""

from __future__ import annotations

import json
import subprocess

from kvtier.bench.case import BenchContext, Case, CaseResult, Comparison, throughput
from kvtier.bench.sglang_pool import find_sglang_python

TIMEOUT_S = 1800


class StorageCase(Case):
    name = "storage"
    title = "SGLang HiCache storage: kvtier backend (shared memory, gRPC) vs SGLang's file backend, same pages"

    def settings(self, ctx: BenchContext) -> dict:
        return {"model": "glm-5.2", "start": 20, "end": 40, "pages": 32 if ctx.quick else 128,
                "reps": 3 if ctx.quick else 9, "transports": "shm and grpc, one daemon on a unix socket",
                "host_layout": "page_first"}

    def run(self, ctx: BenchContext) -> CaseResult:
        s = self.settings(ctx)
        res = CaseResult(self.name, self.title, settings=s)
        python, why = find_sglang_python(ctx.sglang_python)
        if python is None:
            res.left_out["storage.*"] = why
            return res
        arg = json.dumps({**s, "workdir": str(ctx.workdir), "threads": 1})
        r = subprocess.run([python, "-m", "kvtier.bench.sglang_storage_worker", arg], capture_output=True, text=True,
                           timeout=TIMEOUT_S)
        if r.returncode != 0:
            raise RuntimeError(f"the SGLang storage worker failed: {r.stderr.strip().splitlines()[-3:]}")
        out = json.loads(r.stdout.strip().splitlines()[-1])
        t, nbytes = out["times"], out["bytes"]
        res.figures = {"unit_bytes": out["unit_bytes"], "pages": out["pages"], "bytes_per_call": nbytes,
                       "daemon_bytes": out["daemon_bytes"], "shm_staged_calls": out["shm_staged_calls"],
                       "shm_grpc_calls": out["shm_grpc_calls"]}

        def fig(path: str, op: str) -> object:
            label = {"shm": "kvtier backend, shared memory", "grpc": "kvtier backend, gRPC",
                     "file": "SGLang file backend", "plain": "plain copy of the page bytes"}[path]
            return throughput(f"{label} {op}", nbytes, t[f"{path}_{op}"])

        what = {"set": "batch_set_v2(indexer) + batch_set_v1", "get": "batch_get_v1 + batch_get_v2(indexer)"}
        for op in ("set", "get"):
            res.comparisons += [
                Comparison(f"storage.{op}_shm_vs_file", f"{what[op]}, shared memory vs HiCacheFile", "GB/s",
                           fig("shm", op), fig("file", op)),
                Comparison(f"storage.{op}_grpc_vs_file", f"{what[op]}, gRPC vs HiCacheFile", "GB/s",
                           fig("grpc", op), fig("file", op)),
                Comparison(f"storage.{op}_shm_vs_grpc", f"{what[op]}, shared memory vs gRPC (same daemon)", "GB/s",
                           fig("shm", op), fig("grpc", op)),
                Comparison(f"storage.{op}_shm_vs_plain", f"{what[op]}, shared memory vs one copy of the bytes", "GB/s",
                           fig("shm", op), fig("plain", op)),
            ]
        ctx.advance(1)
        return res
