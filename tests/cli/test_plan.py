"""``kvtier plan``: the right values as JSON and as a table, and clear errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli import main

GLM_ARGS = ["plan", "--model", "glm-5.2", "--available-bytes", "134227000000", "--kv-dtype", "fp8", "--accounting", "sglang"]
GLM52_LIVE = [0, 1, 2] + list(range(6, 75, 4))
MODELS_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "models"


def verify_glm52_figures(data: dict) -> None:
    assert data["naive_tokens"] == 2_430_528
    assert data["skip_aware_tokens"] == 2_813_952
    assert data["saved_bytes_per_token"] == 7_524
    assert data["saved_bytes"] == 18_287_292_672
    assert data["live_indexer_layers"] == GLM52_LIVE
    assert abs(data["gain_ratio"] - 2_813_952 / 2_430_528) < 1e-12


def test_json_output_has_the_right_values():
    result = CliRunner().invoke(main, GLM_ARGS + ["--json"])
    assert result.exit_code == 0, result.output
    verify_glm52_figures(json.loads(result.output))


def test_table_output_is_readable():
    result = CliRunner().invoke(main, GLM_ARGS)
    assert result.exit_code == 0, result.output
    out = result.output
    for figure in ("55,224", "47,700", "2,430,528", "2,813,952", "7,524", "18,287,292,672", "+15.8%"):
        assert figure in out, figure
    assert "naive" in out and "skip-aware" in out and "max total tokens" in out
    assert "21 with an indexer buffer, 57 skip top-k" in out


def test_model_from_a_config_path():
    result = CliRunner().invoke(main, GLM_ARGS[:1] + ["--model", str(MODELS_DIR / "glm-5.2.json")] + GLM_ARGS[3:] + ["--json"])
    assert result.exit_code == 0, result.output
    verify_glm52_figures(json.loads(result.output))


def test_exact_is_the_default_accounting():
    result = CliRunner().invoke(main, ["plan", "--available-bytes", "150000000", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["accounting"] == "exact" and data["model"] == "glm-5.2"
    assert data["skip_aware_tokens"] == 64 * (150_000_000 // (78 * 64 * 656 + 21 * 8448) - 1)


def test_unknown_model_is_a_clear_error():
    result = CliRunner().invoke(main, ["plan", "--model", "llama-3", "--available-bytes", "1000"])
    assert result.exit_code == 2
    assert "--model" in result.output and "unknown model preset 'llama-3'" in result.output
    assert "glm-5.2" in result.output and "Traceback" not in result.output


def test_config_path_that_is_not_an_object_is_a_clear_error(tmp_path):
    """Regression: --model pointing at a JSON list ended in an AttributeError traceback."""
    path = tmp_path / "config.json"
    path.write_text("[]")
    result = CliRunner().invoke(main, ["plan", "--model", str(path), "--available-bytes", "1000"])
    assert result.exit_code == 2 and "JSON object" in result.output and "Traceback" not in result.output


def test_bad_options_are_clear_errors():
    result = CliRunner().invoke(main, ["plan", "--available-bytes", "-5"])
    assert result.exit_code == 2 and "--available-bytes" in result.output
    result = CliRunner().invoke(main, ["plan", "--available-bytes", "5", "--kv-dtype", "fp16"])
    assert result.exit_code == 2 and "--kv-dtype" in result.output


def test_console_script_runs_in_a_real_process():
    exe = shutil.which("kvtier", path=str(Path(sys.executable).parent))
    assert exe, "the kvtier console script is not installed next to this Python"
    proc = subprocess.run([exe, *GLM_ARGS, "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    verify_glm52_figures(json.loads(proc.stdout))
    proc = subprocess.run([exe, "plan", "--model", "nope", "--available-bytes", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown model preset 'nope'" in proc.stderr


def test_draft_role_plans_an_indexer_on_every_layer():
    result = CliRunner().invoke(main, GLM_ARGS + ["--role", "draft", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["naive_tokens"] == data["skip_aware_tokens"] == 2_430_528
    assert data["live_indexer_layers"] == list(range(78)) and data["saved_bytes"] == 0


def test_available_bytes_takes_size_suffixes():
    """``--available-bytes 80GiB`` is 80 * 2**30 bytes, as ``kvtier serve``'s sizes are."""
    result = CliRunner().invoke(main, ["plan", "--available-bytes", "80GiB", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["available_bytes"] == 80 * 2**30


def test_a_budget_below_one_page_is_an_error():
    """Regression: 1,000 bytes printed 0 tokens, pool bytes larger than the budget and '+-100.0%'."""
    result = CliRunner().invoke(main, ["plan", "--available-bytes", "1000"])
    assert result.exit_code != 0
    # exact accounting, one skip-aware GLM-5.2 page: 78 layers x 2 pages x 64 rows x 656 bytes (padding
    # page included) + 21 live layers x 2 indexer pages x 8448 bytes = 6,549,504 + 354,816
    assert "do not hold one page" in result.output and "6,904,320" in result.output


def test_pp_size_plans_each_stage_with_sglangs_layer_split():
    """GLM-5.2 on 4 stages: layers 0-18, 19-37, 38-57, 58-77; stage 1's first layer (19) skips top-k."""
    result = CliRunner().invoke(main, GLM_ARGS + ["--pp-size", "4", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    ranges = [(s["start_layer"], s["end_layer"]) for s in data["stages"]]
    assert ranges == [(0, 19), (19, 38), (38, 58), (58, 78)]
    tokens = []
    for s, (start, end) in zip(data["stages"], ranges):
        live = [layer for layer in GLM52_LIVE if start <= layer < end]
        assert s["live_indexer_layer_ids"] == live
        assert s["first_layer_skips_topk"] == (start not in GLM52_LIVE)
        cell = (end - start) * 576 + len(live) * 132  # SGLang's estimate: 576-byte latent rows
        assert s["skip_aware_cell_bytes"] == cell and s["naive_cell_bytes"] == (end - start) * (576 + 132)
        assert s["skip_aware_tokens"] == 134227000000 // cell // 64 * 64
        tokens.append(s["skip_aware_tokens"])
    assert [s["first_layer_skips_topk"] for s in data["stages"]] == [False, True, False, False]
    assert data["skip_aware_tokens"] == min(tokens) and data["bounding_stage"] == tokens.index(min(tokens))
    table = CliRunner().invoke(main, GLM_ARGS + ["--pp-size", "4"])
    assert table.exit_code == 0 and "19-37" in table.output and "skips top-k" in table.output
    assert f"{min(tokens):,}" in table.output


def test_pp_partition_must_add_up():
    result = CliRunner().invoke(main, GLM_ARGS + ["--pp-size", "2", "--pp-partition", "30,30"])
    assert result.exit_code == 2 and "adding up to 78" in result.output


def test_a_pp_partition_without_its_pp_size_is_a_usage_error():
    """Attack pass 6, A6-8: ``--pp-partition 1,1`` without ``--pp-size`` planned one stage of 78 layers
    and exited 0; the partition was ignored without a word."""
    result = CliRunner().invoke(main, GLM_ARGS + ["--pp-partition", "39,39"])
    assert result.exit_code == 2 and "2 stages in --pp-partition but --pp-size 1: give --pp-size 2" in result.output


@pytest.mark.parametrize(("value", "words"), [
    ("Infinity", "Infinity is not a number an HF config may hold"),
    ("1e400", "kv_lora_rank must be an integer in 1..65536, got inf"),
    ("512.5", "kv_lora_rank must be an integer in 1..65536, got 512.5"),
])
def test_a_config_with_an_infinite_or_fractional_size_is_a_clear_error(tmp_path, value, words):
    """Attack pass 7, A7-8: ``kvtier plan --model`` on a config.json with ``Infinity`` or ``1e400`` ended
    in an OverflowError traceback (``int(inf)``)."""
    path = tmp_path / "config.json"
    path.write_text('{"num_hidden_layers": 4, "kv_lora_rank": %s, "qk_rope_head_dim": 64}' % value)
    result = CliRunner().invoke(main, ["plan", "--model", str(path), "--available-bytes", "1GiB"])
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output
    assert not isinstance(result.exception, OverflowError)
