"""Case ``capacity``: tokens a pool of each shipped model holds, skip-aware vs naive (an indexer buffer
on every layer), under SGLang's accounting (a 656-byte fp8 latent row counted as 576 bytes) and the
exact one. Computed, not timed; the exact plan is also checked against a pool really allocated."""

from __future__ import annotations

from typing import Any

from kvtier.bench.case import BenchContext, Case, CaseResult, Comparison, Figure
from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import create_pool
from kvtier.server.pool_configurator import plan_pool
from kvtier.server.presets import preset_names

AVAILABLE_BYTES = 134_227_000_000  # DESIGN.md "Capacity": GLM-5.2 on one rank
CHECK_BYTES = 96 << 20  # a real pool of this budget must be exactly the exact plan's bytes


class CapacityCase(Case):
    name = "capacity"
    title = "Pool capacity: skip-aware vs naive, SGLang's and exact accounting"

    def steps(self, ctx: BenchContext) -> int:
        return len(preset_names())

    def run(self, ctx: BenchContext) -> CaseResult:
        res = CaseResult(self.name, self.title, {"available_bytes": AVAILABLE_BYTES, "kv_cache_dtype": "fp8",
                                                 "check_bytes": CHECK_BYTES})
        plans: dict[str, Any] = {}
        for name in preset_names():
            model = DSAModelConfig.from_preset(name)
            for accounting in ("sglang", "exact"):
                p = plan_pool(model, AVAILABLE_BYTES, accounting=accounting)
                plans[f"{name}/{accounting}"] = p.to_dict()
                res.comparisons.append(Comparison(
                    f"capacity.{name}.{accounting}", f"{name}: max tokens, skip-aware vs naive ({accounting} accounting)",
                    "tokens", Figure(f"skip-aware ({len(p.live_indexer_layers)} of {p.num_layers} layers own an indexer)",
                                     float(p.skip_aware_tokens)),
                    Figure("naive (indexer on every layer)", float(p.naive_tokens)),
                    note=f"{p.saved_bytes_per_token:,} bytes a token saved"))
            small = plan_pool(model, CHECK_BYTES, accounting="exact")
            pool = create_pool(model, small.skip_aware_tokens, device="cpu")
            if pool.get_kv_size_bytes() != small.skip_aware_pool_bytes:
                raise RuntimeError(f"{name}: the exact plan predicts {small.skip_aware_pool_bytes} bytes, the pool "
                                   f"allocated {pool.get_kv_size_bytes()}")
            plans[f"{name}/exact-check"] = {"tokens": small.skip_aware_tokens, "bytes": pool.get_kv_size_bytes()}
            del pool
            ctx.advance(1)
        res.figures["plans"] = plans
        return res
