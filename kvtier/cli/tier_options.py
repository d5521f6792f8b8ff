"""``kvtier serve`` flags for the tiers: ``--disk-path``, ``--disk-size``, ``--disk-max-readers``,
``--disk-sync``, ``--write-through``.

They are added to the ``serve`` command by :func:`add_tier_options` (one line in
``kvtier/cli/__init__.py``) and reach the daemon as its ``tiers`` setting
(:class:`~kvtier.server.daemon.tier_settings.TierSettings`): the config file's ``[tiers]`` table
(checked here, so a bad key is a usage error) with the given flags over it.
"""

from __future__ import annotations

from typing import Any

import click

from kvtier.server.daemon.config import parse_bytes
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


def _settings(ctx: click.Context, _param: click.Parameter, _value: Any) -> TierSettings | None:
    flags = ctx.meta.get(_META, {})
    try:
        base = TierSettings()
        config_file = ctx.params.get("config_file")
        if config_file:  # check the file's [tiers] now (a clear usage error) and put the flags over it
            import tomllib

            with open(config_file, "rb") as f:
                base = TierSettings.coerce(tomllib.load(f).get("tiers"))
        return TierSettings(**{**base.__dict__, **flags})
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
        click.Option(["--disk-max-readers"], type=click.IntRange(min=1), default=None, expose_value=False,
                     callback=_remember("disk_max_readers"), help="LMDB reader slots [126]."),
        click.Option(["--disk-sync/--no-disk-sync"], default=None, expose_value=False, callback=_remember("disk_sync"),
                     help="fsync every disk commit [no]."),
        click.Option(["--write-through/--write-back"], default=None, expose_value=False,
                     callback=_remember("write_through"),
                     help="Host tier writes records to disk on entry (write-through) or on eviction [write-back]."),
        # processed last (never on the command line): turns the flags above into the tiers setting
        click.Option(["--tiers-from-flags", "tiers"], hidden=True, default=None, callback=_settings, expose_value=True),
    ])
    return command
