"""The policy lab: every policy at every total capacity, simulated, beside Belady's bound.

``kvtier replay --simulate --policy lru,s3fifo,default --sweep 1e6,1e7`` calls :func:`run_sweep`.
A capacity is counted in the *trace's* tokens (a 512-token block counts 512, as in the Mooncake
FAST'25 paper's Figure 9), whatever tokens a block stands for in the replay's scale. The device tier
keeps its size (a request must fit on it); the rest is split between host and disk in the default
budgets' page proportions (5,533 : 16,362). A capacity below the device's own shrinks the device
(never under :data:`MIN_DEVICE_PAGES`), and the row reports the capacity actually simulated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.private_writes import save_private_figure
from kvtier.server.replay.belady import belady_hits
from kvtier.server.replay.driver import InProcessBackend, ReplayResult, replay
from kvtier.server.replay.scale import ReplayScale
from kvtier.server.replay.trace import RequestKeys, TraceRequest
from kvtier.server.tiers.disk import DiskTierConfig, disk_charge

#: Tokens of one trace block (the Mooncake trace's hash ids each stand for 512 tokens).
TRACE_BLOCK_TOKENS = 512
#: Smallest device pool a sweep uses, in pages (the trace's longest request is 247 blocks).
MIN_DEVICE_PAGES = 256


@dataclass
class SweepRow:
    """One policy at one capacity (the JSON object of ``--json``'s ``sweep`` list).

    Attributes:
        capacity_tokens: total capacity simulated, in trace tokens.
        policy: the policy name as asked (``default`` stays ``default``).
        hit_rate: hit pages over pages (the fraction of trace blocks hit).
        belady_hit_rate: Belady's MIN bound at the same total capacity, same measure.
        input_token_hit_rate: hit tokens over the trace's real input tokens (a request's hit is at most
            its ``input_length``).
        tier_hit_rate: per tier, hit pages over pages.
        bytes_written: record bytes moved into each tier (``bytes_moved`` of moves ending there).
        capacity_pages: pages per tier simulated.
        not_admitted: pages the disk tier's admission rule turned away.
    """

    capacity_tokens: int
    policy: str
    hit_rate: float
    belady_hit_rate: float
    input_token_hit_rate: float
    tier_hit_rate: dict[str, float]
    bytes_written: dict[str, int]
    capacity_pages: dict[str, int]
    not_admitted: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return dataclasses.asdict(self)


def scale_for(base: ReplayScale, capacity_tokens: float, policy: str) -> ReplayScale:
    """``base`` with budgets for ``capacity_tokens`` trace tokens in all and ``policy``.

    Raises:
        ValueError: a capacity that is not a positive number.
    """
    if not capacity_tokens > 0 or math.isinf(capacity_tokens):
        raise ValueError(f"a sweep capacity must be a positive number of tokens, got {capacity_tokens!r}")
    ps = base.model_config().page_size
    pages_per_block = base.tokens_per_block // ps
    default = ReplayScale()
    split = default.capacity_pages()
    pages = int(capacity_tokens // TRACE_BLOCK_TOKENS) * pages_per_block
    device = min(base.device_tokens // ps, max(MIN_DEVICE_PAGES * pages_per_block, pages))
    rest = max(0, pages - device)
    host = rest * split["host"] // (split["host"] + split["disk"])
    disk = rest - host
    rec = base.codec().page_nbytes()
    reserve = DiskTierConfig(path="-").reserve_fraction
    disk_bytes = 0
    if disk:  # the smallest map whose record budget holds ``disk`` charged pages
        disk_bytes = math.ceil(disk * disk_charge(rec) / (1.0 - reserve)) + 4096
        disk_bytes = max(disk_bytes, 64 * 4096)
    return dataclasses.replace(base, device_tokens=device * ps, host_bytes=host * rec, disk_bytes=disk_bytes,
                               policy=policy)


def input_token_hits(requests: Sequence[TraceRequest], hit_pages: Sequence[int], pages_per_block: int) -> int:
    """Real input tokens hit: per request ``min(hit blocks * 512, input_length)``."""
    return sum(min(n // pages_per_block * TRACE_BLOCK_TOKENS, r.input_length) for r, n in zip(requests, hit_pages))


def simulate_policy(requests: Sequence[TraceRequest], scale: ReplayScale,
                    on_request: Callable[[int, ReplayResult], None] | None = None) -> tuple[ReplayResult, list[int]]:
    """One simulated replay; also each request's hit pages."""
    per: list[int] = []
    seen = [0]
    ps = scale.model_config().page_size

    def tick(i: int, partial: ReplayResult) -> None:
        total = sum(partial.hit_tokens.values()) // ps
        per.append(total - seen[0])
        seen[0] = total
        if on_request is not None:
            on_request(i, partial)

    backend = InProcessBackend(scale, "-", simulate=True)
    try:
        return replay(requests, backend, scale, on_request=tick), per
    finally:
        backend.close()


