"""Mooncake Store tier benchmark (figures, not a test): put/get through the tier vs the store's own
client, and the conversation trace replayed by two daemons sharing one store vs a private store each.
What is measured and how: :mod:`kvtier.mooncake_bench`.

Usage: python benchmarks/bench_mooncake_tier.py [--quick] [--records 256] [--rounds 7] [--requests 2000]
       [--skip-replay] [--json FILE]
"""

from __future__ import annotations

import argparse
import json

from kvtier.mooncake_bench import put_get, shared_replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: 64 records, 3 rounds, 200 requests")
    ap.add_argument("--records", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--json", metavar="FILE", help="write every figure and sample as one JSON object")
    a = ap.parse_args()
    records, rounds, requests = (64, 3, 200) if a.quick else (a.records, a.rounds, a.requests)
    out = {}
    for remote in (True, False):
        out["put_get_remote" if remote else "put_get_local"] = pg = put_get(records=records, batch=a.batch, rounds=rounds,
                                                                             remote=remote)
        where = "a peer process's segment (TCP)" if remote else "the client's own segment (memcpy)"
        print(f"{pg['records']} records of {pg['record_bytes']:,} bytes to {where}, batches of {pg['batch']}, "
              f"medians of {pg['rounds']} rounds")
        print(f"{'':6} {'tier GB/s':>10} {'client GB/s':>12} {'ratio':>6}")
        for op in ("put", "get", "publish"):
            f = pg[op]
            print(f"{op:6} {f['tier_gbps']:10.3f} {f['client_gbps']:12.3f} {f['ratio']:6.2f}")
        print()
    if not a.skip_replay:
        out["replay"] = r = shared_replay(requests=requests)
        print(f"\n{r['requests']} trace requests, two daemons taking turns "
              f"({r['device_pages_per_daemon']} device pages, {r['host_bytes_per_daemon'] >> 20} MiB host, "
              f"{r['segment_bytes_per_daemon'] >> 20} MiB store segment each)")
        print(f"{'':22} {'hit rate':>9} {'device':>8} {'host':>8} {'mooncake':>9} {'verify failures':>16} {'seconds':>8}")
        for name in ("shared", "private"):
            x = r[name]
            per = {t: x["hit_tokens"].get(t, 0) / x["tokens"] for t in ("device", "host", "mooncake")}
            label = "one shared store" if name == "shared" else "a private store each"
            print(f"{label:22} {x['hit_rate']:9.2%} {per['device']:8.2%} {per['host']:8.2%} {per['mooncake']:9.2%} "
                  f"{x['verify_failures']:16d} {x['seconds']:8.1f}")
        for name in ("shared", "private"):
            x = r["simulated_exact_lru"][name]
            label = "simulated: " + ("shared" if name == "shared" else "private")
            per = {t: x["hit_tokens"].get(t, 0) / x["tokens"] for t in ("device", "host", "mooncake")}
            print(f"{label:22} {x['hit_rate']:9.2%} {per['device']:8.2%} {per['host']:8.2%} {per['mooncake']:9.2%}")
        print(f"hit rate gained by sharing: {r['hit_rate_gain']:+.2%} (simulated with an exact-LRU store: "
              f"{r['simulated_gain']:+.2%})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
