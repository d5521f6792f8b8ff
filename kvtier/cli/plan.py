"""``kvtier plan``: how many tokens a pool holds in a byte budget, naive vs skip-aware."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.presets import preset_names

# kvtier.server.pool.factory.POOL_ROLES and kvtier.server.pool_configurator.ACCOUNTINGS (tests check they
# agree): the pool modules import torch, which `kvtier plan --help` and usage errors need not load.
POOL_ROLES: tuple[str, ...] = ("target", "draft", "hisparse")
ACCOUNTINGS: tuple[str, ...] = ("exact", "sglang")


def load_model(model: str, kv_dtype: str, page_size: int = 64, *, start_layer: int = 0,
               end_layer: int | None = None) -> DSAModelConfig:
    """A preset name or a path to an HF config.json -> DSAModelConfig of layers ``[start_layer,
    end_layer)`` (click errors on failure)."""
    try:
        kw = {"kv_cache_dtype": kv_dtype, "page_size": page_size, "start_layer": start_layer, "end_layer": end_layer}
        if Path(model).is_file():
            return DSAModelConfig.from_hf_config(model, **kw)
        return DSAModelConfig.from_preset(model, **kw)
    except (ValueError, OSError) as e:
        raise click.BadParameter(str(e), param_hint="--model") from None


def _partition(_ctx: click.Context, _param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if not value:
        return None
    try:
        return tuple(int(x) for x in value.split(","))
    except ValueError:
        raise click.BadParameter(f"must be layer counts separated by commas, e.g. 20,20,19,19; got {value!r}") from None


def _bytes(_ctx: click.Context, _param: click.Parameter, value: str) -> int:
    from kvtier.sizes import parse_bytes

    try:
        return parse_bytes(value, "--available-bytes")
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command(short_help='Plan a pool: tokens that fit, naive vs skip-aware, and its bytes.')
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
@click.option("--pp-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Pipeline-parallel stages: plan each stage's pool (its layers split as SGLang splits them) "
                   "with --available-bytes on each stage's device.")
@click.option("--pp-partition", callback=_partition, default=None, metavar="N,N,...",
              help="Layers per stage instead of the even split (SGLang's SGLANG_PP_LAYER_PARTITION).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def plan(model: str, available_bytes: int, kv_dtype: str, accounting: str, role: str, page_size: int, pp_size: int,
         pp_partition: tuple[int, ...] | None, as_json: bool) -> None:
    """Plan a pool: tokens that fit naive vs skip-aware, and the bytes skip-awareness saves.

    Example: kvtier plan --model glm-5.2 --available-bytes 134227000000 --accounting sglang

    With --pp-size N: one plan per pipeline stage (kvtier plan --model glm-5.2 --available-bytes 80GiB --pp-size 4).
    """
    if pp_partition and len(pp_partition) != pp_size:  # a partition without --pp-size was ignored (attack pass 6, A6-8)
        raise click.BadParameter(f"{len(pp_partition)} stages in --pp-partition but --pp-size {pp_size}: give "
                                 f"--pp-size {len(pp_partition)}", param_hint="--pp-partition")
    if pp_size > 1 or pp_partition:
        _plan_stages(model, available_bytes, kv_dtype, accounting, role, page_size, pp_size, pp_partition, as_json)
        return
    from kvtier.server.pool_configurator import plan_pool

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


def _plan_stages(model: str, available_bytes: int, kv_dtype: str, accounting: str, role: str, page_size: int,
                 pp_size: int, partition: tuple[int, ...] | None, as_json: bool) -> None:
    """``--pp-size``: each stage's layers, live indexer layers and capacity; the smallest bounds the deployment."""
    from kvtier.server.model_config import pp_layer_range
    from kvtier.server.pool_configurator import plan_pool

    whole = load_model(model, kv_dtype, page_size)
    try:
        ranges = [pp_layer_range(whole.num_layers, r, pp_size, partition) for r in range(pp_size)]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--pp-size/--pp-partition") from None
    stages = []
    for rank, (start, end) in enumerate(ranges):
        cfg = load_model(model, kv_dtype, page_size, start_layer=start, end_layer=end)
        p = plan_pool(cfg, available_bytes, accounting=accounting, role=role)
        if p.skip_aware_tokens == 0:
            raise click.ClickException(
                f"{available_bytes:,} bytes do not hold one page of stage {rank} (layers {start}-{end - 1}) with the "
                f"{accounting} accounting (one page needs {_one_page_bytes(cfg, accounting, role):,} bytes skip-aware)")
        stages.append({"pp_rank": rank, "start_layer": start, "end_layer": end,
                       "first_layer_skips_topk": cfg.skip_topk_layers[0],
                       "live_indexer_layer_ids": [start + i for i in p.live_indexer_layers], **p.to_dict()})
    bound = min(stages, key=lambda st: st["skip_aware_tokens"])
    naive_bound = min(st["naive_tokens"] for st in stages)
    if as_json:
        click.echo(json.dumps({"model": whole.name, "pp_size": pp_size, "accounting": accounting, "role": role,
                               "available_bytes_per_stage": available_bytes, "stages": stages,
                               "naive_tokens": naive_bound, "skip_aware_tokens": bound["skip_aware_tokens"],
                               "bounding_stage": bound["pp_rank"]}))
        return
    from rich.table import Table

    from kvtier.cli.common import console

    t = Table(title=f"kvtier plan: {whole.name} {kv_dtype}, {pp_size} pipeline stages, {accounting} accounting, "
                    f"{available_bytes:,} bytes a stage")
    for col in ("stage", "layers", "first layer", "indexer layers", "cell naive", "cell skip-aware", "tokens naive",
                "tokens skip-aware", "gain"):
        t.add_column(col, justify="left" if col in ("layers", "first layer") else "right")
    for st in stages:
        t.add_row(str(st["pp_rank"]), f"{st['start_layer']}-{st['end_layer'] - 1}",
                  "skips top-k" if st["first_layer_skips_topk"] else "full",
                  f"{len(st['live_indexer_layer_ids'])} of {st['num_layers']}", f"{st['naive_cell_bytes']:,}",
                  f"{st['skip_aware_cell_bytes']:,}", f"{st['naive_tokens']:,}", f"{st['skip_aware_tokens']:,}",
                  f"{(st['gain_ratio'] - 1) * 100:+.1f}%")
    c = console()
    c.print(t)
    c.print(f"every stage holds the KV of every token for its layers: stage {bound['pp_rank']} bounds the deployment at "
            f"{bound['skip_aware_tokens']:,} tokens skip-aware ({naive_bound:,} naive)")
