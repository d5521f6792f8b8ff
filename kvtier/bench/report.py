"""What ``kvtier bench`` writes: ``results.json`` (machine, versions, settings, every figure), one PNG
plot per comparison, and a rich table of kvtier's figure, the baseline's and their ratio."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from kvtier import __version__
from kvtier.private_writes import private_dirs, save_private_figure, write_private_file
from kvtier.bench.case import CaseResult, Comparison

PACKAGES = ("torch", "numpy", "grpcio", "protobuf", "lmdb", "xxhash", "mooncake-transfer-engine-non-cuda", "matplotlib")


def machine_info() -> dict[str, Any]:
    """CPU, cores, memory, load, OS and package versions of this machine."""
    cpu = platform.processor()
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), cpu)
    except OSError:
        pass
    mem = None
    try:
        mem = int(next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))) * 1024
    except (OSError, StopIteration):
        pass
    versions = {}
    for p in PACKAGES:
        try:
            versions[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            versions[p] = None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "load_average": list(os.getloadavg()),
            "platform": platform.platform(), "python": sys.version.split()[0], "kvtier": __version__, "packages": versions}


def results_document(cases: list[CaseResult], settings: dict[str, Any], started: float, load_before: list[float]) -> dict[str, Any]:
    """The ``results.json`` object."""
    m = machine_info()
    m["load_average_before"] = load_before
    return {"kvtier_bench": 1, "started": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(),
            "machine": m, "settings": settings, "cases": {c.name: c.to_dict() for c in cases}}


def plot_name(cmp: Comparison) -> str:
    """File name of a comparison's plot: its key with anything but letters, digits, '.', '-' as '_'."""
    return re.sub(r"[^A-Za-z0-9.\-]", "_", cmp.key) + ".png"


def write_plot(cmp: Comparison, path: Path) -> None:
    """What the ratio is: kvtier / baseline of each interleaved round (a bar a round), the median of them
    (the printed ratio) as a line, parity (1x) and the target where there is one. Computed comparisons
    (no rounds) get one bar, their ratio. Both medians are in the title, the ratio is not theirs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = cmp.round_ratios
    fig, ax = plt.subplots(figsize=(9, 3.2), dpi=100)
    if ratios:
        xs = list(range(1, len(ratios) + 1))
        ax.bar(xs, ratios, color="#2f7ed8", width=0.6, label="round ratio")
        ax.set_xticks(xs, [str(x) for x in xs], fontsize=8)
        ax.set_xlabel(f"interleaved round ({len(ratios)} after the warm-up)")
    else:
        ax.bar([1], [cmp.ratio], color="#2f7ed8", width=0.4)
        ax.set_xticks([1], ["computed (no rounds)"], fontsize=8)
        ax.set_xlim(0, 2)
    ax.axhline(cmp.ratio, color="black", linewidth=1.2,
               label=f"ratio {cmp.ratio:.2f}x" + (" (median of the rounds)" if ratios else ""))
    ax.axhline(1.0, color="#9aa5b1", linewidth=1, linestyle=":", label="parity 1x")
    if cmp.target is not None:
        ax.axhline(cmp.target, color="#d9534f", linewidth=1, linestyle="--", label=f"target {cmp.target:g}x")
    top = max(ratios + [cmp.ratio, 1.0, cmp.target or 0.0])
    ax.set_ylim(0, top * 1.2 if math.isfinite(top) else 1)
    ax.set_ylabel("kvtier / baseline (>1: kvtier better)", fontsize=8)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    medians = f"{'medians' if ratios else 'values'}: kvtier {_fmt(cmp.kvtier.value)} vs baseline {_fmt(cmp.baseline.value)} {cmp.unit}"
    ax.set_title(f"{_wrap(cmp.title, 90)}\n{medians}", fontsize=8)
    fig.tight_layout()
    save_private_figure(fig, path)  # 0600, like every file kvtier writes
    plt.close(fig)


def _wrap(text: str, width: int = 38) -> str:
    words, lines, cur = text.split(), [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) > width:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}".strip()
    return "\n".join(lines + [cur])


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def write_outputs(doc: dict[str, Any], cases: list[CaseResult], out: Path) -> list[Path]:
    """Write ``out/results.json`` and the plots, this user's alone whatever the umask (a directory made
    here 0700, the files 0600); returns the paths written."""
    private_dirs(out)
    written = []
    for case in cases:
        for cmp in case.comparisons:
            p = out / plot_name(cmp)
            write_plot(cmp, p)
            written.append(p)
    rp = out / "results.json"
    write_private_file(rp, json.dumps(doc, indent=1, default=_json_default) + "\n")
    return [rp, *written]


def _json_default(o: Any) -> Any:
    if isinstance(o, (set, tuple)):
        return list(o)
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def print_table(cases: list[CaseResult], console: Any) -> None:
    """One row per comparison: kvtier, baseline, ratio, target (green when met, red when not)."""
    from rich.table import Table

    t = Table(title="kvtier bench (kvtier, baseline: medians; ratio: the median of the per-round ratios, so not 'kvtier / baseline' of the columns; > 1: kvtier better)", show_lines=False)
    for col, just in (("comparison", "left"), ("kvtier", "right"), ("baseline", "right"), ("unit", "left"),
                      ("ratio", "right"), ("target", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for case in cases:
        t.add_section()
        for c in case.comparisons:
            met = c.meets_target
            style = "" if met is None else ("green" if met else "red")
            t.add_row(f"[bold]{case.name}[/bold] {c.title}", _fmt(c.kvtier.value), _fmt(c.baseline.value), c.unit,
                      f"[{style}]{c.ratio:.2f}x[/{style}]" if style else f"{c.ratio:.2f}x",
                      "" if c.target is None else f">= {c.target:g}x")
        for key, why in case.left_out.items():
            t.add_row(f"[bold]{case.name}[/bold] [dim]{key}: left out ({why})[/dim]", "", "", "", "", "")
    console.print(t)
    for case in cases:
        head = case.figures.get("headline")
        if head:
            console.print(f"[bold]{case.name}[/bold]: " + ", ".join(f"{k} {v}" for k, v in head.items()))