def run_sweep(requests: Sequence[TraceRequest], base: ReplayScale, policies: Sequence[str],
              capacities: Sequence[float], *,
              on_step: Callable[[str, int, int], None] | None = None) -> list[SweepRow]:
    """Simulate every policy at every capacity; Belady once per capacity.

    Args:
        on_step: ``(label, request index, requests)`` after each simulated request (progress bars).
    """
    keys = RequestKeys(base.tokens_per_block, base.model_config().page_size)
    accesses = [p.key for r in requests for p in keys.pages(r.hash_ids)]
    ppb = base.tokens_per_block // base.model_config().page_size
    total_input = sum(r.input_length for r in requests) or 1
    rows: list[SweepRow] = []
    for cap in capacities:
        for policy in policies:
            scale = scale_for(base, cap, policy)
            pages = scale.capacity_pages()
            label = f"{policy} @ {cap:.3g}"
            res, per = simulate_policy(requests, scale, None if on_step is None else
                                       (lambda i, _r, label=label: on_step(label, i, len(requests))))
            if not rows or rows[-1].capacity_pages != pages:
                bound = belady_hits(accesses, sum(pages.values())) / len(accesses) if accesses else 0.0
            moves = res.moves
            written: dict[str, int] = {}
            for move, m in moves.items():
                dst = move.split("->", 1)[1]
                if "(" not in dst:
                    written[dst] = written.get(dst, 0) + m["bytes"]
            rows.append(SweepRow(
                capacity_tokens=sum(pages.values()) // ppb * TRACE_BLOCK_TOKENS, policy=policy,
                hit_rate=res.hit_rate, belady_hit_rate=bound,
                input_token_hit_rate=input_token_hits(requests, per, ppb) / total_input,
                tier_hit_rate={t: v / res.tokens if res.tokens else 0.0 for t, v in res.hit_tokens.items()},
                bytes_written=written, capacity_pages=pages,
                not_admitted=sum(m["count"] for k, m in moves.items() if "not admitted" in k)))
    return rows


def plot_sweep(rows: Sequence[SweepRow], path: str) -> None:
    """Hit rate vs capacity (log x) to a PNG at ``path`` (mode 0600): one line per policy, plus Belady."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r.policy for r in rows):
        pts = sorted((r.capacity_tokens, r.hit_rate) for r in rows if r.policy == policy)
        ax.plot([x for x, _ in pts], [100 * y for _, y in pts], marker="o", label=policy)
    bel = sorted({(r.capacity_tokens, r.belady_hit_rate) for r in rows})
    ax.plot([x for x, _ in bel], [100 * y for _, y in bel], "k--", marker="x", label="Belady (MIN)")
    ax.set_xscale("log")
    ax.set_xlabel("total capacity (trace tokens)")
    ax.set_ylabel("hit rate (% of trace blocks)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_private_figure(fig, path, dpi=120)  # 0600, like every file kvtier writes
    plt.close(fig)
