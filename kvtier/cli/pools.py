"""``kvtier pools``: the daemon's pools, their sizes, use and skip-aware layout."""

from __future__ import annotations

import json

import click

from kvtier.cli.common import call_daemon, console, message_to_dict, open_client, server_options, shown


@click.command()
@server_options
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of pools instead of a table.")
def pools(server: str | None, timeout: float, as_json: bool) -> None:
    """List the pools of a running daemon."""
    with open_client(server, timeout) as c:
        infos = call_daemon(c.list_pools)
    if as_json:
        click.echo(json.dumps([message_to_dict(p) for p in infos]))
        return
    from rich.table import Table

    t = Table(title=f"kvtier pools at {shown(c.address)}")
    for col in ("pool", "model", "role", "device", "dtype", "layers/live", "layer range", "tokens", "used", "free", "bytes"):
        t.add_column(col, justify="right" if col in ("tokens", "used", "free", "bytes") else "left")
    for p in infos:
        ps = p.layout.page_size
        t.add_row(shown(p.pool_id), shown(p.layout.model_name), shown(p.role), shown(p.device), shown(p.layout.kv_cache_dtype),
                  f"{p.layout.num_layers}/{len(p.live_layers)}",
                  f"{p.layout.start_layer}-{p.layout.start_layer + p.layout.num_layers - 1}", f"{p.size_tokens:,}", f"{p.used_pages * ps:,}",
                  f"{p.free_pages * ps:,}", f"{p.kv_size_bytes:,}")
    console().print(t)
