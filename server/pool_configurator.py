"""Pool capacity planning: how many tokens fit in a byte budget, naive vs skip-aware.

Two accountings (DESIGN.md "Capacity"):

* ``sglang``: SGLang's estimate. Cell size (bytes per token over all layers) counts the latent row
  as ``(kv_lora_rank + qk_rope_head_dim) * dtype bytes`` (576 for fp8 even though the DSA fp8 row is
  656 bytes) plus 132 indexer bytes per layer. Naive: ``L * (latent + 132)``; skip-aware:
  ``L * latent + live * 132``; ``tokens = available // cell // page_size * page_size``.
* ``exact``: the bytes :class:`~kvtier.server.pool.DSATokenToKVPool` really allocates, padding page
  and indexer page rounding included; the planned pool's ``get_kv_size_bytes()`` equals the plan.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool.factory import skip_mask_for_role

ACCOUNTINGS: tuple[str, ...] = ("exact", "sglang")


def sglang_latent_row_bytes(model: DSAModelConfig) -> int:
    """SGLang's latent row estimate: ``kv_lora_rank + qk_rope_head_dim`` elements of 1 (fp8) or 2 (bf16) bytes."""
    elem = 1 if model.kv_cache_dtype == "fp8" else 2
    return (model.kv_lora_rank + model.qk_rope_head_dim) * elem


def cell_size_bytes(model: DSAModelConfig, *, skip_aware: bool, accounting: str = "exact", role: str = "target") -> int:
    """Bytes per token over all layers (latent rows plus indexer bytes of the layers that have them)."""
    _check_accounting(accounting)
    latent = model.latent_row_bytes if accounting == "exact" else sglang_latent_row_bytes(model)
    mask = skip_mask_for_role(model, role)
    live = sum(1 for s in mask if not s) if skip_aware else model.num_layers
    return model.num_layers * latent + live * model.index_token_bytes


def exact_pool_bytes(model: DSAModelConfig, size: int, *, skip_aware: bool = True, role: str = "target",
                     index_buf_size: int | None = None) -> int:
    """Bytes a pool of ``size`` tokens allocates: ``L * (size + page_size) * row_bytes`` latent plus
    ``live * num_pages * page_bytes`` indexer, ``num_pages = (index_buf_size + page_size + 1) // page_size``."""
    ps = model.page_size
    mask = skip_mask_for_role(model, role)
    live = sum(1 for s in mask if not s) if skip_aware else model.num_layers
    ibs = size if index_buf_size is None else index_buf_size
    num_pages = (ibs + ps + 1) // ps
    return model.num_layers * (size + ps) * model.latent_row_bytes + live * num_pages * model.index_page_bytes


def max_total_num_tokens(model: DSAModelConfig, available_bytes: int, *, skip_aware: bool,
                         accounting: str = "exact", role: str = "target") -> int:
    """Largest page-multiple token count whose pool fits in ``available_bytes``.

    Raises:
        ValueError: negative budget or unknown accounting.
    """
    _check_accounting(accounting)
    if isinstance(available_bytes, bool) or not isinstance(available_bytes, int) or available_bytes < 0:
        raise ValueError(f"available_bytes must be a non-negative integer, got {available_bytes!r}")
    ps = model.page_size
    if accounting == "sglang":
        return available_bytes // cell_size_bytes(model, skip_aware=skip_aware, accounting=accounting, role=role) // ps * ps
    # exact: bytes grow by at most one page's worth per page of tokens; start from the estimate and walk down.
    per_page = exact_pool_bytes(model, 2 * ps, skip_aware=skip_aware, role=role) - exact_pool_bytes(model, ps, skip_aware=skip_aware, role=role)
    size = max(available_bytes // per_page * ps, 0)
    while size > 0 and exact_pool_bytes(model, size, skip_aware=skip_aware, role=role) > available_bytes:
        size -= ps
    return size


def _check_accounting(accounting: str) -> None:
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"accounting must be one of {ACCOUNTINGS}, got {accounting!r}")


@dataclass(frozen=True)
class PoolPlan:
    """A capacity plan (all sizes in bytes or tokens).

    ``saved_bytes`` is what skip-awareness saves at the naive token count
    (``naive_tokens * saved_bytes_per_token``); ``gain_ratio = skip_aware_tokens / naive_tokens``.
    ``*_pool_bytes`` are the planned pools' sizes under the chosen accounting.
    """

    model: str
    kv_cache_dtype: str
    accounting: str
    role: str
    available_bytes: int
    page_size: int
    num_layers: int
    live_indexer_layers: list[int]
    latent_row_bytes: int
    index_token_bytes: int
    naive_cell_bytes: int
    skip_aware_cell_bytes: int
    naive_tokens: int
    skip_aware_tokens: int
    gain_ratio: float
    saved_bytes_per_token: int
    saved_bytes: int
    naive_pool_bytes: int
    skip_aware_pool_bytes: int

    def to_dict(self) -> dict:
        """JSON-ready dict of every field."""
        return asdict(self)


def plan_pool(model: DSAModelConfig, available_bytes: int, *, accounting: str = "exact", role: str = "target") -> PoolPlan:
    """Plan naive and skip-aware pools of ``model`` in ``available_bytes``.

    Raises:
        ValueError: bad budget, accounting or role.
    """
    naive_cell = cell_size_bytes(model, skip_aware=False, accounting=accounting, role=role)
    skip_cell = cell_size_bytes(model, skip_aware=True, accounting=accounting, role=role)
    naive = max_total_num_tokens(model, available_bytes, skip_aware=False, accounting=accounting, role=role)
    skip = max_total_num_tokens(model, available_bytes, skip_aware=True, accounting=accounting, role=role)
    mask = skip_mask_for_role(model, role)
    live = [i for i, s in enumerate(mask) if not s]
    saved_per_token = naive_cell - skip_cell
    if accounting == "exact":
        naive_bytes = exact_pool_bytes(model, naive, skip_aware=False, role=role)
        skip_bytes = exact_pool_bytes(model, skip, skip_aware=True, role=role)
    else:
        naive_bytes, skip_bytes = naive * naive_cell, skip * skip_cell
    return PoolPlan(
        model=model.name,
        kv_cache_dtype=model.kv_cache_dtype,
        accounting=accounting,
        role=role,
        available_bytes=available_bytes,
        page_size=model.page_size,
        num_layers=model.num_layers,
        live_indexer_layers=live,
        latent_row_bytes=model.latent_row_bytes if accounting == "exact" else sglang_latent_row_bytes(model),
        index_token_bytes=model.index_token_bytes,
        naive_cell_bytes=naive_cell,
        skip_aware_cell_bytes=skip_cell,
        naive_tokens=naive,
        skip_aware_tokens=skip,
        gain_ratio=(skip / naive) if naive else 0.0,
        saved_bytes_per_token=saved_per_token,
        saved_bytes=naive * saved_per_token,
        naive_pool_bytes=naive_bytes,
        skip_aware_pool_bytes=skip_bytes,
    )
