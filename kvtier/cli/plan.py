"""``kvtier plan``: how many tokens a pool holds in a byte budget, naive vs skip-aware."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool.factory import POOL_ROLES
from kvtier.server.pool_configurator import ACCOUNTINGS, plan_pool
from kvtier.server.presets import preset_names


def load_model(model: str, kv_dtype: str, page_size: int = 64) -> DSAModelConfig:
    """A preset name or a path to an HF config.json -> DSAModelConfig (click errors on failure)."""
    try:
        if Path(model).is_file():
            return DSAModelConfig.from_hf_config(model, kv_cache_dtype=kv_dtype, page_size=page_size)
        return DSAModelConfig.from_preset(model, kv_cache_dtype=kv_dtype, page_size=page_size)
    except (ValueError, OSError) as e:
        raise click.BadParameter(str(e), param_hint="--model") from None


def _bytes(_ctx: click.Context, _param: click.Parameter, value: str) -> int:
    from kvtier.server.daemon.config import parse_bytes

    try:
        return parse_bytes(value, "--available-bytes")
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command()
@click.option("--model", "model", default="glm-5.2", show_default=True,
              help=f"Preset ({', '.join(preset_names())}) or path to an HF config.json.")
@click.option("--available-bytes", callback=_bytes, required=True, metavar="BYTES",
              help="Device bytes available for the KV pool: an integer or a size such as 80GiB or 134.227GB.")
@click.option("--kv-dtype", type=click.Choice(["fp8", "bf16"]), default="fp8", show_default=True,
              help="KV cache dtype (fp8: 656-byte DSA rows; bf16: 1152-byte rows).")
@click.option("--accounting", type=click.Choice(list(ACCOUNTINGS)), default="exact", show_default=True,
              help="exact: bytes the pool really allocates; sglang: SGLang's estimate (576-byte latent row).")
@click.option("--role", type=click.Choice(list(POOL_ROLES)), default="target", show_default=True,
              help="Pool role: draft and hisparse pools keep an indexer buffer on every layer.")
@click.option("--page-size", type=click.IntRange(min=1), default=64, show_default=True, help="Tokens per page.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def plan(model: str, available_bytes: int, kv_dtype: str, accounting: str, role: str, page_size: int, as_json: bool) -> None:
    """Plan a pool: tokens that fit naive vs skip-aware, and the bytes skip-awareness saves.

    Example: kvtier plan --model glm-5.2 --available-bytes 134227000000 --accounting sglang
    """
    cfg = load_model(model, kv_dtype, page_size)
    p = plan_pool(cfg, available_bytes, accounting=accounting, role=role)
    if p.naive_tokens == 0 or p.skip_aware_tokens == 0:
        raise click.ClickException(
            f"{available_bytes:,} bytes do not hold one page of {cfg.name} ({p.page_size} tokens) with the "
            f"{accounting} accounting (one page needs {_one_page_bytes(cfg, accounting, role):,} bytes skip-aware)")
    if as_json:
        click.echo(json.dumps(p.to_dict(), indent=None))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"kvtier plan: {p.model} {p.kv_cache_dtype}, {p.accounting} accounting, {p.role} pool")
    t.add_column("", style="bold")
    t.add_column("naive (indexer on every layer)", justify="right")
    t.add_column("skip-aware", justify="right")
    t.add_row("bytes per token (cell)", f"{p.naive_cell_bytes:,}", f"{p.skip_aware_cell_bytes:,}")
    t.add_row("max total tokens", f"{p.naive_tokens:,}", f"{p.skip_aware_tokens:,}")
    t.add_row("pool bytes", f"{p.naive_pool_bytes:,}", f"{p.skip_aware_pool_bytes:,}")
    c = Console()
    c.print(t)
    live = p.live_indexer_layers
    c.print(f"available bytes      {p.available_bytes:,}")
    c.print(f"layers               {p.num_layers} ({len(live)} with an indexer buffer, {p.num_layers - len(live)} skip top-k)")
    c.print(f"live indexer layers  {_ranges(live)}")
    c.print(f"gain                 {p.gain_ratio:.4f}x tokens ({(p.gain_ratio - 1) * 100:+.1f}%)")
    c.print(f"saved                {p.saved_bytes_per_token:,} bytes a token; {p.saved_bytes:,} bytes "
            f"({p.saved_bytes / 1e9:.1f} GB) at the naive token count")


def _one_page_bytes(cfg: DSAModelConfig, accounting: str, role: str) -> int:
    from kvtier.server.pool_configurator import cell_size_bytes, exact_pool_bytes

    if accounting == "exact":
        return exact_pool_bytes(cfg, cfg.page_size, skip_aware=True, role=role)
    return cell_size_bytes(cfg, skip_aware=True, accounting=accounting, role=role) * cfg.page_size


def _ranges(ids: list[int]) -> str:
    return ",".join(map(str, ids)) if len(ids) <= 24 else ",".join(map(str, ids[:6])) + f",...,{ids[-1]}"
