"""``kvtier bench``: kvtier against the plain limit of the same bytes, in one run, as ratios.

One module per case (:mod:`kvtier.bench.case` holds the interface); :data:`CASES` lists them in run
order. :func:`run_cases` runs a selection with a progress bar each and returns their results;
:mod:`kvtier.bench.report` writes ``results.json``, the plots and the table.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.bench.case import BenchContext, Case, CaseResult, Comparison, Figure, interleaved


def all_cases() -> list[Case]:
    """Every case, in run order (imported here so that ``kvtier --help`` stays fast)."""
    from kvtier.bench.attach import AttachCase
    from kvtier.bench.capacity import CapacityCase
    from kvtier.bench.copies import CopiesCase
    from kvtier.bench.daemon_io import DaemonIOCase
    from kvtier.bench.disk import DiskCase
    from kvtier.bench.mooncake import MooncakeCase
    from kvtier.bench.pd_transfer import PDTransferCase
    from kvtier.bench.policy import PolicyCase
    from kvtier.bench.replay import ReplayCase
    from kvtier.bench.sglang_storage import StorageCase

    return [CapacityCase(), CopiesCase(), DiskCase(), DaemonIOCase(), AttachCase(), PDTransferCase(), MooncakeCase(),
            ReplayCase(), PolicyCase(), StorageCase()]


class BenchCaseError(RuntimeError):
    """A case failed (a wrong byte, a dead daemon, a missing part): names the case and why."""


def run_cases(cases: list[Case], ctx_for: Callable[[Case], BenchContext], *, console: object = None) -> list[CaseResult]:
    """Run ``cases`` one after another, each with a progress bar on ``console`` (a rich Console)."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results = []
    with Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:  # type: ignore[arg-type]
        for case in cases:
            ctx = ctx_for(case)
            total = case.steps(ctx)
            task = progress.add_task(case.name, total=total)
            ctx.advance = lambda n=1, task=task: progress.advance(task, n)
            t0 = time.perf_counter()
            try:
                res = case.run(ctx)
            except Exception as e:  # noqa: BLE001 - the CLI turns it into a one-line error
                raise BenchCaseError(f"case {case.name!r} failed: {type(e).__name__}: {e}") from e
            res.seconds = time.perf_counter() - t0
            progress.update(task, completed=total)
            results.append(res)
    return results


__all__ = ["BenchCaseError", "BenchContext", "Case", "CaseResult", "Comparison", "Figure", "all_cases", "interleaved", "run_cases"]
