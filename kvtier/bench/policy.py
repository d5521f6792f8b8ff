"""Case ``policy``: kvtier's own eviction policy (:data:`CANDIDATE`, ``duel``) against LRU (every
peer's default) and Belady.

Simulated (``kvtier replay --simulate``: the same code a daemon runs, no bytes) on the Mooncake
conversation trace at the replay's default budgets (1,024 device + 5,533 host + 16,362 disk pages;
``--quick``: the first 1,000 requests). Reports the total hit rate, the device tier's hits and the
bytes written to the disk tier of the candidate against ``lru``, and both against Belady's MIN bound
(the share of LRU's distance to Belady it closes). Targets are issue 24's: a quarter
of the distance closed, 1.5x LRU's device hits, half of LRU's disk writes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from kvtier.bench.case import BenchContext, Case, CaseResult, Comparison, Figure
from kvtier.bench.replay import find_trace
from kvtier.server.replay.driver import belady_bound
from kvtier.server.replay.scale import ReplayScale
from kvtier.server.replay.trace import read_trace

#: The policy this case measures against ``lru``.
CANDIDATE = "duel"


class PolicyCase(Case):
    name = "policy"
    title = f"Eviction and admission: {CANDIDATE} vs LRU and Belady (simulated, default budgets)"

    def settings(self, ctx: BenchContext) -> dict[str, Any]:
        return {"requests": 1000 if ctx.quick else None, "policies": ["lru", CANDIDATE]}

    def steps(self, ctx: BenchContext) -> int:
        return 3

    def run(self, ctx: BenchContext) -> CaseResult:
        from kvtier.cli.replay import simulate
        from kvtier.server.tiers.policies import resolve_policy

        s = self.settings(ctx)
        trace = find_trace()
        s["trace"] = str(trace)
        s["default_is"] = resolve_policy("default")
        res = CaseResult(self.name, self.title, s)
        requests = read_trace(trace, s["requests"])
        base = ReplayScale()
        runs = {}
        for p in s["policies"]:
            t0 = time.perf_counter()
            runs[p] = simulate(requests, dataclasses.replace(base, policy=p))
            runs[p].seconds = time.perf_counter() - t0
            ctx.advance(1)
        bound = belady_bound(requests, base) / runs["lru"].tokens
        ctx.advance(1)
        lru, new = runs["lru"], runs[CANDIDATE]
        disk = {p: r.bytes_moved.get("host->disk", 0) for p, r in runs.items()}
        closed = (new.hit_rate - lru.hit_rate) / (bound - lru.hit_rate) if bound > lru.hit_rate else 0.0
        c = res.comparisons
        c.append(Comparison("policy.hit_rate_vs_lru", f"total hit rate: {CANDIDATE} vs LRU (Belady in the note)",
                            "% of blocks", Figure(CANDIDATE, 100 * new.hit_rate), Figure("lru", 100 * lru.hit_rate),
                            note=f"Belady {100 * bound:.2f}%; {CANDIDATE} closes {closed:.0%} of LRU's distance to it "
                                 f"(target 25%: ratio {(lru.hit_rate + 0.25 * (bound - lru.hit_rate)) / lru.hit_rate:.3f})"))
        c.append(Comparison("policy.device_hits_vs_lru", f"device-tier hit rate: {CANDIDATE} vs LRU", "% of blocks",
                            Figure(CANDIDATE, 100 * new.hit_tokens["device"] / new.tokens),
                            Figure("lru", 100 * lru.hit_tokens["device"] / lru.tokens), target=1.5))
        c.append(Comparison("policy.disk_bytes_written_vs_lru", f"bytes written to the disk tier: {CANDIDATE} vs LRU",
                            "GiB", Figure(CANDIDATE, disk[CANDIDATE] / 2**30), Figure("lru", disk["lru"] / 2**30),
                            higher_is_better=False, target=2.0))
        res.figures.update({"belady_hit_rate": bound, "closed_fraction": closed,
                            "runs": {p: r.to_dict() for p, r in runs.items()}})
        res.figures["headline"] = {CANDIDATE: f"{100 * new.hit_rate:.2f}%", "lru": f"{100 * lru.hit_rate:.2f}%",
                                   "Belady": f"{100 * bound:.2f}%", "closed": f"{closed:.0%}"}
        return res
