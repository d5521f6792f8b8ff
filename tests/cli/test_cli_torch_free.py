"""`kvtier --help`, every command's --help and usage errors answer without importing torch (it costs
1.6 s idle, 10 s on a loaded machine), and so does `import kvtier.cli`. Each case runs in a fresh
interpreter and reads `sys.modules` afterwards."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
from kvtier.cli import main
try:
    main(json.loads(sys.argv[1]), prog_name="kvtier")
    code = 0
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "grpc": "grpc" in sys.modules}))
"""


def run_cli(args: list[str]) -> tuple[dict, str]:
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True, timeout=120)
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stdout + r.stderr


def test_import_kvtier_cli_does_not_import_torch():
    r = subprocess.run([sys.executable, "-c", "import sys, kvtier.cli; print('torch' in sys.modules, 'grpc' in sys.modules)"],
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["False", "False"], r.stdout + r.stderr


@pytest.mark.parametrize("args", [["--help"], ["serve", "--help"], ["replay", "--help"], ["plan", "--help"],
                                  ["bench", "--help"], ["status", "--help"], ["pools", "--help"], ["--version"]])
def test_help_does_not_import_torch(args):
    out, text = run_cli(args)
    assert out == {"code": 0, "torch": False, "grpc": False}, text
    assert "Usage: kvtier" in text or "kvtier, version" in text


@pytest.mark.parametrize("args, says", [
    (["nope"], "No such command 'nope'"),
    (["plan"], "Missing option '--available-bytes'"),
    (["plan", "--available-bytes", "1GiB", "--role", "boss"], "'boss' is not one of 'target', 'draft', 'hisparse'"),
    (["plan", "--available-bytes", "5XB"], "must be a byte count"),
    (["serve", "--host-memory", "5XB"], "must be a byte count"),
    (["serve", "--pool-layers", "4"], "give --pool too"),
    (["serve", "--bogus"], "No such option"),
    (["replay", "--requests", "0"], "0 is not in the range x>=1"),
    (["replay", "--trace", "/nonexistent/trace.jsonl"], "does not exist"),
    (["bench", "--case", "nope"], "unknown case 'nope'"),
])
def test_usage_errors_do_not_import_torch(args, says):
    out, text = run_cli(args)
    assert out["code"] == 2 and not out["torch"], text
    assert says in text
    assert "Traceback" not in text


def test_the_cli_copies_of_daemon_constants_agree():
    """The CLI keeps copies of choices whose home modules import torch; they must stay equal."""
    from kvtier.cli.plan import ACCOUNTINGS, POOL_ROLES
    from kvtier.cli.serve import LOG_LEVELS
    from kvtier.server.daemon.config import LOG_LEVELS as daemon_levels
    from kvtier.server.pool.factory import POOL_ROLES as pool_roles
    from kvtier.server.pool_configurator import ACCOUNTINGS as accountings

    assert (POOL_ROLES, ACCOUNTINGS, LOG_LEVELS) == (pool_roles, accountings, daemon_levels)


def test_the_cli_case_names_are_the_bench_cases():
    from kvtier.bench import all_cases
    from kvtier.cli.bench import _case_names

    assert _case_names() == [c.name for c in all_cases()]
