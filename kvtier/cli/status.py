"""``kvtier status``: is the daemon serving, what it holds, its counters."""

from __future__ import annotations

import json

import click

from kvtier.cli.common import call_daemon, console, message_to_dict, open_client, server_options, shown


@click.command(short_help='Health, version, tiers and pools of a running daemon.')
@server_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def status(server: str | None, timeout: float, as_json: bool) -> None:
    """Health, version, uptime, tier usage and health, your pools (with their open prefix leases and
    the pages those pin), and counters of a running daemon.

    A tier whose storage failed (e.g. the disk tier on a full filesystem) shows UNHEALTHY with the
    reason and when it is probed next; the daemon bypasses it meanwhile and brings it back by itself.

    On a daemon with tenants, set KVTIER_TOKEN to your token: you see your pools and counters, and
    each tier's use by all tenants beside your own bytes and quota.
    """
    with open_client(server, timeout) as c:
        health = call_daemon(c.health)
        stats = call_daemon(c.stats)
    if as_json:
        click.echo(json.dumps({"address": c.address, "health": health, **message_to_dict(stats)}))
        return
    from rich.table import Table

    con = console()
    con.print(f"[bold]kvtier {shown(stats.version)}[/] at {shown(c.address)}: {shown(health)}, up {stats.uptime_seconds:.0f}s, "
              f"device {shown(stats.device)}, tenant {shown(stats.tenant)}: {len(stats.pools)} pool{'' if len(stats.pools) == 1 else 's'}, "
              f"max message {stats.max_message_bytes:,} bytes")
    if stats.metrics_address:
        con.print(f"metrics: {shown(stats.metrics_address)}")
    t = Table(title="tiers (all tenants; yours beside)",
              caption="device: the pools' memory (entries: pools; budget: --pool-memory); the pages in use are in the "
                      "pools table and the kvtier_tier_used_bytes metric")
    for col in ("tier", "health", "policy", "used bytes", "budget bytes", "entries", "your bytes", "your quota"):
        t.add_column(col, justify="left" if col in ("tier", "health", "policy") else "right")
    for tier in stats.tiers:
        quota = f"{tier.tenant_quota_bytes:,}" if tier.HasField("tenant_quota_bytes") else "-"
        t.add_row(shown(tier.tier), _health(tier), shown(tier.policy) or "-", f"{tier.used_bytes:,}", f"{tier.budget_bytes:,}" if tier.budget_bytes else "-",
                  f"{tier.entries:,}", f"{tier.tenant_used_bytes:,}", quota)
    con.print(t)
    if stats.pools:
        pt = Table(title="pools (yours)")
        for col in ("pool", "model", "used tokens", "size tokens", "open leases", "pinned pages"):
            pt.add_column(col, justify="left" if col in ("pool", "model") else "right")
        for p in stats.pools:
            pt.add_row(shown(p.pool_id), shown(p.model_name), f"{p.used_tokens:,}", f"{p.size_tokens:,}", f"{p.open_leases:,}",
                       f"{p.pinned_pages:,}")
        con.print(pt)
    if stats.counters:
        ct = Table(title="counters")
        ct.add_column("counter")
        ct.add_column("value", justify="right")
        for k in sorted(stats.counters):
            ct.add_row(shown(k), f"{stats.counters[k]:,}")
        con.print(ct)


def _health(tier: object) -> str:
    """``ok``, or ``UNHEALTHY: <reason> (next probe in Ns)``."""
    if not getattr(tier, "unhealthy", False):
        return "ok"
    return f"[bold red]UNHEALTHY[/]: {shown(tier.unhealthy_reason)} (next probe in {tier.next_probe_seconds:.0f}s)"  # type: ignore[attr-defined]
