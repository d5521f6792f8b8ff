"""``kvtier replay``: a short replay of the real trace through a real daemon verifies every loaded
byte and hits exactly what ``--simulate`` hits; the CLI's JSON and errors."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli import main
from kvtier.cli.replay import pick_transport, replay_through_daemon, simulate
from kvtier.server.replay.scale import ReplayScale
from kvtier.server.replay.trace import read_trace

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "conversation_trace.jsonl"
PAGE_RECORD = 194_048  # GLM-5.2 layers 0-3: 4 x 64 x 656 + 3 x 8448 + 512 + 384-byte header


def short_scale() -> ReplayScale:
    # device 256 pages (the largest of the first 200 requests has 236), host 3000 page records,
    # disk a 64 MiB map: every tier serves hits and the disk evicts
    return ReplayScale(device_tokens=256 * 64, host_bytes=3000 * PAGE_RECORD, disk_bytes=64 << 20)


def test_first_200_requests_through_the_daemon_equal_the_simulation(tmp_path):
    reqs = read_trace(TRACE, limit=200)
    scale = short_scale()
    assert scale.codec().page_nbytes() == PAGE_RECORD
    real = replay_through_daemon(reqs, scale, workdir=str(tmp_path))
    sim = simulate(reqs, scale)
    assert real.transport == "attach"  # the embedded daemon is local: misses written in its pool's memory
    assert real.verify_failures == 0
    assert real.hit_tokens == sim.hit_tokens and real.miss_tokens == sim.miss_tokens
    assert all(real.hit_tokens[t] > 0 for t in ("device", "host", "disk")), real.hit_tokens
    assert real.verified_pages * 64 == sum(real.hit_tokens.values())
    assert real.moves == sim.moves and real.moves["disk->gone"]["count"] > 0
    pages = sum(len(r.hash_ids) for r in reqs)  # one page per trace block at this scale
    assert real.requests == 200 and real.tokens == pages * 64 == 354_368


@pytest.mark.parametrize("policy", ["hitdensity", "duel", pytest.param("lru", marks=pytest.mark.slow),
                                    pytest.param("s3fifo", marks=pytest.mark.slow),
                                    pytest.param("arc", marks=pytest.mark.slow)])
def test_each_policy_through_the_daemon_equals_its_simulation(tmp_path, policy):
    """The first 200 requests with ``--policy`` on the embedded daemon hit what ``--simulate`` of the
    same policy hits, page for page and move for move (admission refusals included)."""
    reqs = read_trace(TRACE, limit=200)
    scale = dataclasses.replace(short_scale(), policy=policy)
    real = replay_through_daemon(reqs, scale, workdir=str(tmp_path))
    sim = simulate(reqs, scale)
    assert real.verify_failures == 0
    assert real.hit_tokens == sim.hit_tokens and real.moves == sim.moves


def test_kv_over_grpc_replays_what_the_attached_replay_does(tmp_path):
    """``--transport grpc`` (WriteKV/ReadKV streams instead of the attached pool) on the first 60
    requests: every loaded byte verified and the same hits and moves as the simulation."""
    reqs = read_trace(TRACE, limit=60)
    scale = short_scale()
    real = replay_through_daemon(reqs, scale, workdir=str(tmp_path), transport="grpc")
    sim = simulate(reqs, scale)
    assert real.transport == "grpc" and real.verify_failures == 0 and real.verified_pages > 0
    assert real.hit_tokens == sim.hit_tokens and real.moves == sim.moves


@pytest.mark.parametrize(("transport", "address", "chosen"), [
    ("auto", "unix:///tmp/x/kvtier.sock", "attach"), ("auto", "127.0.0.1:50051", "grpc"),
    ("grpc", "unix:///tmp/x/kvtier.sock", "grpc"), ("attach", "unix:///tmp/x/kvtier.sock", "attach")])
def test_auto_attaches_only_to_a_local_daemon(transport, address, chosen):
    assert pick_transport(transport, address) == chosen


def test_cli_refuses_to_attach_to_a_tcp_daemon_before_starting_anything():
    r = CliRunner().invoke(main, ["replay", "--trace", str(TRACE), "--requests", "5", "--server", "127.0.0.1:1",
                                  "--transport", "attach", "--no-belady"])
    assert r.exit_code == 2 and "needs the daemon's unix socket" in r.output and "Traceback" not in r.output


def test_cli_simulate_writes_the_json_summary(tmp_path):
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["replay", "--trace", str(TRACE), "--requests", "30", "--simulate",
                                  "--json", str(out)])
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    for key in ("requests", "tokens", "hit_tokens", "miss_tokens", "verify_failures", "bytes_moved", "seconds",
                "belady_hit_rate", "scale"):
        assert key in d
    assert set(d["hit_tokens"]) == {"device", "host", "disk"}
    pages = sum(len(q.hash_ids) for q in read_trace(TRACE, limit=30))
    assert d["requests"] == 30 and d["tokens"] == pages * 64
    assert d["tokens"] == sum(d["hit_tokens"].values()) + d["miss_tokens"]
    assert d["belady_hit_tokens"] >= sum(d["hit_tokens"].values())
    assert "Belady upper bound" in r.output and "scale" in r.output


def test_cli_rejects_a_block_that_is_not_whole_pages(tmp_path):
    r = CliRunner().invoke(main, ["replay", "--trace", str(TRACE), "--tokens-per-block", "100", "--simulate"])
    assert r.exit_code != 0 and "multiple of 64" in r.output


@pytest.mark.slow
def test_full_trace_through_the_daemon_equals_the_simulation(tmp_path):
    """All 12,031 requests at the default scale (minutes): 0 verification failures, exact equality."""
    reqs = read_trace(TRACE)
    scale = ReplayScale()
    real = replay_through_daemon(reqs, scale, workdir=str(tmp_path))
    sim = simulate(reqs, scale)
    assert real.verify_failures == 0 and real.requests == 12031
    assert real.hit_tokens == sim.hit_tokens and real.moves == sim.moves


def test_cli_replays_through_a_given_server(kvtier_daemon, tmp_path):
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["replay", "--trace", str(TRACE), "--requests", "20", "--server", kvtier_daemon.address,
                                  "--device-tokens", str(256 * 64), "--no-belady", "--json", str(out)])
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["requests"] == 20 and d["verify_failures"] == 0 and d["simulate"] is False
    assert d["transport"] == "attach"  # a unix-socket --server is local
    assert d["hit_tokens"]["device"] > 0  # hash id 0 (the shared first block) is reused at once
    assert [p.pool_id for p in kvtier_daemon.client.list_pools()] == ["tiny"]  # its replay pool is gone


def test_a_request_larger_than_the_pool_is_a_clean_error():
    r = CliRunner().invoke(main, ["replay", "--trace", str(TRACE), "--requests", "8", "--simulate",
                                  "--device-tokens", str(16 * 64), "--no-belady"])
    # request 6 has 46 blocks; its first (hash id 0) is already on the device: 45 fresh pages > 16
    assert r.exit_code == 1 and "needs 45 free pages" in r.output and "Traceback" not in r.output


def test_cli_reports_the_wall_time_with_start_up_beside_its_own_timer(tmp_path):
    """The command's wall time counts from the interpreter's start, so it holds the replay's own
    seconds and the start-up before them (a fresh process: its imports are part of it)."""
    import subprocess
    import sys

    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "replay", "--trace", str(TRACE), "--requests", "10",
                        "--simulate", "--no-belady", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(out.read_text())
    assert d["wall_seconds"] > d["seconds"] > 0
    assert "wall seconds (with start-up)" in r.stdout



@pytest.mark.parametrize("kind", ["fifo", "char-device", "json-dir-socket"])
def test_replay_json_over_something_not_a_regular_file_is_refused_before_the_replay(tmp_path, kind):
    """Attack pass 7, A7-6: ``kvtier replay --json`` on a device node exited 0 and left a 0600 regular file
    where the node was. Refused at start (exit 2, before the replay), naming the path and what is
    there, which is left as it was. Our own device node and FIFO: never the real /dev/null."""
    import os
    import socket
    import stat

    out = tmp_path / "out"
    if kind == "fifo":
        os.mkfifo(out, 0o600)
        words = "a FIFO"
    elif kind == "char-device":
        assert os.geteuid() == 0, "mknod needs root: the suite runs as root (as for its tmpfs disks)"
        os.mknod(out, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        words = "a character device"
    else:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(out))
        s.close()
        words = "a socket"
    before = os.lstat(out)
    r = CliRunner().invoke(main, ["replay", "--trace", str(TRACE), "--requests", "5", "--simulate", "--json", str(out)])
    assert r.exit_code == 2, r.output
    assert f"--json {out} is {words}, not a regular file" in r.output and "trace:" not in r.output
    after = os.lstat(out)
    assert (after.st_ino, after.st_mode, after.st_rdev) == (before.st_ino, before.st_mode, before.st_rdev)


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_cli_refuses_an_output_path_through_another_users_symlink(tmp_path, flag, others_symlink):
    """Attack pass 8, A8-12: ``kvtier replay --json`` (and ``--plot``) followed another user's symlink
    in a sticky directory and wrote, as root, into the root-only directory it points at; the daemon's
    --ready-file refused the same path. Now replay refuses it the same way, one line, before it runs,
    and writes nothing there."""
    sticky, victim = others_symlink
    target = sticky / "evil" / ("out.json" if flag == "--json" else "plots")
    extra = ["--sweep", "1000"] if flag == "--plot" else []
    r = CliRunner().invoke(main, ["replay", "--trace", str(TRACE), "--requests", "3", "--simulate", *extra,
                                  flag, str(target)])
    assert r.exit_code == 2, r.output
    assert f"symlink {sticky / 'evil'} is owned by uid 65534" in r.output and "Traceback" not in r.output
    assert os.listdir(victim) == []


@pytest.mark.parametrize("kind", ["fifo", "char-device"])
def test_replay_plot_that_is_a_device_node_or_a_fifo_is_refused_before_the_sweep(kind, make_node):
    """Attack pass 9, A9-5: ``kvtier replay --sweep ... --plot /dev/null`` ran the whole sweep, then
    ended in a NotADirectoryError traceback. Refused at start in one line; the node is left as it was."""
    import stat

    node = make_node(kind)
    r = CliRunner().invoke(main, ["replay", "--trace", str(TRACE), "--requests", "3", "--simulate", "--sweep", "1000",
                                  "--plot", str(node)])
    assert r.exit_code == 2, r.output
    assert f"--plot {node} exists and is not a directory" in r.output and "Traceback" not in r.output
    mode = os.lstat(node).st_mode
    assert stat.S_ISFIFO(mode) if kind == "fifo" else stat.S_ISCHR(mode)
