"""``kvtier bench --quick --out DIR --json`` (the default suite a subset of the cases, ``slow`` all of
them): every case reports, every comparison has a finite ratio and a plot, results.json equals what --json printed. Not a timing assertion: the ratios'
values are figures, only their presence and finiteness are checked (and the byte counts, which are
not timings)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from kvtier.bench.report import plot_name

CASES = {"capacity", "copies", "disk", "daemon", "attach", "pd", "mooncake", "replay", "policy", "storage"}
DEFAULT_CASES = ("capacity", "copies", "disk", "attach", "policy", "storage")
"""The default suite runs these (about 25 s of the 80 s --quick takes); the slow test runs every case."""
NEEDS_SGLANG = {"storage"}  # run here without KVTIER_SGLANG_PYTHON: reports why it measured nothing


def _quick(out, cases=()):
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_SGLANG_PYTHON"}
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "--quick", "--out", str(out), "--json",
                        *[a for c in cases for a in ("--case", c)]],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, json.loads(r.stdout), r.stderr


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    return _quick(tmp_path_factory.mktemp("bench") / "out", DEFAULT_CASES)


def _check_reports(out, doc, cases):
    """Every case reports, every comparison has a finite ratio and a plot, results.json equals --json."""
    assert set(doc["cases"]) == set(cases)
    for name, case in doc["cases"].items():
        assert case["comparisons"] or (name in NEEDS_SGLANG and case["left_out"]), name
        for c in case["comparisons"]:
            assert math.isfinite(c["ratio"]) and c["ratio"] > 0, (name, c["key"], c["ratio"])
            assert math.isfinite(c["kvtier"]["value"]) and math.isfinite(c["baseline"]["value"])
            png = out / plot_name_of(c["key"])
            assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert json.loads((out / "results.json").read_text()) == doc


def _check_byte_counts(doc):
    """Computed, not timed: a 4,096-token GLM-5.2 copy holds 78 x 4096 x 656 latent bytes plus 21 of 78
    layers' page rows (64 pages x 8448); the capacity case's token counts."""
    b = doc["cases"]["copies"]["figures"]["bytes"]
    assert b["latent"] == 78 * 4096 * 656 and b["index_k"] == 21 * 64 * 8448 and b["all_layers"] == b["latent"] + 78 * 64 * 8448
    cap = {c["key"]: c for c in doc["cases"]["capacity"]["comparisons"]}
    assert cap["capacity.glm-5.2.sglang"]["kvtier"]["value"] == 2_813_952
    assert cap["capacity.glm-5.2.sglang"]["baseline"]["value"] == 2_430_528


def test_every_case_reports_comparisons_with_finite_ratios_and_a_plot_each(quick_run):
    out, doc, _ = quick_run
    _check_reports(out, doc, DEFAULT_CASES)


@pytest.mark.slow
def test_the_whole_quick_run_reports_every_case_and_the_moved_bytes(tmp_path):
    """``kvtier bench --quick`` with every case, as CI's benchmark step runs it: the checks above, plus
    the cases the default suite leaves out: PullKV moves the 4,096-token request's bytes in 99 ranges
    (one a layer, 78 latent + 21 index_k), the replay's hits equal the simulation's, and every case's
    target is the issue's."""
    out, doc, _ = _quick(tmp_path / "out")
    _check_reports(out, doc, CASES)
    _check_byte_counts(doc)
    assert doc["cases"]["replay"]["figures"]["equal_to_simulate"] is True
    pd = doc["cases"]["pd"]["figures"]["bytes"]  # the same 4,096-token request, pulled in one range a layer
    assert pd["total"] == 78 * 4096 * 656 + 21 * 64 * 8448 and pd["ranges"] == 78 + 21
    targets = {c["key"]: c["target"] for case in doc["cases"].values() for c in case["comparisons"]}
    assert targets["pd.pullkv_vs_raw_read"] == targets["pd.pullkv_vs_raw_ranges"] == 0.9
    assert targets["daemon.read_vs_echo"] == 0.9
    assert targets["daemon.write_vs_echo"] == targets["daemon.write_new_vs_echo"] == 0.9


