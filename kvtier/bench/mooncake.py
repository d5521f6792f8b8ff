"""Case ``mooncake``: the Mooncake Store tier against the store's own client, and what sharing one
store buys two daemons.

The measuring is :func:`kvtier.mooncake_bench.run` (what is measured and how: its docstring): put,
get and publish of page records through :class:`~kvtier.server.tiers.mooncake_store.MooncakeStoreTier`
against the same ``MooncakeDistributedStore`` client called directly with the same batch calls on one
registered buffer, to a peer process's segment (TCP over loopback) and to the client's own segment,
interleaved rounds, medians; then the conversation trace replayed by two daemons sharing one store
against two with a private store each (every loaded byte verified). This case turns those figures
into comparisons. ``--quick`` measures put/get/publish with run(quick)'s sizes and leaves the replay
out (its three masters and four daemons take ~30 s to start: the whole --quick run would pass two
minutes). Needs the ``mooncake`` wheel (a real ``mooncake_master`` runs on free ports).
"""

from __future__ import annotations

from typing import Any

from kvtier.bench.case import BenchContext, Case, CaseResult, Comparison, Figure

_OPS = {
    "put": "put (write of fresh records: staging copy + batch_put_from)",
    "get": "get (borrow + each record's checksum, what a prefix load does)",
    "publish": "publish (pages encoded from the pool into lent staging memory + write, what StorePrefix does)",
}


class MooncakeCase(Case):
    name = "mooncake"
    title = "Mooncake Store tier vs the store's own client; two daemons sharing one store vs a private store each"

    def settings(self, ctx: BenchContext) -> dict[str, Any]:
        return {"records": 64 if ctx.quick else 256, "rounds": 3 if ctx.quick else 7,
                "requests": 0 if ctx.quick else 2000, "record_bytes": 194_048, "batch": 32}

    def steps(self, ctx: BenchContext) -> int:
        return 1

    def run(self, ctx: BenchContext) -> CaseResult:
        from kvtier import mooncake_bench

        s = self.settings(ctx)
        res = CaseResult(self.name, self.title, s)
        if ctx.quick:
            figs = {f"put_get_{w}": mooncake_bench.put_get(records=s["records"], rounds=s["rounds"], remote=w == "remote")
                    for w in ("remote", "local")}
            res.left_out["mooncake.shared_vs_private_hit_rate"] = "full runs only (the replay pair takes ~30 s to start)"
        else:
            figs = mooncake_bench.run(quick=False)
        ctx.advance(1)
        for where, key in (("a peer's segment (TCP)", "put_get_remote"), ("the client's own segment", "put_get_local")):
            part = figs[key]
            for op, what in _OPS.items():
                f = part[op]
                res.comparisons.append(Comparison(
                    f"mooncake.{op}_{key.rsplit('_', 1)[1]}_vs_client", f"{what}, objects in {where}, vs the store client directly",
                    "GB/s", Figure.from_samples(f"tier {op}", f["tier_samples"]),
                    Figure.from_samples(f"store client {op}", f["client_samples"])))
        rp = figs.get("replay")
        if rp is not None:
            res.comparisons.append(Comparison(
                "mooncake.shared_vs_private_hit_rate", f"trace hit rate, two daemons sharing one store vs a private store each "
                f"({rp['requests']} requests)", "%", Figure("one shared store", 100 * rp["shared"]["hit_rate"]),
                Figure("a private store each", 100 * rp["private"]["hit_rate"]), paired=False))
        res.figures = figs
        return res
