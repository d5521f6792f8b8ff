"""The pool-copy benchmark still runs and counts the bytes it reports right (a smoke run, no timing)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_pool_copy.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_pool_copy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_reports_the_right_byte_counts(capsys):
    bench = load_bench()
    r = bench.run(size=1024, tokens=100, reps=1)
    latent = 78 * 100 * 656  # every layer, one 656-byte row a token
    pages = 2  # 100 tokens on whole allocator pages
    assert r["bytes"]["latent"] == latent
    assert r["bytes"]["index_k"] == 21 * pages * 8448
    assert r["bytes"]["skip_aware"] == latent + 21 * pages * 8448
    assert r["bytes"]["all_layers"] == latent + 78 * pages * 8448
    assert r["bytes"]["saved"] == 57 * pages * 8448
    assert all(v > 0 for v in r["seconds"].values()) and all(v > 0 for v in r["gb_per_s"].values())
    bench.print_table(r)
    assert "baseline" in capsys.readouterr().out
