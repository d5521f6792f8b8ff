"""``kvtier bench``: kvtier against the plain limit of the same bytes (and SGLang's own pool), as ratios."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import click

from kvtier.private_writes import OutputPathError, check_output_path, private_dirs


def _case_names() -> list[str]:
    return ["capacity", "copies", "disk", "daemon", "attach", "pd", "mooncake", "replay", "policy", "storage"]


@click.command(short_help='Measure kvtier against plain baselines of the same bytes (ratios, plots).')
@click.option("--quick", is_flag=True, help="Small sizes and few repetitions (the whole run takes under 2 minutes).")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-results"),
              show_default=True, help="Directory for results.json and one PNG plot per comparison.")
@click.option("--json", "as_json", is_flag=True, help="Print results.json to stdout (progress goes to stderr).")
@click.option("--case", "only", multiple=True, metavar="NAME",
              help=f"Run only this case (repeatable): {', '.join(_case_names())}.")
@click.option("--sglang-python", default=None, metavar="PATH", envvar="KVTIER_SGLANG_PYTHON",
              help="Interpreter that imports sglang==0.5.23, to compare with SGLang's own pool "
                   "(env KVTIER_SGLANG_PYTHON). Default: this interpreter, if it imports sglang.")
@click.option("--torch-threads", type=click.IntRange(min=1, max=64), default=None,
              help="Threads for every case: torch's intra-op threads (the plain baselines' copies) and "
                   "the threads kvtier's host copies split over (the daemon's --copy-threads). "
                   "Default: torch 1 (as the daemon runs), kvtier's copies the machine's cores.")
@click.option("--check", is_flag=True,
              help="Exit with status 1 when a comparison misses its target (the results are written first).")
def bench(quick: bool, out: Path, as_json: bool, only: tuple[str, ...], sglang_python: str | None,
          torch_threads: int | None, check: bool) -> None:
    """Measure kvtier against plain baselines of the same bytes, in one run.

    Each case times kvtier and its baseline interleaved (medians after a warm-up) and reports
    kvtier's figure, the baseline's and the ratio (> 1: kvtier better): capacity, get_cpu_copy /
    load_cpu_copy, disk spill and restore, the daemon's data path vs a gRPC echo, a worker's KV
    write+read through an attached pool vs in-process tensors and gRPC, PullKV vs raw Mooncake reads,
    the Mooncake Store tier vs its store client, a replay of the Mooncake trace, and SGLang's HiCache
    storage through kvtier vs SGLang's file backend. Writes OUT/results.json and a plot per comparison.
    """
    if sglang_python is not None and not (os.path.isfile(sglang_python) and os.access(sglang_python, os.X_OK)):
        raise click.BadParameter(f"{sglang_python} is not an executable file; give an interpreter that imports "
                                 "sglang==0.5.23 (scripts/build-sglang-env builds .venv-sglang/bin/python)",
                                 param_hint="--sglang-python / KVTIER_SGLANG_PYTHON")
    early = [n for n in only if n not in _case_names()]  # before torch and the cases load
    if early:
        raise click.BadParameter(f"unknown case {early[0]!r}; cases: {', '.join(_case_names())}", param_hint="--case")
    os.environ.setdefault("GLOG_minloglevel", "2")  # the Mooncake engines' and store clients' INFO lines
    import torch
    from rich.console import Console

    from kvtier.bench import BenchCaseError, BenchContext, all_cases, run_cases
    from kvtier.bench.report import print_table, results_document, write_outputs

    cases = all_cases()
    known = [c.name for c in cases]
    unknown = [n for n in only if n not in known]
    if unknown:
        raise click.BadParameter(f"unknown case {unknown[0]!r}; cases: {', '.join(known)}", param_hint="--case")
    if only:
        cases = [c for c in cases if c.name in only]
    try:
        # the way to it checked before any directory is made there (A8-12), and what is at results.json (A7-6)
        if os.path.lexists(out) and not os.path.isdir(out):  # a device node, a FIFO, a socket: never written through
            raise OutputPathError(f"--out {out} exists and is not a directory; pass a directory (made if missing)")
        check_output_path(Path(out) / "results.json", "--out file")
        private_dirs(out, "--out")  # 0700 (and any parent it makes): the results are this user's alone, whatever the umask
    except OutputPathError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"cannot create --out directory {out}: {e.strerror}; pass another --out DIR") from None
    console = Console(stderr=True) if as_json else Console(width=None if sys.stdout.isatty() else 160)
    from kvtier.server.pool.device_copy import copy_threads, set_copy_threads

    torch.set_num_threads(torch_threads or 1)
    if torch_threads is not None:
        set_copy_threads(torch_threads)
    load_before = list(os.getloadavg())
    started = time.time()
    try:
        work = Path(tempfile.mkdtemp(prefix=".kvtier-bench-", dir=out))  # same file system as --out (fsync is real)
    except OSError as e:
        raise click.ClickException(f"cannot make a work directory in --out {out}: {e.strerror}; pass another --out DIR") from None
    try:
        results = run_cases(cases, lambda _case: BenchContext(quick=quick, workdir=work, sglang_python=sglang_python),
                            console=console)
    except BenchCaseError as e:
        raise click.ClickException(f"{e} (rerun with --case NAME to isolate it)") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = results_document(results, {"quick": quick, "cases": [c.name for c in cases], "torch_threads": torch_threads or 1,
                                          "copy_threads": copy_threads()}, started, load_before)
    try:
        written = write_outputs(doc, results, out)
    except OSError as e:  # a plot path that is not a regular file (OutputPathError), a full disk
        raise click.ClickException(f"cannot write the results to --out {out}: {e.strerror or e}") from None
    if as_json:
        click.echo(json.dumps(doc, indent=1, default=str))
    else:
        print_table(results, console)
        m = doc["machine"]
        console.print(f"load average {m['load_average_before'][0]:.1f} before, {m['load_average'][0]:.1f} after: one run's "
                      "ratios move with the machine's load; compare repeated runs (docs/benchmarks/fixes.md, 'Still unmet')")
        console.print(f"wrote {written[0]} and {len(written) - 1} plots")
    missed = [c.key for r in results for c in r.comparisons if c.meets_target is False]
    if check and missed:
        click.echo(f"error: {len(missed)} comparison(s) missed their target: {', '.join(missed)}; "
                   f"see {written[0]}", err=True)
        raise SystemExit(1)
