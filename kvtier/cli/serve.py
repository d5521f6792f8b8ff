"""``kvtier serve``: run the daemon (flags override the TOML file's keys)."""

from __future__ import annotations

import os
import sys

import click

from kvtier.sizes import parse_bytes

# kvtier.server.daemon.config.LOG_LEVELS (a test checks they agree): the daemon's modules are imported
# only when it starts, so `kvtier serve --help` and usage errors load neither them nor torch.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _bytes(_ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_bytes(value, (param.opts or [str(param.name)])[0])
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _layers(_ctx: click.Context, _param: click.Parameter, value: str | None) -> dict[str, int] | None:
    """``N`` -> the first N layers; ``START:END`` -> model layers [START, END)."""
    if value is None:
        return None
    start, sep, end = value.partition(":")
    if not sep and value.isdigit() and int(value) > 0:
        return {"num_layers": int(value)}
    if sep and start.isdigit() and end.isdigit() and int(start) < int(end):
        return {"start_layer": int(start), "end_layer": int(end)}
    raise click.BadParameter(f"must be N (the first N layers) or START:END with START < END, e.g. 20:40; got {value!r}")


@click.command(short_help='Run the kvtier daemon (until SIGTERM/SIGINT).')
@click.option("--listen", default=None, metavar="ADDR",
              help="unix:///path or HOST:PORT (port 0: any free port). Default: a unix socket in a private "
                   "directory ($XDG_RUNTIME_DIR/kvtier or /tmp/kvtier-UID). TCP only on loopback unless TLS and "
                   "--auth-tokens are set, and on loopback only with --auth-tokens, mutual TLS or "
                   "--allow-unauthenticated; one daemon a port.")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="TOML file with DaemonConfig keys (flags given here override it).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None, help="Pool device [auto].")
@click.option("--host-memory", "host_memory_bytes", callback=_bytes, default=None, metavar="BYTES",
              help="Host tier budget (offloaded copies, and prefix pages evicted from the pools), e.g. 8GiB [4GiB].")
@click.option("--pool-memory", "pool_memory_bytes", callback=_bytes, default=None, metavar="BYTES",
              help="Cap on all pools' bytes together; 0 = none [0].")
@click.option("--workers", type=click.IntRange(min=2), default=None, help="gRPC worker threads, at least 2 [16].")
@click.option("--torch-threads", type=click.IntRange(min=1), default=None, help="torch intra-op threads [1].")
@click.option("--copy-threads", type=click.IntRange(min=0, max=64), default=None,
              help="Threads a large host copy is split over; 0 = the machine's cores [0].")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default=None, help="[info]")
@click.option("--max-message-bytes", callback=_bytes, default=None, metavar="BYTES",
              help="Largest gRPC message either way [4MiB]; clients must use the same.")
@click.option("--chunk-bytes", callback=_bytes, default=None, metavar="BYTES",
              help="Data bytes per streamed KV chunk the daemon sends [1MiB].")
@click.option("--grace", "grace_seconds", type=click.FloatRange(min=0), default=None,
              help="Seconds in-flight calls may run on after SIGTERM/SIGINT [10].")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), default=None, help="PEM certificate (TLS).")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), default=None, help="PEM private key (TLS).")
@click.option("--tls-client-ca", type=click.Path(exists=True, dir_okay=False), default=None,
              help="PEM CA of client certificates: mutual TLS, every client must present one it signed.")
@click.option("--allow-unauthenticated", is_flag=True, default=None,
              help="Serve a loopback TCP --listen without --auth-tokens (a WARNING at start): any local user may "
                   "then read, overwrite and free every pool's KV. Refused without it; a unix socket needs neither.")
@click.option("--auth-tokens", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="TOML [tokens] table (token = tenant), owned by this user, mode 0600: tenants; every call "
                   "needs 'authorization: Bearer <token>'. Without it: one tenant, unix socket or loopback only.")
@click.option("--peer-tls-ca", type=click.Path(exists=True, dir_okay=False), default=None,
              help="PEM CA to reach PD peers over TLS for PullKV (this daemon's --tls-cert is its client certificate).")
@click.option("--pd-peers", default=None, metavar="unix:///PATH,...",
              help="Unix-socket PD peers PullKV may name besides this daemon's own address (others are refused: "
                   "their file permissions would be bypassed). TCP peers need no listing.")
@click.option("--max-streams", type=click.IntRange(min=1), default=None,
              help="KV streams (and PullKVs asking a peer) in flight at once; more are refused; below --workers [half of --workers].")
@click.option("--max-streams-per-tenant", type=click.IntRange(min=1), default=None,
              help="KV streams one tenant may hold at once; more of that tenant are refused [all of --max-streams "
                   "with one tenant, half of them, rounded up, with more].")