def test_results_name_the_machine_settings_and_issue_targets(quick_run):
    _, doc, stderr = quick_run
    m = doc["machine"]
    assert m["cores"] and m["packages"]["torch"] and m["python"]
    assert doc["settings"]["quick"] is True and doc["settings"]["torch_threads"] == 1
    targets = {c["key"]: c["target"] for case in doc["cases"].values() for c in case["comparisons"]}
    assert targets["copies.get_cpu_copy_vs_plain"] == 0.8 and targets["disk.spill_fsync_vs_file"] == 0.9
    assert targets["attach.write_vs_in_process"] == 0.9 and targets["attach.read_vs_in_process"] == 0.9
    assert targets["policy.device_hits_vs_lru"] == 1.5 and targets["policy.disk_bytes_written_vs_lru"] == 2.0
    assert "copies" in stderr  # progress went to stderr, the JSON alone to stdout


def test_byte_counts_are_the_skip_aware_layouts(quick_run):
    _check_byte_counts(quick_run[1])


def plot_name_of(key: str) -> str:
    class _C:  # plot_name takes a comparison; only its key matters
        pass

    c = _C()
    c.key = key  # type: ignore[attr-defined]
    return plot_name(c)  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_sglang_python_that_is_not_an_interpreter_is_a_usage_error_before_anything_runs(tmp_path, how):
    """A given --sglang-python (or KVTIER_SGLANG_PYTHON) that does not exist or cannot run is exit 2 with
    click's usage error naming it, and nothing is measured or written (it used to run and report the
    SGLang rows as left out)."""
    out, missing = tmp_path / "out", str(tmp_path / "no-such-python")
    not_exec = tmp_path / "python"
    not_exec.write_text("#!/bin/sh\n")
    for bad in (missing, str(not_exec)):
        env = {k: v for k, v in os.environ.items() if k != "KVTIER_SGLANG_PYTHON"}
        args = [sys.executable, "-m", "kvtier.cli", "bench", "--case", "capacity", "--out", str(out)]
        if how == "flag":
            args += ["--sglang-python", bad]
        else:
            env["KVTIER_SGLANG_PYTHON"] = bad
        r = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert "Traceback" not in r.stderr and f"{bad} is not an executable file" in r.stderr
        assert not out.exists()


def test_bench_output_is_this_users_alone_under_umask_022(tmp_path):
    """Regression (attack pass F1): under umask 022 ``kvtier bench --out`` made its directory (and the
    parents it created) 0755 and ``results.json`` and every plot 0644, readable by every local user.
    Now, in a 0755 parent, the directories it makes are 0700 and its files 0600; the parent is left as it was."""
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o755)
    out = parent / "new" / "out"
    r = subprocess.run(["sh", "-c", 'umask 022; exec "$0" -m kvtier.cli bench --quick --case capacity --out "$1"',
                        sys.executable, str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    modes = {p.relative_to(parent).as_posix(): p.stat().st_mode & 0o777 for p in [parent, *parent.rglob("*")]}
    files = [name for name in modes if name.endswith((".json", ".png"))]
    assert "new/out/results.json" in files and any(name.endswith(".png") for name in files)
    assert modes == {".": 0o755, "new": 0o700, "new/out": 0o700, **{name: 0o600 for name in files}}, modes


def test_bench_refuses_an_out_directory_through_another_users_symlink(tmp_path, others_symlink):
    """Attack pass 8, A8-12: ``kvtier bench --out`` through another user's symlink in a sticky
    directory made its directory, results.json and plots inside the root-only directory the symlink
    points at. Now it is refused (one line naming the symlink's owner) before anything is made."""
    sticky, victim = others_symlink
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "--quick", "--case", "capacity",
                        "--out", str(sticky / "evil" / "benchout")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r.stdout
    assert f"symlink {sticky / 'evil'} is owned by uid 65534" in r.stderr and "Traceback" not in r.stderr
    assert os.listdir(victim) == []


@pytest.mark.parametrize("kind", ["fifo", "char-device"])
def test_bench_refuses_an_out_that_is_a_device_node_or_a_fifo_in_one_line(kind, make_node):
    """Attack pass 9, A9-5: ``kvtier bench --out /dev/null`` (or a FIFO) ended in a traceback from the
    work directory it tried to make inside. It is refused at start in one line, and the node is left
    as it was. (Our own node, never the real /dev/null.)"""
    import stat

    node = make_node(kind)
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "--quick", "--case", "capacity", "--out", str(node)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and f"--out {node} exists and is not a directory" in r.stderr, r.stderr
    mode = os.lstat(node).st_mode
    assert (stat.S_ISFIFO(mode) if kind == "fifo" else stat.S_ISCHR(mode))
