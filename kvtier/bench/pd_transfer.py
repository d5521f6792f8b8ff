"""Case ``pd``: PullKV between two daemons (``--transfer-engine mooncake`` on 127.0.0.1) against raw
Mooncake Transfer Engine reads of the same bytes, and against PullKV's gRPC fallback.

A GLM-5.2 request of ``pages`` pages (4,096 tokens, 221 MB: the request issue 11 measures) is
written on the prefill daemon and pulled onto other pages of the decode daemon. Two engines in this
process with the same number of bytes registered do one ``transfer_sync_read`` of all of them (the
ceiling), and one ``batch_transfer_sync_read`` of the same bytes in the pieces a pool holds them in
(one range a layer's latent rows, one a live layer's indexer pages: what PullKV's plan reads),
interleaved with PullKV alone, each going first in every other round (after a heavy call, the next
is slower whichever it is); then, interleaved
with each other, PullKV's gRPC fallback, the draft pool's pull and one raw read per page and
component (what an uncoalesced transfer list costs). Full runs add a draft pool (an indexer on all 78 layers)
for the bytes skip-awareness saves.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from kvtier.bench.case import BenchContext, Case, CaseResult, Comparison, Figure, interleaved, throughput
from kvtier.client import DaemonProcess, KVTierClient
from kvtier.server.model_config import DSAModelConfig
from kvtier.server.transfer import MooncakeTransferEngine

PS = 64


class RawReads:
    """Two engines in this process with ``total_bytes`` registered each: the raw baseline."""

    def __init__(self, total_bytes: int, items: list[int], ranges: list[int] | None = None) -> None:
        self.a, self.b = MooncakeTransferEngine(), MooncakeTransferEngine()
        self.src = torch.randint(0, 256, (total_bytes,), dtype=torch.uint8)
        self.dst = torch.zeros(total_bytes, dtype=torch.uint8)
        self.a.register([(self.src.data_ptr(), total_bytes)])
        self.b.register([(self.dst.data_ptr(), total_bytes)])
        self.total, self.items, self.ranges = total_bytes, items, ranges or [total_bytes]

    def one(self) -> None:
        """One ``transfer_sync_read`` of all the bytes."""
        self.b.read_raw(self.a.endpoint, self.dst.data_ptr(), self.src.data_ptr(), self.total)

    def in_ranges(self) -> None:
        """One ``batch_transfer_sync_read`` of the bytes in :attr:`ranges` (back to back, the pool's pieces)."""
        offs, sp, dp = [0], self.src.data_ptr(), self.dst.data_ptr()
        for n in self.ranges[:-1]:
            offs.append(offs[-1] + n)
        self.b.read_ranges(self.a.endpoint, [dp + o for o in offs], [sp + o for o in offs], self.ranges)

    def per_item(self) -> None:
        """One ``transfer_sync_read`` per page and component (no coalescing)."""
        off, sp, dp = 0, self.src.data_ptr(), self.dst.data_ptr()
        for n in self.items:
            self.b.read_raw(self.a.endpoint, dp + off, sp + off, n)
            off += n

    def verify(self) -> None:
        if not torch.equal(self.src, self.dst):
            raise RuntimeError("raw Mooncake reads returned other bytes")
        self.dst.zero_()


class PDTransferCase(Case):
    name = "pd"
    title = "PullKV over the Mooncake Transfer Engine vs raw engine reads of the same bytes"
    setup_steps = 2

    def steps(self, ctx: BenchContext) -> int:
        s = self.settings(ctx)
        return self.setup_steps + 2 * (s["reps"] + s["warmup"])  # two interleaved groups

    def settings(self, ctx: BenchContext) -> dict[str, Any]:
        return {"model": "glm-5.2", "pages": 64, "pool_tokens": 8192, "reps": 3 if ctx.quick else 9,
                "warmup": 1, "draft_pool": not ctx.quick, "protocol": "tcp", "host": "127.0.0.1"}


    def run(self, ctx: BenchContext) -> CaseResult:
        s = self.settings(ctx)
        res = CaseResult(self.name, self.title, s)
        os.environ.setdefault("GLOG_minloglevel", "2")  # this process's engines: no per-segment INFO lines
        model = DSAModelConfig.from_preset("glm-5.2")
        n_live, n_layers = len(model.live_indexer_layers), model.num_layers
        lat_page, idx_page, pages = model.latent_row_bytes * PS, model.index_page_bytes, s["pages"]
        total = n_layers * pages * lat_page + n_live * pages * idx_page
        raw = RawReads(total, [lat_page] * (n_layers * pages) + [idx_page] * (n_live * pages),
                       [lat_page * pages] * n_layers + [idx_page * pages] * n_live)
        flags = ["--pool", f"glm-5.2:{s['pool_tokens']}", "--device", "cpu", "--transfer-engine", "mooncake",
                 "--host-memory", "64MiB", "--log-level", "WARNING"]
        roles = ("target", "draft") if s["draft_pool"] else ("target",)
        # two throwaway daemons of this user on loopback: no tokens, said explicitly
        with DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=flags) as pre_d, \
                DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=flags) as dec_d, \
                KVTierClient(pre_d.address, timeout=600) as pre, KVTierClient(dec_d.address, timeout=600) as dec:
            fns: dict[str, Any] = {}
            results: dict[str, Any] = {}
            expect: dict[str, tuple[str, Any, Any]] = {}
            for role in roles:
                pool = "default" if role == "target" else "draft"
                if role == "draft":
                    for c in (pre, dec):
                        c.create_pool("glm-5.2", size_tokens=s["pool_tokens"], pool_id="draft", role="draft", device="cpu")
                src = pre.allocate_slots(pool, pages * PS)
                g = torch.Generator().manual_seed(1)
                latent = {x: torch.randint(0, 256, (src.numel(), 656), dtype=torch.uint8, generator=g) for x in range(n_layers)}
                pre.write_kv(pool, src, latent=latent)
                dec.allocate_slots(pool, PS)  # destination pages differ from the source's
                dst = dec.allocate_slots(pool, pages * PS)
                sp, dp = (src[::PS] // PS).tolist(), (dst[::PS] // PS).tolist()
                expect[role] = (pool, dst, latent)
                for transport in ("mooncake", "grpc"):
                    call = functools.partial(dec.pull_kv, pool, pre_d.address, pool, src_pages=sp, dst_pages=dp, transport=transport)
                    fns[f"{role}/{transport}"] = lambda call=call, key=f"{role}/{transport}": results.__setitem__(key, call())
            fns["raw/per_item"] = raw.per_item
            ctx.advance(1)
            # the headline pair alone, each first in every other round: a heavy call just before
            # (the gRPC fallback's 110 MB stream, 3,168 small raw reads) slows whichever call follows it
            pair = {"target/mooncake": fns.pop("target/mooncake"), "raw/one": raw.one, "raw/ranges": raw.in_ranges}
            t = interleaved(pair, s["reps"], warmup=s["warmup"], rotate=True, tick=lambda: ctx.advance(1))
            t.update(interleaved(fns, s["reps"], warmup=s["warmup"], tick=lambda: ctx.advance(1)))
            fns.update(pair)
            raw.verify()
            for role, (pool, dst, latent) in expect.items():
                kv = dec.read_kv(pool, dst, latent_layers=[0, n_layers - 1], index_layers=[])
                if not all(torch.equal(kv.latent[x], latent[x]) for x in (0, n_layers - 1)):
                    raise RuntimeError(f"PullKV ({role}) left other bytes on the decode side")
        ctx.advance(1)
        tgt = results["target/mooncake"]
        if tgt.total_bytes != total:
            raise RuntimeError(f"PullKV moved {tgt.total_bytes} bytes, the request holds {total}")
        c = res.comparisons
        c.append(Comparison("pd.pullkv_vs_raw_read", "PullKV over Mooncake (layout fetch, checks, gRPC call included) vs one raw transfer_sync_read",
                            "GB/s", throughput("kvtier PullKV, Mooncake TE", total, t["target/mooncake"]),
                            throughput("one raw transfer_sync_read", total, t["raw/one"]), target=0.9))
        c.append(Comparison("pd.pullkv_vs_raw_ranges", f"PullKV over Mooncake vs one raw batch_transfer_sync_read of the same bytes in the pool's "
                            f"{len(raw.ranges)} pieces (a range per layer: where the pool holds them)",
                            "GB/s", throughput("kvtier PullKV, Mooncake TE", total, t["target/mooncake"]),
                            throughput(f"raw batch read, {len(raw.ranges)} ranges", total, t["raw/ranges"]), target=0.9))
        c.append(Comparison("pd.raw_ranges_vs_raw_read", f"the engine alone: one raw batch read of the {len(raw.ranges)} ranges vs one "
                            f"contiguous raw read of the same bytes (what a layer-major layout costs the engine)",
                            "GB/s", throughput(f"raw batch read, {len(raw.ranges)} ranges", total, t["raw/ranges"]),
                            throughput("one raw transfer_sync_read", total, t["raw/one"])))
        c.append(Comparison("pd.pullkv_vs_per_page_reads", "PullKV over Mooncake vs raw reads page by page (uncoalesced)",
                            "GB/s", throughput("kvtier PullKV, Mooncake TE", total, t["target/mooncake"]),
                            throughput("transfer_sync_read per page and component", total, t["raw/per_item"])))
        c.append(Comparison("pd.mooncake_vs_grpc_fallback", "PullKV over Mooncake vs PullKV's gRPC fallback (ReadPages streams)",
                            "GB/s", throughput("PullKV, Mooncake TE", total, t["target/mooncake"]),
                            throughput("PullKV, gRPC fallback", total, t["target/grpc"])))
        if "draft" in expect:
            d = results["draft/mooncake"]
            c.append(Comparison("pd.bytes_skip_aware_vs_draft", "bytes a request's transfer moves: skip-aware vs indexer on all layers",
                                "bytes", Figure("skip-aware target pool", float(tgt.total_bytes)),
                                Figure("draft pool (indexer on all 78 layers)", float(d.total_bytes)), higher_is_better=False))
        res.figures["bytes"] = {"total": total, "index": tgt.index_bytes, "ranges": tgt.latent_requests + tgt.index_requests}
        res.figures["seconds"] = t
        return res
