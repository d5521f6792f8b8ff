"""``kvtier replay --simulate --policy a,b --sweep ...``: the policy lab's split of a capacity, its JSON,
table and PNG, and its usage errors."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from click.testing import CliRunner

from kvtier.cli import main
from kvtier.server.replay.scale import ReplayScale
from kvtier.server.replay.sweep import scale_for

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "conversation_trace.jsonl"


def test_a_capacity_keeps_the_device_and_splits_the_rest_as_the_default_budgets():
    # 1e7 tokens = 19,531 blocks of 512 = 19,531 pages at the default scale; the device keeps 1,024;
    # 18,507 left, split 5,533 : 16,362 -> host floor(18,507 * 5,533 / 21,895) = 4,676, disk 13,831
    s = scale_for(ReplayScale(), 1e7, "arc")
    assert s.policy == "arc"
    assert s.capacity_pages() == {"device": 1024, "host": 4676, "disk": 13831}
    # 2e5 tokens = 390 blocks: below the device's own 1,024 pages, so the device shrinks to 390
    assert scale_for(ReplayScale(), 2e5, "lru").capacity_pages() == {"device": 390, "host": 0, "disk": 0}


def test_lab_writes_json_table_and_png(tmp_path):
    out = tmp_path / "lab.json"
    r = CliRunner().invoke(main, ["replay", "--trace", str(TRACE), "--requests", "60", "--simulate", "--policy", "lru,arc",
                                  "--sweep", "2e5,1e6", "--json", str(out), "--plot", str(tmp_path / "plots")])
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["sweep"]
    assert [(x["capacity_tokens"], x["policy"]) for x in rows] == [
        (199680, "lru"), (199680, "arc"), (999936, "lru"), (999936, "arc")]  # 390 and 1,953 blocks of 512
    for x in rows:
        assert 0.0 <= x["hit_rate"] <= x["belady_hit_rate"] <= 1.0
        assert abs(sum(x["tier_hit_rate"].values()) - x["hit_rate"]) < 1e-12
        assert set(x) >= {"input_token_hit_rate", "bytes_written", "capacity_pages", "not_admitted"}
    assert (tmp_path / "plots" / "policy-sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "policy lab" in r.output


def test_lab_and_replay_outputs_are_this_users_alone_under_umask_022(tmp_path):
    """Regression (attack pass F1): ``--json`` and ``--plot`` were written with the umask's modes
    (0644 files, 0755 directories). Under umask 022 in a 0755 parent they are 0600 and 0700 now."""
    os.chmod(tmp_path, 0o755)
    old = os.umask(0o022)
    try:
        r = CliRunner().invoke(main, ["replay", "--trace", str(TRACE), "--requests", "30", "--simulate", "--policy",
                                      "lru,arc", "--sweep", "2e5", "--json", str(tmp_path / "lab.json"), "--plot",
                                      str(tmp_path / "plots" / "lab")])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(main, ["replay", "--trace", str(TRACE), "--requests", "30", "--simulate", "--json",
                                      str(tmp_path / "run.json")])
        assert r.exit_code == 0, r.output
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    assert modes == {"lab.json": 0o600, "run.json": 0o600, "plots": 0o700, "plots/lab": 0o700,
                     "plots/lab/policy-sweep.png": 0o600}, modes
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755


def test_lab_usage_errors_are_one_line_and_run_nothing():
    for args, words in [(["--policy", "lru,arc"], "need --simulate --sweep"),
                        (["--sweep", "1e6"], "add --simulate"),
                        (["--simulate", "--policy", "mru"], "unknown eviction policy 'mru'"),
                        (["--simulate", "--sweep", "1e6,big"], "comma list of token counts"),
                        (["--simulate", "--sweep", "-5"], "positive token counts"),
                        (["--simulate", "--json", "/nonexistent-kvtier/x.json"], "/nonexistent-kvtier does not exist")]:
        r = CliRunner().invoke(main, ["replay", "--trace", str(TRACE), "--requests", "5", *args])
        assert r.exit_code == 2 and words in r.output, (args, r.output)