@click.option("--stream-idle-seconds", type=click.FloatRange(min=0.1), default=None,
              help="Cancel a KV stream that moves no message this long [30].")
@click.option("--request-arrival-seconds", type=click.FloatRange(min=0.1), default=None,
              help="Cancel a call whose request message has not arrived this long after its headers [5].")
@click.option("--peer-retry-seconds", type=click.FloatRange(min=0.1), default=None,
              help="A PullKV without a deadline resends a ReadPages its peer refused as 'retry' this long [30].")
@click.option("--close-seconds", type=click.FloatRange(min=0.1), default=None,
              help="Time the shutdown work may take after the grace period before the daemon exits anyway [60].")
@click.option("--ready-file", type=click.Path(dir_okay=False), default=None,
              help="Write the bound address here once serving.")
@click.option("--transfer-engine", type=click.Choice(["mooncake", "none"]), default=None,
              help="PD transfer engine [none]. mooncake opens engine ports that listen on every interface and serve "
                   "reads and writes of this process's memory without authentication: trusted hosts and networks "
                   "only (docs/operations/security.md, PD peers).")
@click.option("--transfer-host", default=None, metavar="HOST", help="Address the transfer engine publishes to peers [127.0.0.1] (its ports listen on every interface).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
              help="Serve Prometheus metrics on http://HOST:PORT/metrics (0: a free port; kvtier status shows it). "
                   "Needs --metrics-token-file or --metrics-insecure.")
@click.option("--metrics-host", default=None, metavar="HOST", help="Address the metrics endpoint binds [127.0.0.1].")
@click.option("--metrics-token-file", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="File holding the bearer token every scrape must send (Prometheus: authorization: "
                   "credentials_file:), owned by this user, mode 0600, at least 16 characters; else 401.")
@click.option("--metrics-insecure", is_flag=True, default=None,
              help="Serve --metrics-port without a token (a WARNING at start): whoever reaches the port reads "
                   "tenant names, pool ids and per-tenant call counts.")
@click.option("--log-format", type=click.Choice(["text", "json"]), default=None,
              help="Log lines as text or one JSON object a line [text].")
@click.option("--pool", "pools", multiple=True, metavar="[ID=]MODEL:TOKENS|BYTES",
              help="Create a pool at start, e.g. glm-5.2:65536 (named 'default') or main=glm-5.2:2GiB (repeatable; "
                   "replaces the file's pools).")
@click.option("--pool-layers", callback=_layers, default=None, metavar="N|START:END",
              help="Layers of --pool pools: the first N (small test pools), or model layers START..END-1 "
                   "(a pipeline-parallel stage, e.g. 20:40).")
def serve(config_file: str | None, pools: tuple[str, ...], pool_layers: dict[str, int] | None, **flags: object) -> None:
    """Run the kvtier daemon until SIGTERM/SIGINT (then finish in-flight calls and exit 0).

    Example: kvtier serve --pool glm-5.2:65536 --host-memory 8GiB
    """
    if pool_layers and not pools:
        raise click.UsageError("--pool-layers sets the layers of --pool pools: give --pool too (e.g. --pool glm-5.2:4096 "
                               "--pool-layers 20:40)")
    from kvtier.server.daemon.config import DaemonConfig, PoolSpec
    from kvtier.server.daemon.errors import KVTierError
    from kvtier.server.service.server import AddressError, serve as run
    from kvtier.server.transfer.errors import TransferEngineUnavailable

    try:
        cfg = DaemonConfig.from_toml(config_file) if config_file else DaemonConfig()
        if flags.get("log_level"):
            flags["log_level"] = str(flags["log_level"]).upper()
        specs = None
        if pools:
            specs = tuple(PoolSpec.parse(p) for p in pools)
            if pool_layers:
                specs = tuple(PoolSpec(**{**s.__dict__, **pool_layers}) for s in specs)
        cfg = cfg.replace(pools=specs, **flags)
    except (ValueError, OSError) as e:
        raise click.UsageError(str(e)) from None
    if config_file and cfg.ready_file and os.path.realpath(cfg.ready_file) == os.path.realpath(config_file):
        raise click.ClickException(f"--ready-file {cfg.ready_file} is the --config file, which the ready file would "
                                   f"replace; give another path")  # attack pass 7, A7-6 (the daemon checks its other files)
    try:
        code = run(cfg)
    # bad address, device, disk path, a configured pool that cannot be created, a missing transfer engine
    except (AddressError, KVTierError, ValueError, TransferEngineUnavailable) as e:
        raise click.ClickException(str(e)) from None
    sys.exit(code)
