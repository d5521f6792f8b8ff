"""The documentation: README's promises (length, the test command CI runs), the MkDocs site built with
--strict (a broken link, a missing page or a bad docstring reference fails), and the generated pages
equal to what scripts/render-docs renders from their sources (the .proto files, docs/bench/*.json)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _render_docs():
    loader = importlib.machinery.SourceFileLoader("render_docs", str(ROOT / "scripts" / "render-docs"))
    spec = importlib.util.spec_from_loader("render_docs", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_readme_is_at_most_200_lines():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 200, f"README.md has {n} lines; the site under docs/ is the place for the rest"


def test_readme_test_command_is_the_one_ci_runs():
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    command = ci[-1]  # the script's last command runs the suite
    assert "pytest" in command
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    lines = [ln for b in blocks for ln in b.splitlines()]
    assert command in lines, f"README.md must give the test command exactly as .ci/run runs it: {command!r}"
    assert command in (ROOT / "docs" / "getting-started.md").read_text()


def test_readme_puts_the_root_note_before_the_command_it_changes():
    readme = (ROOT / "README.md").read_text()
    assert readme.index("no `sudo`") < readme.index("sudo apt-get install")


def test_site_builds_strict(tmp_path):
    # no -q: mkdocs --quiet hides warnings from --strict's count, so a broken link would pass
    import mkdocs  # noqa: F401  (a missing mkdocs is a failure, not a skip: it is in the dev extra)

    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                       env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    for page in ("index.html", "reference/cli/index.html", "reference/python-api/index.html",
                 "reference/grpc/index.html", "benchmarks/index.html", "concepts/eviction/index.html",
                 "guides/gpu-check/index.html", "operations/security/index.html", "operations/concurrency/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    for command in ("kvtier serve", "kvtier replay", "kvtier bench", "kvtier plan", "kvtier status", "kvtier pools"):
        assert command in cli, command  # generated from click: every command is there
    api = (tmp_path / "site" / "reference" / "python-api" / "index.html").read_text()
    assert "write_kv" in api and "load_prefix" in api  # KVTierClient's mixins' methods, from their docstrings


def test_every_page_on_disk_is_in_the_nav():
    import yaml

    def pages(nav):
        for item in nav:
            for v in item.values():
                if isinstance(v, str):
                    yield v
                else:
                    yield from pages(v)

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", lambda *_a: None)
    nav = set(pages(yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)["nav"]))
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == nav


def test_grpc_page_is_rendered_from_the_proto_files():
    rd = _render_docs()
    assert (ROOT / "docs" / "reference" / "grpc.md").read_text() == rd.render_grpc(), \
        "docs/reference/grpc.md is stale: run scripts/render-docs"
    page = rd.render_grpc()
    for proto in (ROOT / "proto" / "kvtier" / "v1").glob("*.proto"):
        for service, rpcs in re.findall(r"^service (\w+) \{(.*?)^\}", proto.read_text(), re.S | re.M):
            assert f"service `{service}`" in page
            for rpc in re.findall(r"rpc (\w+)\(", rpcs):
                assert f"| `{rpc}` |" in page, rpc


def test_benchmark_page_is_rendered_from_results_json():
    rd = _render_docs()
    assert (ROOT / "docs" / "benchmarks" / "index.md").read_text() == rd.render_benchmarks(), \
        "docs/benchmarks/index.md is stale: run scripts/render-docs"


def test_benchmark_page_figures_are_the_results_files():
    """Spot checks worked out from the JSON by hand-written arithmetic, not by the renderer: a row's
    ratio is the median of its per-round ratios and its plot exists."""
    page = (ROOT / "docs" / "benchmarks" / "index.md").read_text()
    full = json.loads((ROOT / "docs" / "bench" / "results.json").read_text())
    cmp = next(c for c in full["cases"]["copies"]["comparisons"] if c["key"] == "copies.get_cpu_copy_vs_sglang")
    k, b = cmp["kvtier"]["samples"], cmp["baseline"]["samples"]
    per_round = sorted(x / y for x, y in zip(k, b))
    assert len(per_round) % 2 == 1
    median = per_round[len(per_round) // 2]
    assert f"**{median:.2f}x** | {per_round[0]:.2f}-{per_round[-1]:.2f}x ({len(per_round)})" in page
    moon = json.loads((ROOT / "docs" / "bench" / "mooncake.json").read_text())
    share = next(c for c in moon["cases"]["mooncake"]["comparisons"] if c["key"] == "mooncake.shared_vs_private_hit_rate")
    assert f"**{share['kvtier']['value'] / share['baseline']['value']:.2f}x**" in page  # 12.05 % / 7.90 %: 1.52x
    for plot in re.findall(r"\]\(\.\./bench/plots/([^)]+)\)", page):
        assert (ROOT / "docs" / "bench" / "plots" / plot).is_file(), plot
