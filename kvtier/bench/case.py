"""The small case interface of ``kvtier bench``: a case measures kvtier and its baseline, returns
comparisons.

A :class:`Case` has a ``name``, a ``title``, :meth:`Case.steps` (progress-bar units for the given
settings) and :meth:`Case.run`, which returns a :class:`CaseResult`: its settings, extra figures and
:class:`Comparison` objects. A comparison pairs one kvtier :class:`Figure` with one baseline figure of
the same unit, measured in the same run (interleaved, medians after a warm-up: :func:`interleaved`),
and knows its ratio (>1 means kvtier is better, whichever way the unit points) and, where an issue
set one, its target ratio.
"""

from __future__ import annotations

import math
import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


@dataclass
class Figure:
    """One measured (or computed) quantity: its median ``value`` in the comparison's unit.

    Attributes:
        label: what was measured, e.g. ``"kvtier get_cpu_copy(indices)"``.
        value: the median over ``samples`` (or the computed value when there are none).
        samples: one value per timed repetition (after warm-up), same unit.
    """

    label: str
    value: float
    samples: list[float] = field(default_factory=list)

    @classmethod
    def from_samples(cls, label: str, samples: list[float]) -> Figure:
        """A figure whose value is the median of ``samples``."""
        return cls(label, statistics.median(samples), list(samples))

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "value": self.value, "samples": self.samples}


@dataclass
class Comparison:
    """kvtier against one baseline, same unit, same run.

    Attributes:
        key: stable id, ``"<case>.<what>"`` (JSON key and plot file name).
        title: one line for tables and plots.
        unit: e.g. ``"GB/s"``, ``"tokens"``, ``"requests/s"``.
        kvtier, baseline: the two figures.
        higher_is_better: True for throughputs and capacities; False for times and bytes.
        target: the ratio an issue asks for (None: informational).
        paired: the two figures' samples come from the same interleaved rounds, so the ratio is the
            median of the per-round ratios (robust to load that changes between rounds on a shared
            machine); otherwise, and when the sample counts differ, the ratio of the medians.
    """

    key: str
    title: str
    unit: str
    kvtier: Figure
    baseline: Figure
    higher_is_better: bool = True
    target: float | None = None
    note: str = ""
    paired: bool = True

    @property
    def ratio(self) -> float:
        """kvtier / baseline when higher is better, baseline / kvtier otherwise (>1: kvtier better)."""
        k, b = self.kvtier, self.baseline
        if k.value == b.value:
            return 1.0  # equal figures (also both zero: "equal to the simulation" holds)
        if self.paired and k.samples and len(k.samples) == len(b.samples) and all(k.samples) and all(b.samples):
            pairs = zip(k.samples, b.samples)
            return statistics.median(x / y if self.higher_is_better else y / x for x, y in pairs)
        num, den = (k.value, b.value) if self.higher_is_better else (b.value, k.value)
        return num / den if den else math.inf

    @property
    def round_ratios(self) -> list[float]:
        """The ratio of each interleaved round (>1: kvtier better), whose median is :attr:`ratio`; empty
        when the figures are not paired round by round (computed figures, or sample counts that differ)."""
        k, b = self.kvtier, self.baseline
        if not (self.paired and k.samples and len(k.samples) == len(b.samples) and all(k.samples) and all(b.samples)):
            return []
        return [x / y if self.higher_is_better else y / x for x, y in zip(k.samples, b.samples)]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Comparison:
        """A comparison as :meth:`to_dict` wrote it into ``results.json``."""
        fig = lambda f: Figure(f["label"], f["value"], list(f.get("samples") or []))  # noqa: E731
        return cls(d["key"], d["title"], d["unit"], fig(d["kvtier"]), fig(d["baseline"]),
                   higher_is_better=d.get("higher_is_better", True), target=d.get("target"),
                   note=d.get("note", ""), paired=d.get("paired", True))

    def _ratio_of_medians(self) -> float:
        num, den = (self.kvtier.value, self.baseline.value) if self.higher_is_better else (self.baseline.value, self.kvtier.value)
        return num / den if den else math.inf

    @property
    def meets_target(self) -> bool | None:
        """Whether :attr:`ratio` reaches :attr:`target` (None without a target)."""
        return None if self.target is None else self.ratio >= self.target

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "title": self.title, "unit": self.unit, "kvtier": self.kvtier.to_dict(),
                "baseline": self.baseline.to_dict(), "higher_is_better": self.higher_is_better,
                "ratio": self.ratio, "ratio_of_medians": self._ratio_of_medians(), "paired": self.paired, "target": self.target, "meets_target": self.meets_target, "note": self.note}


