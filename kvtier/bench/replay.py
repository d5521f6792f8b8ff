"""Case ``replay``: the Mooncake conversation trace through an embedded daemon (every loaded byte
verified) against ``--simulate`` (the same policy on size-only tiers) and Belady's MIN bound.

The replay attaches its pool (``kvtier replay``'s local mode: misses written and loaded pages
verified in the pool's memory, no KV over gRPC). Budgets are small enough that every tier serves
hits within a few hundred requests (device 256 pages, host 3,000 page records, disk 64 MiB); the
page geometry is the replay's default (GLM-5.2 layers 0-3, 64-token pages, 194,048-byte page
records). Reports requests/s, the hit rate of each
tier against the simulation's (they must be equal), the total against Belady's bound, and the
daemon's peak RSS.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvtier.bench.case import BenchContext, Case, CaseResult, Comparison, Figure
from kvtier.server.replay.driver import TIERS, belady_bound, replay as run_replay
from kvtier.server.replay.scale import ReplayScale
from kvtier.server.replay.trace import read_trace

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "conversation_trace.jsonl"
PAGE_RECORD = 194_048


def find_trace() -> Path:
    """The trace beside the checkout (``../shared/data``), else relative to the current directory."""
    for p in (TRACE, Path("../shared/data/conversation_trace.jsonl")):
        if p.is_file():
            return p
    raise FileNotFoundError(f"the Mooncake trace is not at {TRACE} nor ../shared/data/conversation_trace.jsonl")


def peak_rss_bytes(pid: int) -> int:
    """``VmHWM`` of a live process (its peak resident set), 0 if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class ReplayCase(Case):
    name = "replay"
    title = "Replay of the Mooncake trace: hit rates vs --simulate and Belady, requests/s, peak RSS"

    def settings(self, ctx: BenchContext) -> dict[str, Any]:
        return {"requests": 300 if ctx.quick else 2000, "device_tokens": 256 * 64, "host_bytes": 3000 * PAGE_RECORD,
                "disk_bytes": 64 << 20, "write_back": True}

    def steps(self, ctx: BenchContext) -> int:
        return self.settings(ctx)["requests"] + 2

    def run(self, ctx: BenchContext) -> CaseResult:
        from kvtier.cli.replay import daemon_args, simulate
        from kvtier.cli.replay_backend import AttachedBackend
        from kvtier.client import KVTierClient
        from kvtier.client.spawn import DaemonProcess

        s = self.settings(ctx)
        trace = find_trace()
        s["trace"] = str(trace)
        res = CaseResult(self.name, self.title, s)
        scale = ReplayScale(device_tokens=s["device_tokens"], host_bytes=s["host_bytes"], disk_bytes=s["disk_bytes"],
                            write_back=s["write_back"])
        requests = read_trace(trace, s["requests"])
        t0 = time.perf_counter()
        sim = simulate(requests, scale)
        sim_s = time.perf_counter() - t0
        bound = belady_bound(requests, scale)
        ctx.advance(1)
        disk = ctx.workdir / "replay-disk"
        with DaemonProcess(extra_args=daemon_args(scale, str(disk))) as d, KVTierClient(d.address, timeout=120.0) as c:
            backend = AttachedBackend(c, scale.model, scale.num_layers, scale.device_tokens)  # as kvtier replay does locally
            try:
                real = run_replay(requests, backend, scale, on_request=lambda i, _r: ctx.advance(1))
                real.transport = "attach"
            finally:
                backend.close()
            rss = peak_rss_bytes(d.process.pid)
        if real.verify_failures:
            raise RuntimeError(f"replay: {real.verify_failures} loaded pages differ from what was written")
        ctx.advance(1)
        tok = real.tokens
        c = res.comparisons
        for tier in TIERS:
            c.append(Comparison(f"replay.hit_rate_{tier}_vs_simulate", f"{tier} tier hit rate: through the daemon vs --simulate (equal)",
                                "% of tokens", Figure(f"daemon replay, {tier}", 100 * real.hit_tokens.get(tier, 0) / tok),
                                Figure(f"--simulate, {tier}", 100 * sim.hit_tokens.get(tier, 0) / sim.tokens), target=1.0))
        c.append(Comparison("replay.hit_rate_vs_belady", "total hit rate vs Belady's MIN over the tiers' combined capacity",
                            "% of tokens", Figure("daemon replay, all tiers", 100 * real.hit_rate), Figure("Belady's bound", 100 * bound / tok)))
        c.append(Comparison("replay.requests_per_s_vs_simulate", "requests/s: daemon replay (bytes moved and verified) vs --simulate (sizes only)",
                            "requests/s", Figure("daemon replay", real.requests / real.seconds),
                            Figure("--simulate", len(requests) / sim_s)))
        res.figures.update({"requests_per_s": real.requests / real.seconds, "tokens_per_s": real.tokens / real.seconds,
                            "daemon_peak_rss_bytes": rss, "simulate_seconds": sim_s, "belady_hit_tokens": bound,
                            "daemon": real.to_dict(), "simulate": sim.to_dict(),
                            "equal_to_simulate": real.hit_tokens == sim.hit_tokens})
        res.figures["headline"] = {"requests/s": f"{real.requests / real.seconds:.1f}", "daemon peak RSS": f"{rss / 2**20:.0f} MiB",
                                   "hits equal --simulate": str(real.hit_tokens == sim.hit_tokens)}
        return res
