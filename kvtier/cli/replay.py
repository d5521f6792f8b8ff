"""``kvtier replay``: replay the Mooncake conversation trace through a kvtier daemon.

For each request in arrival order: load its prefix pages (the hits from whatever tier holds them),
verify every loaded byte, write the misses (KV filled from hash id, layer and position), store them
and release the request. Starts an embedded daemon (tiers in a temp dir) unless ``--server``. With a
local daemon (embedded, or a unix-socket ``--server``) the replay pool is attached and KV is written
and verified in its memory; otherwise KV travels over gRPC (``--transport`` forces one).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvtier.private_writes import OutputPathError, check_output_path, private_dirs, write_private_file
from kvtier.sizes import parse_bytes

if TYPE_CHECKING:  # the replay's modules (and torch) load when a replay runs, not for --help or a usage error
    from kvtier.server.replay.driver import ReplayResult
    from kvtier.server.replay.scale import ReplayScale

DEFAULT_TRACE = "../shared/data/conversation_trace.jsonl"


def _trace_path(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """The trace file: ``value`` from the current directory; the default also from the checkout's root
    (``<root>/../shared/data``, where CI lays the data)."""
    candidates = [Path(value)]
    if value == DEFAULT_TRACE:
        candidates.append(Path(__file__).resolve().parents[2] / DEFAULT_TRACE)
    for c in candidates:
        if c.is_file():
            return str(c)
    looked = " nor ".join(str(c.resolve()) for c in candidates)
    raise click.BadParameter(f"file {value!r} does not exist (looked at {looked}); put the Mooncake trace "
                             f"(github.com/kvcache-ai/Mooncake, FAST25-release/traces/conversation_trace.jsonl) in "
                             f"shared/data/ beside the kvtier checkout, or pass --trace PATH")


def _bytes(_ctx: click.Context, param: click.Parameter, value: Any) -> int:
    try:
        return parse_bytes(value, (param.opts or [str(param.name)])[0])
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def daemon_args(scale: ReplayScale, disk_path: str) -> list[str]:
    """``kvtier serve`` arguments that give a daemon the tier budgets of ``scale``."""
    return ["--device", "cpu", "--log-level", "WARNING", "--host-memory", str(scale.host_bytes),
            "--disk-path", disk_path, "--disk-size", str(scale.disk_bytes),
            "--write-back" if scale.write_back else "--write-through", "--policy", scale.policy]


TRANSPORTS = ("auto", "attach", "grpc")


def pick_transport(transport: str, address: str) -> str:
    """``attach`` or ``grpc`` for a daemon at ``address``: ``auto`` attaches when it is local (a unix socket).

    Raises:
        ValueError: ``attach`` asked for a daemon on TCP, or an unknown transport.
    """
    from kvtier.addresses import is_unix, resolve_address

    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    local = is_unix(resolve_address(address))
    if transport == "attach" and not local:
        raise ValueError(f"--transport attach needs the daemon's unix socket on this machine; {address} is TCP "
                         f"(pass its socket path to --server, or use --transport grpc)")
    return transport if transport != "auto" else ("attach" if local else "grpc")


def replay_through_daemon(requests: list[Any], scale: ReplayScale, *, server: str | None = None,
                          on_request: Any = None, workdir: str | None = None, transport: str = "auto") -> ReplayResult:
    """Replay ``requests`` through ``server`` (or an embedded daemon with ``scale``'s budgets), attached
    to the replay pool when the daemon is local (``transport="auto"``) or as ``transport`` says."""
    from kvtier.cli.common import open_client
    from kvtier.cli.replay_backend import AttachedBackend, ClientBackend
    from kvtier.server.replay.driver import replay as run_replay
    from kvtier.client.spawn import DaemonProcess

    if server is not None:
        pick_transport(transport, server)  # a bad combination fails before anything starts

    tmp = Path(tempfile.mkdtemp(prefix="kvtier-replay-", dir=workdir))
    try:
        daemon = None
        if server is None:
            daemon = DaemonProcess(extra_args=daemon_args(scale, str(tmp / "disk")))
            daemon.start()
        try:
            address = server or daemon.address  # type: ignore[union-attr]
            chosen = pick_transport(transport, address)
            cls = AttachedBackend if chosen == "attach" else ClientBackend
            with open_client(address, 120.0) as c:
                backend = cls(c, scale.model, scale.num_layers, scale.device_tokens)
                try:
                    res = run_replay(requests, backend, scale, on_request=on_request)
                    res.transport = chosen
                    return res
                finally:
                    backend.close()
        finally:
            if daemon is not None:
                daemon.stop()
                daemon.cleanup()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def simulate(requests: list[Any], scale: ReplayScale, *, on_request: Any = None) -> ReplayResult:
    """The same policy as a pure cache simulation (size-only tiers, no bytes, no daemon)."""
    from kvtier.server.replay.driver import InProcessBackend, replay as run_replay

    backend = InProcessBackend(scale, "-", simulate=True)
    return run_replay(requests, backend, scale, on_request=on_request)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n):,} B"
        n /= 1024
    return str(n)


def process_wall_seconds() -> float:
    """Seconds since this process started (the interpreter's start-up and imports included): the
    kernel's uptime less the process's start time (``/proc``); without ``/proc``, since kvtier.cli was
    imported."""
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return max(uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"), 0.0)  # field 22: starttime, in ticks
    except (OSError, ValueError, IndexError):
        from kvtier.cli import STARTED

        return time.monotonic() - STARTED


def _print_report(res: ReplayResult, belady: int | None, wall_seconds: float | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from kvtier.server.replay.driver import TIERS

    c = Console()
    s = res.scale
    c.print(f"[bold]scale[/bold]: {s['model']} first {s['num_layers']} layers (skip mask {s['skip_mask']}), "
            f"{s['tokens_per_block']} tokens per trace block ({s['pages_per_block']} page(s) of {s['page_size']}), "
            f"page record {s['page_record_bytes']:,} B; device {s['device_tokens']:,} tokens, host "
            f"{_fmt_bytes(s['host_bytes'])}, disk {_fmt_bytes(s['disk_bytes'])} "
            f"({'write-back' if s['write_back'] else 'write-through'}); capacity in pages {s['capacity_pages']}")
    t = Table(title=f"kvtier replay{' --simulate' if res.simulate else ''}")
    t.add_column("", style="bold")
    t.add_column("value", justify="right")
    t.add_row("requests", f"{res.requests:,}")
    t.add_row("tokens", f"{res.tokens:,}")
    for tier in TIERS:
        t.add_row(f"hit rate {tier}", f"{res.hit_tokens.get(tier, 0) / res.tokens:.2%}" if res.tokens else "-")
    t.add_row("hit rate total", f"{res.hit_rate:.2%}")
    if belady is not None and res.tokens:
        t.add_row("Belady upper bound", f"{belady / res.tokens:.2%}")
    t.add_row("miss tokens", f"{res.miss_tokens:,}")
    if res.transport:
        t.add_row("KV transport", res.transport)
    if not res.simulate:
        t.add_row("verification failures", f"{res.verify_failures:,}" + (" [green]ok[/green]" if not res.verify_failures else ""))
    for move, m in sorted(res.moves.items()):
        t.add_row(f"moved {move}", f"{m['count']:,} records, {_fmt_bytes(m['bytes'])}")
    t.add_row("seconds", f"{res.seconds:.1f}")
    if wall_seconds is not None:
        t.add_row("wall seconds (with start-up)", f"{wall_seconds:.1f}")
    t.add_row("throughput", f"{res.requests / res.seconds:,.1f} requests/s, {res.tokens / res.seconds:,.0f} tokens/s"
              if res.seconds else "-")
    c.print(t)


@click.command(short_help='Replay the Mooncake trace through the tiers; hit rates vs Belady.')
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), default=DEFAULT_TRACE, show_default=True,
              callback=_trace_path,
              help="Mooncake FAST'25 conversation trace (JSON lines with hash_ids). A relative path is taken from the "
                   "current directory; the default, if not there, from the kvtier checkout's root (the "
                   "shared/data folder beside the checkout).")
@click.option("--model", default="glm-5.2", show_default=True, help="Model preset.")
@click.option("--requests", "n_requests", type=click.IntRange(min=1), default=None, help="Only the first N requests.")
@click.option("--server", default=None, metavar="ADDR", help="Use this daemon instead of an embedded one.")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="auto", show_default=True,
              help="How KV reaches the daemon: attach (map the pool, write and verify in its memory; needs a local "
                   "daemon), grpc (WriteKV/ReadKV streams), auto (attach when the daemon is local).")
@click.option("--simulate", is_flag=True, help="Pure cache simulation of the same policy (no bytes, no daemon).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the result as one JSON object.")
@click.option("--layers", "num_layers", type=click.IntRange(min=1), default=4, show_default=True,
              help="Scale: the model's first N layers.")
@click.option("--tokens-per-block", type=click.IntRange(min=64), default=64, show_default=True,
              help="Scale: tokens one 512-token trace block stands for (a multiple of 64).")
@click.option("--device-tokens", type=click.IntRange(min=64), default=65536, show_default=True, help="Device pool tokens.")
@click.option("--host-size", "host_bytes", callback=_bytes, default="1GiB", show_default=True, help="Host tier budget.")
@click.option("--disk-size", "disk_bytes", callback=_bytes, default="4GiB", show_default=True, help="Disk tier budget (LMDB map size).")
@click.option("--write-through/--write-back", default=False, show_default=True, help="Host tier write policy.")
@click.option("--belady/--no-belady", default=True, show_default=True, help="Compute Belady's upper bound.")
@click.option("--policy", "policy_list", default="default", show_default=True, metavar="NAME[,NAME...]",
              help="Eviction policy of the device, host and disk tiers (default = duel, kvtier's own; duel, lru, s3fifo, arc, hitdensity). A comma list needs --simulate --sweep. "
                   "Through a daemon: the embedded daemon's --policy (an existing --server keeps its own).")
@click.option("--sweep", "sweep_list", default=None, metavar="TOKENS[,TOKENS...]",
              help="Policy lab (with --simulate): every policy at each total capacity in trace tokens (a 512-token "
                   "block counts 512; e.g. 1e6,3e6,1e7), with Belady's bound at each.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), default=None,
              help="With --sweep: write hit rate vs capacity as DIR/policy-sweep.png.")
def replay(trace_path: str, model: str, n_requests: int | None, server: str | None, transport: str, simulate: bool,
           json_path: str | None,
           num_layers: int, tokens_per_block: int, device_tokens: int, host_bytes: int, disk_bytes: int,
           write_through: bool, belady: bool, policy_list: str, sweep_list: str | None, plot_dir: str | None) -> None:
    """Replay the Mooncake trace: prefix lookups, loads from every tier, verified bytes, hit rates.

    Example: kvtier replay --trace ../shared/data/conversation_trace.jsonl --requests 2000

    Policy lab: kvtier replay --simulate --policy lru,s3fifo,default --sweep 1e6,1e7 --json lab.json --plot out/

    "seconds" times the replay itself; "wall seconds" the whole command, from the interpreter's start
    (imports and the embedded daemon's start and stop included).
    """
    from kvtier.server.replay.scale import ReplayScale
    from kvtier.server.replay.trace import read_trace
    from kvtier.server.tiers.policies import resolve_policy

    try:
        policies = [p.strip() for p in policy_list.split(",") if p.strip()]
        if not policies:
            raise ValueError("--policy needs at least one name")
        for p in policies:
            resolve_policy(p)
        capacities = _parse_sweep(sweep_list) if sweep_list is not None else None
        if capacities is None and len(policies) > 1:
            raise ValueError("several policies need --simulate --sweep CAPACITIES (the policy lab)")
        if capacities is not None and not simulate:
            raise ValueError("--sweep runs the policy lab on the simulator: add --simulate")
        if plot_dir is not None and capacities is None:
            raise ValueError("--plot draws a --sweep")
        if json_path is not None:  # checked before the replay, not after it
            parent = os.path.dirname(os.path.abspath(json_path))
            if not os.path.isdir(parent):
                raise ValueError(f"--json {json_path}: the directory {parent} does not exist; create it or give another path")
            check_output_path(json_path, "--json")  # a device node, FIFO or socket there was replaced (attack pass 7, A7-6)
        if plot_dir is not None:  # a device node or FIFO there: refused now, not after the sweep (A9-5)
            if os.path.lexists(plot_dir) and not os.path.isdir(plot_dir):
                raise ValueError(f"--plot {plot_dir} exists and is not a directory; pass a directory (made if missing)")
            check_output_path(Path(plot_dir) / "policy-sweep.png", "--plot")
    except (ValueError, OutputPathError) as e:
        raise click.UsageError(str(e)) from None
    scale = ReplayScale(model=model, num_layers=num_layers, tokens_per_block=tokens_per_block,
                        device_tokens=device_tokens, host_bytes=host_bytes, disk_bytes=disk_bytes,
                        write_back=not write_through, policy=policies[0])
    try:
        scale.validate()
        if server is not None:
            pick_transport(transport, server)
        requests = read_trace(trace_path, n_requests)
    except (ValueError, OSError) as e:
        raise click.UsageError(str(e)) from None
    if capacities is not None:
        _lab(requests, scale, policies, capacities, json_path, plot_dir)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("[bold]replay"), BarColumn(), MofNCompleteColumn(), TextColumn("hit {task.fields[hit]}"),
                  TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task("replay", total=len(requests), hit="-")

        def tick(i: int, partial: ReplayResult) -> None:
            if i % 25 == 0 or i + 1 == len(requests):
                bar.update(task, completed=i + 1, hit=f"{partial.hit_rate:.1%}")

        try:
            res = simulate_fn(requests, scale, tick) if simulate else replay_through_daemon(
                requests, scale, server=server, on_request=tick, transport=transport)
        except Exception as e:  # a daemon error (e.g. a request larger than the pool) or a failed start
            if type(e).__module__.startswith(("kvtier.client", "kvtier.server.tiers")) or isinstance(e, RuntimeError):
                raise click.ClickException(f"{type(e).__name__}: {e}") from None
            raise
    from kvtier.server.replay.driver import belady_bound

    bound = belady_bound(requests, scale) if belady else None
    res.belady_hit_tokens = bound
    wall = process_wall_seconds()
    click.echo(f"trace: {Path(trace_path).resolve()} ({len(requests):,} requests)")
    _print_report(res, bound, wall)
    if json_path:
        write_private_file(json_path, json.dumps({**res.to_dict(), "wall_seconds": wall,
                                                  "trace": str(Path(trace_path).resolve())}, indent=1) + "\n")
    if res.verify_failures:
        raise SystemExit(1)


def _parse_sweep(value: str) -> list[float]:
    """``"1e6,3e6"`` -> capacities in trace tokens. Raises ValueError naming a bad item."""
    out = []
    for item in value.split(","):
        try:
            cap = float(item)
        except ValueError:
            raise ValueError(f"--sweep takes a comma list of token counts (e.g. 1e6,1e7), got {item!r}") from None
        if not 0 < cap < float("inf"):
            raise ValueError(f"--sweep capacities must be positive token counts, got {item!r}")
        out.append(cap)
    if not out:
        raise ValueError("--sweep needs at least one capacity")
    return out


def _lab(requests: list[Any], scale: ReplayScale, policies: list[str], capacities: list[float],
         json_path: str | None, plot_dir: str | None) -> None:
    """The policy lab: run, print a table, write JSON and the PNG."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Table

    from kvtier.server.replay.sweep import plot_sweep, run_sweep

    runs = len(policies) * len(capacities)
    with Progress(TextColumn("[bold]policy lab"), TextColumn("{task.fields[label]}"), BarColumn(),
                  TextColumn("{task.percentage:>3.0f}%"), TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task("lab", total=runs * len(requests), label="")
        done = [0]

        def step(label: str, i: int, n: int) -> None:
            done[0] += 1
            if i % 200 == 0 or i + 1 == n:
                bar.update(task, completed=done[0], label=label)

        rows = run_sweep(requests, scale, policies, capacities, on_step=step)
    t = Table(title=f"policy lab ({len(requests):,} requests, hit rate = blocks hit / blocks)")
    for col in ("capacity (tokens)", "policy", "hit rate", "Belady", "closed vs lru", "device", "host", "disk",
                "input-token hit rate", "written to disk"):
        t.add_column(col, justify="right")
    for r in rows:
        lru = next((x for x in rows if x.capacity_tokens == r.capacity_tokens and x.policy == "lru"), None)
        closed = "-"
        if lru is not None and r.belady_hit_rate > lru.hit_rate:
            closed = f"{(r.hit_rate - lru.hit_rate) / (r.belady_hit_rate - lru.hit_rate):+.0%}"
        t.add_row(f"{r.capacity_tokens:,}", r.policy, f"{r.hit_rate:.2%}", f"{r.belady_hit_rate:.2%}", closed,
                  *(f"{r.tier_hit_rate.get(k, 0.0):.2%}" for k in ("device", "host", "disk")),
                  f"{r.input_token_hit_rate:.2%}", _fmt_bytes(r.bytes_written.get("disk", 0)))
    Console().print(t)
    if json_path:
        write_private_file(json_path, json.dumps({"sweep": [r.to_dict() for r in rows]}, indent=1) + "\n")
    if plot_dir:
        private_dirs(plot_dir, "--plot")
        plot_sweep(rows, str(Path(plot_dir) / "policy-sweep.png"))
        click.echo(f"plot: {Path(plot_dir) / 'policy-sweep.png'}")


def simulate_fn(requests: list[Any], scale: ReplayScale, tick: Any) -> ReplayResult:
    """``--simulate``: see :func:`simulate`."""
    return simulate(requests, scale, on_request=tick)