@dataclass
class CaseResult:
    """What a case returns: its settings, comparisons, extra figures and what it left out (and why)."""

    name: str
    title: str
    settings: dict[str, Any] = field(default_factory=dict)
    comparisons: list[Comparison] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "settings": self.settings, "seconds": self.seconds,
                "comparisons": [c.to_dict() for c in self.comparisons], "figures": self.figures,
                "left_out": self.left_out}


@dataclass
class BenchContext:
    """What every case gets.

    Attributes:
        quick: the ``--quick`` settings (small sizes, few repetitions; the whole run under 2 minutes).
        workdir: a scratch directory on the same file system as ``--out`` (disk cases write here).
        advance: call once per finished progress unit (see :meth:`Case.steps`).
        sglang_python: an interpreter that can import SGLang 0.5.23 (None: compare with SGLang's
            pool only where this interpreter imports it).
    """

    quick: bool
    workdir: Path
    advance: Callable[[int], None] = lambda n=1: None
    sglang_python: str | None = None


class Case(ABC):
    """One benchmark case (a module of :mod:`kvtier.bench`)."""

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    # A case timed in rounds: its set-up steps before the rounds (its ``settings(ctx)`` then gives
    # ``reps`` and ``warmup``, one step each). None: one step in all.
    setup_steps: ClassVar[int | None] = None

    def steps(self, ctx: BenchContext) -> int:
        """Progress units :meth:`run` will report through ``ctx.advance``: 1, or for a case timed in
        rounds ``setup_steps`` + its rounds (warm-up included)."""
        if self.setup_steps is None:
            return 1
        s = self.settings(ctx)  # type: ignore[attr-defined]
        return self.setup_steps + s["reps"] + s["warmup"]

    @abstractmethod
    def run(self, ctx: BenchContext) -> CaseResult:
        """Measure; return the comparisons. Raise only for a real failure (a wrong byte, a dead daemon)."""


def interleaved(fns: dict[str, Callable[[], Any]] | list[dict[str, Callable[[], Any]]], reps: int, *, warmup: int = 1,
                tick: Callable[[], None] | None = None, setup: Callable[[], None] | None = None,
                rotate: bool = False) -> dict[str, list[float]]:
    """Seconds of each call of each function, repetitions interleaved (a, b, c, a, b, c, ...) so that
    load from other processes hits every path alike; ``warmup`` untimed rounds first.

    Args:
        fns: name -> a call to time (its result is dropped at once, as a caller would drop it); or a
            list of such dicts, *phases* run one after another each round (e.g. writes, then the
            reads of what they wrote).
        reps: timed rounds.
        tick: called after each round (warm-up rounds included), e.g. to advance a progress bar.
        setup: called, untimed, before each round (e.g. fresh files for the round).
        rotate: start each phase at the next function each round (a, b, c / b, c, a / c, a, b ...),
            so no function always runs first after the setup or a write (the first reader of
            freshly written pages, say, pays for mapping them).

    Returns:
        name -> ``reps`` durations in seconds.
    """
    phases = [fns] if isinstance(fns, dict) else list(fns)
    times: dict[str, list[float]] = {name: [] for phase in phases for name in phase}
    for rnd in range(warmup + reps):
        if setup is not None:
            setup()
        for phase in phases:
            order = list(phase.items())
            if rotate and order:
                k = rnd % len(order)
                order = order[k:] + order[:k]
            for name, fn in order:
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if rnd >= warmup:
                    times[name].append(dt)
        if tick is not None:
            tick()
    return times


def throughput(label: str, nbytes: int, seconds: list[float]) -> Figure:
    """A GB/s figure (1e9 bytes a second) of moving ``nbytes`` in each of ``seconds``."""
    return Figure.from_samples(label, [nbytes / s / 1e9 for s in seconds])
