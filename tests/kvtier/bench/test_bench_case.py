"""The case interface's arithmetic: paired ratios, direction, equal figures, interleaving order."""

from __future__ import annotations

from kvtier.bench.case import Comparison, Figure, interleaved


def test_paired_ratio_is_the_median_of_per_round_ratios():
    c = Comparison("x.y", "t", "GB/s", Figure.from_samples("k", [2.0, 4.0, 9.0]), Figure.from_samples("b", [1.0, 4.0, 3.0]))
    assert c.ratio == 2.0  # per round 2, 1, 3 -> median 2 (the ratio of medians would be 4/3)
    assert Comparison("x.y", "t", "GB/s", c.kvtier, c.baseline, paired=False).ratio == 4.0 / 3.0


def test_lower_is_better_inverts_and_equal_figures_are_one():
    c = Comparison("x.y", "t", "bytes", Figure("k", 50.0), Figure("b", 100.0), higher_is_better=False, target=1.5)
    assert c.ratio == 2.0 and c.meets_target is True
    assert Comparison("x.y", "t", "%", Figure("k", 0.0), Figure("b", 0.0)).ratio == 1.0


def test_interleaved_runs_rounds_in_order_and_drops_warmup():
    calls: list[str] = []
    t = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 2, warmup=1,
                    setup=lambda: calls.append("s"))
    assert calls == ["s", "a", "b"] * 3
    assert len(t["a"]) == len(t["b"]) == 2


def test_cli_refuses_an_unknown_case_in_one_line(tmp_path):
    from click.testing import CliRunner

    from kvtier.cli import main

    r = CliRunner().invoke(main, ["bench", "--case", "nope", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "unknown case 'nope'" in r.output and "Traceback" not in r.output


def test_a_failing_case_is_a_one_line_error_naming_it(tmp_path, monkeypatch):
    from click.testing import CliRunner

    import kvtier.bench as bench
    from kvtier.bench.case import Case
    from kvtier.cli import main

    class Broken(Case):
        name = "capacity"

        def run(self, ctx):
            raise RuntimeError("a wrong byte")

    monkeypatch.setattr(bench, "all_cases", lambda: [Broken()])
    r = CliRunner().invoke(main, ["bench", "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "case 'capacity' failed: RuntimeError: a wrong byte" in r.output
    assert "Traceback" not in r.output


def test_check_exits_1_naming_the_comparisons_that_missed_their_targets(tmp_path, monkeypatch):
    """--check: a run whose comparison misses its target (0.5 against 0.9) exits 1 after writing the
    results and names it; without --check, or when every target is met, the exit status is 0."""
    from click.testing import CliRunner

    import kvtier.bench as bench
    from kvtier.bench.case import Case, CaseResult
    from kvtier.cli import main

    def case_with(ratio: float) -> Case:
        class Fixed(Case):
            name = "capacity"

            def run(self, ctx):
                res = CaseResult("capacity", "fixed figures", {})
                res.comparisons.append(Comparison("capacity.x", "x", "GB/s", Figure("k", ratio), Figure("b", 1.0), target=0.9))
                res.comparisons.append(Comparison("capacity.info", "no target", "GB/s", Figure("k", 0.1), Figure("b", 1.0)))
                return res
        return Fixed()

    monkeypatch.setattr(bench, "all_cases", lambda: [case_with(0.5)])
    r = CliRunner().invoke(main, ["bench", "--check", "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "1 comparison(s) missed their target: capacity.x" in r.output
    assert (tmp_path / "o" / "results.json").is_file() and "Traceback" not in r.output
    assert CliRunner().invoke(main, ["bench", "--out", str(tmp_path / "p")]).exit_code == 0
    monkeypatch.setattr(bench, "all_cases", lambda: [case_with(0.95)])
    assert CliRunner().invoke(main, ["bench", "--check", "--out", str(tmp_path / "q")]).exit_code == 0


def test_round_ratios_are_what_the_ratio_is_the_median_of():
    """The plots draw these: kvtier / baseline of each round (inverted when lower is better); none for
    computed figures or rounds that do not pair up."""
    c = Comparison("x.y", "t", "GB/s", Figure.from_samples("k", [2.0, 4.0, 9.0]), Figure.from_samples("b", [1.0, 4.0, 3.0]))
    assert c.round_ratios == [2.0, 1.0, 3.0]
    s = Comparison("x.y", "t", "s", Figure.from_samples("k", [1.0, 2.0]), Figure.from_samples("b", [3.0, 3.0]),
                   higher_is_better=False)
    assert s.round_ratios == [3.0, 1.5]
    assert Comparison("x.y", "t", "%", Figure("k", 5.0), Figure("b", 4.0)).round_ratios == []
    assert Comparison("x.y", "t", "GB/s", Figure.from_samples("k", [1.0, 2.0]), Figure.from_samples("b", [1.0])).round_ratios == []


def test_a_comparison_read_back_from_results_json_is_the_same(tmp_path):
    from kvtier.bench.report import write_plot

    c = Comparison("x.y", "t", "GB/s", Figure.from_samples("k", [2.0, 4.0, 9.0]), Figure.from_samples("b", [1.0, 4.0, 3.0]),
                   target=0.9, note="n", higher_is_better=False)
    back = Comparison.from_dict(c.to_dict())
    assert back == c and back.ratio == c.ratio
    write_plot(back, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
