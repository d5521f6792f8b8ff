"""``scripts/gpu-check``: the part that needs no GPU. Its arguments and environment are checked
before anything is installed or written (one line, exit 2), on this machine it says there is no GPU
(exit 2, OUT_DIR not created), and its reading of pytest's junit XML into results.json's test
summary and checks is run on a real junit file of this machine's ``-m cuda`` run of one file (its
one test fails here: no device). The GPU run itself is issue 26's part 2."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: ") and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_help_gives_the_wheel_download_command_for_the_gpu_machines_python():
    r = run("--help")
    assert r.returncode == 0
    for part in ("pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp",
                 "--platform manylinux_2_17_x86_64", "grpcio==", "grpcio-health-checking==", "grpcio-reflection==",
                 "protobuf==", "lmdb==", "scripts/gpu-check OUT_DIR --wheels .whl"):
        assert part in r.stdout, part


def test_the_pinned_wheels_are_the_versions_this_checkout_is_tested_with():
    """The download command's pins equal the installed grpcio, protobuf and lmdb (the generated stubs
    and the tests ran with these). They are read from the environment: a fixed list went stale when
    PyPI moved (grpcio 1.85.3 -> 1.85.4) and failed this test on a fresh install."""
    from importlib.metadata import version

    text = run("--help").stdout
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "lmdb"):
        assert f" {name}=={version(name)}" in text.replace("\\\n", " "), name


@pytest.mark.parametrize("args, words", [
    ((), ["OUT_DIR is required"]),
    (("out", "--bogus"), ["unknown option --bogus"]),
    (("a", "b"), ["one OUT_DIR only"]),
    (("out", "--wheels"), ["--wheels needs a directory"]),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, args, words):
    r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    one_line_error(r, *words)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_wheels_folder_that_is_missing_or_empty_is_refused(tmp_path):
    one_line_error(run(str(tmp_path / "out"), "--wheels", str(tmp_path / "nope")), "is not a directory")
    (tmp_path / "empty").mkdir()
    one_line_error(run(str(tmp_path / "out"), "--wheels", str(tmp_path / "empty")), "holds no .whl files")
    (tmp_path / "file").write_text("x")
    one_line_error(run(str(tmp_path / "file")), "exists and is not a directory")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "x-1.0-py3-none-any.whl").write_bytes(b"")
    r = run(str(tmp_path / "out"), "--wheels", str(tmp_path / "w"))
    one_line_error(r, "no CUDA GPU here", f"torch {torch.__version__}")
    assert not (tmp_path / "out").exists()  # nothing installed or written


def _script_module():
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_junit_outcomes_become_the_test_summary_and_the_checks(tmp_path):
    """A real junit file: this machine's ``pytest -m cuda`` of the host arena's tests (one cuda test,
    failing here for want of a device): 1 failed, its check not ok and naming the test; the other
    checks' tests did not run, so they are not ok either ("not run")."""
    gc = _script_module()
    junit = tmp_path / "j.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}",
                        "tests/server/hostmem/test_arena.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-2000:]
    summary, checks = gc.read_junit(junit, r.returncode)
    assert summary == {"passed": 0, "failed": 1, "errors": 0, "skipped": 0, "exit_code": 1,
                       "failures": ["tests/server/hostmem/test_arena.py::test_cuda_arena_is_page_locked_for_dma"]}
    assert checks["page_locked_host_arena"] == {"ok": False, "test": gc.TEST_CHECKS["page_locked_host_arena"], "outcomes": ["failed"]}
    assert checks["cuda_ipc_attach"]["ok"] is False and checks["cuda_ipc_attach"]["outcomes"] == ["not run"]
    assert set(checks) == {"cuda_ipc_attach", "page_locked_host_arena", "pinned_host_tier_round_trip"}


def test_every_check_names_a_cuda_test_that_exists():
    """A renamed test would turn its check into "not run" on the GPU machine: each named test is
    collected by ``-m cuda`` here."""
    gc = _script_module()
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "--collect-only", "-q", "-p", "no:cacheprovider",
                        *sorted({n.split("::")[0] for n in gc.TEST_CHECKS.values()})], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    collected = set(r.stdout.split())
    for node in gc.TEST_CHECKS.values():
        assert node in collected, node


def test_the_files_it_runs_hold_every_cuda_test_but_mooncakes():
    """``pytest -m cuda`` over the whole tree here collects exactly the tests of the files the script
    runs (plus the Mooncake one it leaves out): no cuda test is missed when one is added elsewhere."""
    gc = _script_module()
    files = gc.cuda_test_files()
    assert "tests/client/test_attach_cuda.py" in files and "tests/kvtier/bench/test_gpu_bench.py" in files
    assert not any("mooncake" in f for f in files)
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    collected = {line.split("::")[0] for line in r.stdout.split() if "::" in line}
    assert collected == set(files) | set(gc.LEFT_OUT), collected ^ (set(files) | set(gc.LEFT_OUT))


def test_a_site_folder_it_did_not_make_is_never_emptied(tmp_path):
    """--site is emptied before the install: a folder that holds files and not gpu-check's mark is
    refused (one line, exit 2) and keeps its files."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "precious").write_text("keep")
    one_line_error(run(str(tmp_path / "out"), "--site", str(site)), "is not a folder gpu-check made")
    assert (site / "precious").read_text() == "keep" and not (tmp_path / "out").exists()


def test_host_copies_adds_each_thread_counts_ratios_to_results_json(tmp_path):
    """The part-3 step on this machine's cores (a real ``kvtier bench --case copies --quick`` per
    thread count): results.json keeps what it held and gains ``host_copies`` with, for 1 thread and for
    the cores, the copies' ratios, the issue's targets (0.8x and 0.9x of plain) and the load average."""
    import os

    gc = _script_module()
    (tmp_path / "results.json").write_text('{"ok": true}')
    logs = []

    def run_(cmd, timeout, **kw):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
        logs.append(p.stdout + p.stderr)
        return p.returncode

    gc.host_copies(tmp_path, dict(os.environ), run_, quick=True)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["ok"] is True
    assert set(doc["host_copies"]) == {"1", str(min(os.cpu_count(), 64))}, logs
    for entry in doc["host_copies"].values():
        assert entry["targets"]["copies.get_cpu_copy_vs_plain"] == 0.8 and entry["targets"]["copies.load_cpu_copy_vs_plain"] == 0.9
        assert entry["ratios"]["copies.get_cpu_copy_vs_plain"] > 0 and len(entry["load_average"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # the runs' plots are not kept
