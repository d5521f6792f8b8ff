"""``kvtier serve`` flags for the tiers: ``--tiers``, ``--disk-path``, ``--disk-size``,
``--disk-max-readers``, ``--disk-sync``, ``--write-through`` and the ``--mooncake-*`` settings of the
Mooncake Store tier.

They are added to the ``serve`` command by :func:`add_tier_options` (one line in
``kvtier/cli/__init__.py``) and reach the daemon as its ``tiers`` setting
(:class:`~kvtier.server.daemon.tier_settings.TierSettings`): the config file's ``[tiers]`` table
(checked here, so a bad key is a usage error) with the given flags over it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from kvtier.sizes import parse_bytes

if TYPE_CHECKING:
    from kvtier.server.daemon.tier_settings import TierSettings

_META = "kvtier.tier_flags"


def _remember(name: str, convert: Any = None) -> Any:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is None or (ctx.get_parameter_source(param.name or "") == click.core.ParameterSource.DEFAULT):
            return
        try:
            ctx.meta.setdefault(_META, {})[name] = convert(value) if convert else value
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return callback


def _parse_stack(value: Any) -> tuple[str, ...]:
    from kvtier.server.daemon.tier_settings import parse_stack

    return parse_stack(value)


def _settings(ctx: click.Context, _param: click.Parameter, _value: Any) -> TierSettings | None:
    flags = ctx.meta.get(_META, {})
    if not flags and not ctx.params.get("config_file"):
        return None  # the daemon's defaults (and nothing imported before the command runs)
    from kvtier.server.daemon.tier_settings import TierSettings, mooncake_config

    try:
        base = TierSettings()
        config_file = ctx.params.get("config_file")
        if config_file:  # check the file's [tiers] now (a clear usage error) and put the flags over it
            import tomllib

            from kvtier.server.daemon.private_files import AuthConfigError, read_trusted_file

            try:  # the daemon's own checks first: a regular file no other user could write, read without
                raw = read_trusted_file(config_file, "--config")  # blocking (/dev/zero, a FIFO: A9-9)
            except AuthConfigError as e:
                raise click.ClickException(str(e)) from None
            base = TierSettings.coerce(tomllib.loads(raw.decode("utf-8", errors="replace")).get("tiers"))
        mooncake = {k.split(".", 1)[1]: v for k, v in flags.items() if k.startswith("mooncake.")}
        plain = {k: v for k, v in flags.items() if not k.startswith("mooncake.")}
        return TierSettings(**{**base.__dict__, **plain, "mooncake": mooncake_config(base.mooncake, **mooncake)})
    except (ValueError, OSError) as e:
        raise click.UsageError(str(e)) from None


def add_tier_options(command: click.Command) -> click.Command:
    """Add the tier flags to ``command`` (``kvtier serve``); it receives them as ``tiers=``."""
    command.params.extend([
        click.Option(["--disk-path"], default=None, metavar="DIR", expose_value=False,
                     callback=_remember("disk_path"),
                     help="Directory of the LMDB disk tier (created if missing); none: host tier only."),
        click.Option(["--disk-size"], default=None, metavar="BYTES", expose_value=False,
                     callback=_remember("disk_bytes", lambda v: parse_bytes(v, "--disk-size")),
                     help="Disk tier budget = LMDB map size, e.g. 64GiB [4GiB]."),
        click.Option(["--disk-max-readers"], type=click.IntRange(min=16, max=4096), default=None, expose_value=False,
                     callback=_remember("disk_max_readers"), help="LMDB reader slots, 16-4096 [126]."),
        click.Option(["--disk-sync/--no-disk-sync"], default=None, expose_value=False, callback=_remember("disk_sync"),
                     help="fsync every disk commit [no]."),
        click.Option(["--disk-write-behind/--no-disk-write-behind"], default=None, expose_value=False,
                     callback=_remember("disk_write_behind"),
                     help="Commit disk writes on a writer thread, off the request path (records are read "
                          "from memory until they commit) [yes]."),
        click.Option(["--write-through/--write-back"], default=None, expose_value=False,
                     callback=_remember("write_through"),
                     help="Host tier writes records to disk on entry (write-through) or on eviction [write-back]."),
        click.Option(["--policy"], default=None, metavar="NAME", expose_value=False, callback=_remember("policy"),
                     help="Eviction policy of the device, host and disk tiers (each its own instance; mooncake keeps lru): "
                          "default (= duel, kvtier's own; see docs/concepts/eviction.md), duel, lru, s3fifo, arc or hitdensity [default: default]."),
        click.Option(["--tiers", "tier_stack"], default=None, metavar="NAMES", expose_value=False,
                     callback=_remember("stack", _parse_stack),
                     help="Tiers below the device, fastest first, from host, disk, mooncake "
                          "[host, and disk with --disk-path]. E.g. host,disk,mooncake."),
        click.Option(["--mooncake-master"], default=None, metavar="HOST:PORT", expose_value=False,
                     callback=_remember("mooncake.master"),
                     help="mooncake_master RPC address of the shared Mooncake Store tier [127.0.0.1:50051]."),
        click.Option(["--mooncake-metadata"], default=None, metavar="URL", expose_value=False,
                     callback=_remember("mooncake.metadata"),
                     help="Transfer metadata: the master's HTTP metadata server http://HOST:PORT/metadata, or "
                          "P2PHANDSHAKE (every client of the store must use the same) [http://127.0.0.1:8080/metadata]."),
        click.Option(["--mooncake-protocol"], type=click.Choice(["tcp", "rdma"]), default=None, expose_value=False,
                     callback=_remember("mooncake.protocol"), help="Mooncake transfer protocol [tcp]."),
        click.Option(["--mooncake-rdma-devices"], default=None, metavar="DEVS", expose_value=False,
                     callback=_remember("mooncake.rdma_devices"), help="RDMA devices for --mooncake-protocol rdma, e.g. mlx5_0."),
        click.Option(["--mooncake-hostname"], default=None, metavar="HOST", expose_value=False,
                     callback=_remember("mooncake.local_hostname"),
                     help="Address this daemon's store client publishes to its peers [127.0.0.1]."),
        click.Option(["--mooncake-segment-size"], default=None, metavar="BYTES", expose_value=False,
                     callback=_remember("mooncake.global_segment_bytes", lambda v: parse_bytes(v, "--mooncake-segment-size")),
                     help="Host memory this daemon lends to the shared store, e.g. 8GiB [1GiB]; 0: none."),
        click.Option(["--mooncake-replicas"], type=click.IntRange(min=1), default=None, expose_value=False,
                     callback=_remember("mooncake.replicas"), help="Copies of each object in the store [1]."),
        click.Option(["--mooncake-soft-pin/--no-mooncake-soft-pin"], default=None, expose_value=False,
                     callback=_remember("mooncake.soft_pin"),
                     help="Soft-pin the objects this daemon puts (the store evicts them last) [no]."),
        # processed last (never on the command line): turns the flags above into the tiers setting
        click.Option(["--tiers-from-flags", "tiers"], hidden=True, default=None, callback=_settings, expose_value=True),
    ])
    return command
