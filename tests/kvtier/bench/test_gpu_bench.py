"""``kvtier.bench.gpu`` (what ``scripts/gpu-check`` runs on a GPU), on the CPU device where torch
allows: byte counts, comparison keys and targets, the byte-exact and planned-pool checks with values
worked out here, and results.json's verdict. Timings are figures, never asserted. The CUDA-only
parts (page-locked chunks, the CUDA allocator's count) are the ``cuda``-marked tests at the end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvtier.bench import gpu
from kvtier.bench.case import Comparison, Figure

LATENT_ROW, INDEX_PAGE, LAYERS, LIVE, PAGE = 656, 8448, 78, 21, 64  # GLM-5.2 fp8 (DESIGN.md)


def planned_bytes(tokens: int) -> int:
    return LAYERS * (tokens + PAGE) * LATENT_ROW + LIVE * ((tokens + PAGE + 1) // PAGE) * INDEX_PAGE


def test_link_copies_on_the_cpu_device_moves_the_request_bytes_exactly():
    r = gpu.link_copies("cpu", pool_tokens=2048, request_tokens=512, reps=2, warmup=1)
    assert r["figures"]["bytes"] == LAYERS * 512 * LATENT_ROW + LIVE * (512 // PAGE) * INDEX_PAGE
    assert [c.key for c in r["comparisons"]] == ["gpu.get_cpu_copy_vs_link", "gpu.load_cpu_copy_vs_link"]
    assert all(c.target == 0.8 and c.unit == "GB/s" and len(c.kvtier.samples) == 2 for c in r["comparisons"])
    assert all(math.isfinite(c.ratio) and c.ratio > 0 for c in r["comparisons"])
    assert r["checks"] == {"copy_byte_exact": {"ok": True, "what": r["checks"]["copy_byte_exact"]["what"]}}


def test_a_request_larger_than_half_the_pool_is_refused():
    with pytest.raises(ValueError, match="do not fit"):
        gpu.link_copies("cpu", pool_tokens=1024, request_tokens=1024, reps=1)


def test_the_planned_pool_holds_exactly_the_planned_bytes():
    """64 MiB: the exact plan's tokens are the most whole pages whose bytes fit (worked out here by
    walking up a page at a time), and the pool's arenas hold exactly those bytes."""
    budget = 64 << 20
    tokens = 0
    while planned_bytes(tokens + PAGE) <= budget:
        tokens += PAGE
    r = gpu.planned_pool("cpu", budget)
    assert r == {"ok": True, "tokens": tokens, "available_bytes": budget, "planned_bytes": planned_bytes(tokens),
                 "pool_bytes": planned_bytes(tokens), "cuda_allocated_delta": None}


def test_the_served_planned_pool_reports_the_planned_bytes():
    r = gpu.served_planned_pool("cpu", 32 << 20)
    assert r["ok"] is True and r["served_device"] == "cpu"
    assert r["served_bytes"] == r["planned_bytes"] == planned_bytes(r["tokens"])


def _cmp(ratio_samples: tuple[float, float], target: float | None) -> Comparison:
    k, b = ratio_samples
    return Comparison("gpu.x", "x", "GB/s", Figure("k", k, [k]), Figure("b", b, [b]), target=target)


def test_the_verdict_names_failed_tests_checks_and_missed_targets():
    ok_copies = {"comparisons": [_cmp((9.0, 10.0), 0.8)], "checks": {"copy_byte_exact": {"ok": True}}, "figures": {}}
    tests = {"passed": 20, "failed": 0, "errors": 0, "skipped": 0, "exit_code": 0}
    doc = gpu.gpu_document("cpu", copies=ok_copies, checks={"planned_pool": {"ok": True}}, tests=tests)
    assert doc["ok"] is True and gpu.failures(doc) == []
    assert doc["comparisons"][0]["ratio"] == pytest.approx(0.9) and doc["comparisons"][0]["meets_target"] is True
    slow = {**ok_copies, "comparisons": [_cmp((7.0, 10.0), 0.8)]}
    bad = gpu.gpu_document("cpu", copies=slow, checks={"planned_pool": {"ok": False}},
                           tests={**tests, "failed": 2, "exit_code": 1})
    assert bad["ok"] is False
    assert gpu.failures(bad) == ["tests (2 failed, 0 errors, exit 1)", "check planned_pool", "gpu.x 0.70x < 0.8x"]
    assert json.loads(json.dumps(bad, default=str))["ok"] is False  # plain JSON


def test_the_module_run_writes_results_json_and_exits_by_its_verdict(tmp_path):
    """``python -m kvtier.bench.gpu --device cpu --quick`` with a test summary given: results.json holds
    the tests, every check, both comparisons and the machine; its exit status follows ``ok``."""
    tests = tmp_path / "tests.json"
    tests.write_text(json.dumps({"summary": {"passed": 3, "failed": 0, "errors": 0, "skipped": 0, "exit_code": 0},
                                 "checks": {"cuda_ipc_attach": {"ok": True}}}))
    rc = gpu.main(["--device", "cpu", "--quick", "--out", str(tmp_path / "o"), "--tests", str(tests)])
    doc = json.loads((tmp_path / "o" / "results.json").read_text())
    assert set(doc) == {"kvtier_gpu_check", "device", "started", "machine", "tests", "checks", "comparisons", "figures", "ok"}
    assert set(doc["checks"]) == {"cuda_ipc_attach", "planned_pool", "served_planned_pool", "copy_byte_exact"}
    assert all(doc["checks"][k]["ok"] for k in doc["checks"])
    assert doc["tests"]["passed"] == 3 and doc["figures"]["copies"]["bytes"] == LAYERS * 1024 * LATENT_ROW + LIVE * 16 * INDEX_PAGE
    assert rc == (0 if doc["ok"] else 1) and doc["ok"] == (not gpu.failures(doc))


@pytest.mark.cuda
def test_on_cuda_the_copy_is_page_locked_and_byte_exact():
    r = gpu.link_copies("cuda", pool_tokens=4096, request_tokens=1024, reps=2, warmup=1)
    assert r["checks"]["copy_byte_exact"]["ok"] and r["checks"]["host_copy_page_locked"]["ok"]


@pytest.mark.cuda
def test_on_cuda_the_planned_pool_is_the_allocators_count_to_the_rounding():
    r = gpu.planned_pool("cuda", 256 << 20)
    assert r["ok"] and r["pool_bytes"] == planned_bytes(r["tokens"])
    assert r["planned_bytes"] <= r["cuda_allocated_delta"] < r["planned_bytes"] + 512 * 2
    assert torch.cuda.is_available()
