"""Figures for the Mooncake Store tier (not timed tests): ``run(quick) -> dict``.

Two parts, each against its plain limit in the same run:

* **put/get bytes/s**: page records of the replay's default scale (GLM-5.2 layers 0-3: 194,048 bytes)
  in batches of ``batch`` keys, through :class:`MooncakeStoreTier` (``write``: staging copy + one
  ``batch_put_from``; ``borrow``: one ``batch_get_into``, views lent, then each record's checksum
  checked, what the prefix cache's load does before it copies a page into the pool) against the same ``MooncakeDistributedStore`` client called directly with
  the same batch calls, straight from and into one registered buffer holding the records back to back
  (no staging copy, no checks). By default the bytes go to a segment another process lends (TCP over
  loopback, as to other daemons' segments); ``remote=False`` keeps them in the client's own segment.
  A third pair measures the publish path of StorePrefix: pages encoded from the pool into memory the
  tier lends (``staged``) and written, vs the same pages encoded into the registered buffer and put
  by the client directly. Rounds interleave the six operations (baseline first every other round),
  figures are medians, ratios are medians of per-round ratios. Every object is removed (forced) between rounds, outside the timing.
* **shared prefixes**: the first ``requests`` of ``../shared/data/conversation_trace.jsonl`` replayed
  in arrival order by two daemons taking requests alternately (a load balancer without prefix
  affinity), once sharing one store (one master; each daemon lends ``segment`` bytes) and once with a
  private store each (two masters, the same segment each: the same memory in all). Every loaded byte
  is verified (``kvtier replay``'s driver). The hit rate gained is what sharing buys.

Needs the ``mooncake`` wheel (its ``mooncake_master`` runs on free 127.0.0.1 ports).
"""

from __future__ import annotations

import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from kvtier.mooncake_master import MooncakeMaster

MiB = 1 << 20
TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "conversation_trace.jsonl"


def _records(n: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` sealed one-page records of the replay's default scale (random KV)."""
    pool, codec = _pool(seed)
    return [codec.encode_page(pool, 1 + i % 64) for i in range(n)]


def _pool(seed: int = 0) -> tuple[Any, Any]:
    """A pool of the replay's default scale with 64 pages of random KV (pages 1..64), and its codec."""
    from kvtier.server.pool import create_pool
    from kvtier.server.replay.scale import ReplayScale

    model = ReplayScale().model_config()
    pool = create_pool(model, 65 * 64, device="cpu")
    codec = ReplayScale().codec()
    g = torch.Generator().manual_seed(seed)
    for buf in pool.kv_buffer:
        buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    for layer in model.live_indexer_layers:
        b = pool.index_k_with_scale_buffer[layer]
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    return pool, codec


_PEER = """
import sys
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", sys.argv[1], int(sys.argv[3]), 16 << 20, "tcp", "", sys.argv[2])
print(rc, flush=True)
sys.stdin.read()
s.close()
"""


class _SegmentPeer:
    """Another process whose store client lends ``segment`` bytes (a peer daemon's segment)."""

    def __init__(self, m: MooncakeMaster, segment: int) -> None:
        import subprocess
        import sys

        self.p = subprocess.Popen([sys.executable, "-c", _PEER, m.metadata, m.master, str(segment)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        line = self.p.stdout.readline().decode().strip() if self.p.stdout else ""
        if line != "0":
            self.close()
            raise RuntimeError(f"the segment peer did not set up ({line or 'no answer'})")

    def close(self) -> None:
        if self.p.stdin:
            self.p.stdin.close()
        try:
            self.p.wait(30)
        except Exception:  # noqa: BLE001 - a stuck peer is killed
            self.p.kill()
            self.p.wait()


def put_get(*, records: int = 256, batch: int = 32, rounds: int = 7, segment: int = 512 * MiB,
            remote: bool = True) -> dict[str, Any]:
    """Put/get bytes/s through the tier vs the same store client called directly (module docstring).

    ``remote``: the tier's client lends no memory and a peer process lends ``segment``, so every byte
    crosses the transfer engine (TCP over loopback), as objects in other daemons' segments do; else
    the tier's client lends the only segment (the store copies with memcpy).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the daemon runs (--torch-threads 1): two OpenMP threads on a busy
    try:                      # 2-core machine made the staging copies ~10x slower
        return _put_get(records, batch, rounds, segment, remote)
    finally:
        torch.set_num_threads(threads)


def _put_get(records: int, batch: int, rounds: int, segment: int, remote: bool) -> dict[str, Any]:
    from kvtier.server.tiers.mooncake_store import MooncakeStoreTier, MooncakeStoreTierConfig

    pool, codec = _pool()
    recs = [codec.encode_page(pool, 1 + i % 64) for i in range(records)]
    nbytes = sum(int(r.numel()) for r in recs)
    size = int(recs[0].numel())
    with MooncakeMaster() as m:
        peer = _SegmentPeer(m, segment) if remote else None
        tier = MooncakeStoreTier(MooncakeStoreTierConfig(master=m.master, metadata=m.metadata,
                                                         global_segment_bytes=0 if remote else segment))
        tier.open()
        try:
            if not tier.health.healthy:
                raise RuntimeError(f"the tier's store client did not set up: {tier.health.snapshot().reason}")
            raw = tier.client._live()  # the same client, called directly: the plain limit
            src = torch.cat(recs)  # the records back to back in one registered buffer
            dst = torch.empty_like(src)
            for b in (src, dst):
                if raw.register_buffer(b.data_ptr(), b.numel()) != 0:
                    raise RuntimeError("register_buffer failed")
            cfg = tier.client.replicate_config(1, False, 0)
            samples: dict[str, list[float]] = {k: [] for k in ("tier_put", "raw_put", "tier_get", "raw_get",
                                                               "tier_publish", "raw_publish")}

            def tier_publish(keys: list[bytes], a: int, b: int) -> None:  # what StorePrefix does per batch
                with tier.staged([size] * (b - a)) as bufs:
                    assert len(bufs) == b - a
                    built = [codec.encode_page(pool, 1 + j % 64, out=buf) for j, buf in zip(range(a, b), bufs)]
                    tier.write(list(zip(keys[a:b], built)))

            def raw_publish(keys: list[str], a: int, b: int) -> None:  # the same pages encoded into the
                for j in range(a, b):                                  # registered buffer, then put
                    codec.encode_page(pool, 1 + j % 64, out=src[j * size:(j + 1) * size])
                _check(raw.batch_put_from(keys[a:b], [src.data_ptr() + j * size for j in range(a, b)], [size] * (b - a), cfg))
            batches = [(i, min(i + batch, records)) for i in range(0, records, batch)]
            for rnd in range(rounds + 1):  # round 0 warms up
                tkeys = [b"p:" + uuid.uuid4().bytes for _ in recs]
                rkeys = [f"bench-raw/{uuid.uuid4().hex}" for _ in recs]
                tpub = [b"p:" + uuid.uuid4().bytes for _ in recs]
                rpub = [f"bench-raw/{uuid.uuid4().hex}" for _ in recs]
                ops = {
                    "tier_put": lambda: [tier.write(list(zip(tkeys[a:b], recs[a:b]))) for a, b in batches],
                    "raw_put": lambda: [_check(raw.batch_put_from(rkeys[a:b], [src.data_ptr() + j * size for j in range(a, b)],
                                                                  [size] * (b - a), cfg)) for a, b in batches],
                    "tier_get": lambda: [_borrow_all(tier, tkeys[a:b]) for a, b in batches],
                    "raw_get": lambda: [_check(raw.batch_get_into(rkeys[a:b], [dst.data_ptr() + j * size for j in range(a, b)],
                                                                  [size] * (b - a)), size) for a, b in batches],
                    "tier_publish": lambda: [tier_publish(tpub, a, b) for a, b in batches],
                    "raw_publish": lambda: [raw_publish(rpub, a, b) for a, b in batches],
                }
                order = ["tier_put", "raw_put", "tier_get", "raw_get", "tier_publish", "raw_publish"]
                if not rnd % 2:
                    order = [order[i ^ 1] for i in range(len(order))]  # the baseline first
                for name in order:
                    t0 = time.perf_counter()
                    ops[name]()
                    dt = time.perf_counter() - t0
                    if rnd:
                        samples[name].append(nbytes / dt / 1e9)
                if not torch.equal(dst, src):
                    raise RuntimeError("the raw client read back other bytes")
                tier.client.remove([tier.store_key(k) for k in tkeys + tpub], force=True)
                raw.batch_remove(rkeys + rpub, True)
            for b in (src, dst):
                raw.unregister_buffer(b.data_ptr())
        finally:
            tier.close()
            if peer is not None:
                peer.close()

    def fig(a: str, b: str) -> dict[str, Any]:
        ratios = [x / y for x, y in zip(samples[a], samples[b])]
        return {"tier_gbps": statistics.median(samples[a]), "client_gbps": statistics.median(samples[b]),
                "ratio": statistics.median(ratios), "tier_samples": samples[a], "client_samples": samples[b]}

    return {"records": records, "record_bytes": size, "batch": batch, "rounds": rounds, "bytes_per_round": nbytes,
            "remote": remote, "put": fig("tier_put", "raw_put"), "get": fig("tier_get", "raw_get"),
            "publish": fig("tier_publish", "raw_publish")}


def _check(codes: list[int], expect: int = 0) -> None:
    bad = [c for c in codes if c != expect]
    if bad:
        raise RuntimeError(f"store call failed: {bad[:3]}")


def _borrow_all(tier: Any, keys: list[bytes]) -> None:
    """What a prefix load does with a run of store pages (without the copy into the pool): one borrow,
    then each record's checks (``verify_record``: magic, lengths, xxh3_64 checksum)."""
    from kvtier.server.tiers.record import verify_record

    with tier.borrow(keys) as recs:
        if any(r is None for r in recs):
            raise RuntimeError("the tier missed records it had just put")
        for r in recs:
            verify_record(r)


class _Alternate:
    """A replay backend sending each request to the next of several backends in turn (the request's
    first call, ``load``, picks the backend; its other calls go to the same one). The driver asks no
    lookup first: a backend picked on ``lookup`` was never picked, and every request went to the last
    backend (the replay figures of rounds 4-8 are one daemon's)."""

    simulate = False

    def __init__(self, backends: list[Any]) -> None:
        self.backends = backends
        self.i = -1

    def load(self, keys):  # noqa: ANN001 - ReplayBackend protocol
        self.i = (self.i + 1) % len(self.backends)
        return self.backends[self.i].load(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backends[self.i], name)

    def moves(self) -> dict[str, dict[str, int]]:
        total: dict[str, dict[str, int]] = {}
        for b in self.backends:
            for k, v in b.moves().items():
                t = total.setdefault(k, {"count": 0, "bytes": 0})
                t["count"] += v["count"]
                t["bytes"] += v["bytes"]
        return total


def _replay_pair(requests: list[Any], masters: list[MooncakeMaster], *, device_pages: int, host_bytes: int,
                 segment: int) -> dict[str, Any]:
    from kvtier.cli.replay_backend import ClientBackend
    from kvtier.client import KVTierClient
    from kvtier.client.spawn import DaemonProcess
    from kvtier.server.replay.driver import replay
    from kvtier.server.replay.scale import ReplayScale

    scale = ReplayScale(device_tokens=device_pages * 64, host_bytes=host_bytes, disk_bytes=0)
    daemons, clients = [], []
    try:
        for i in range(2):
            m = masters[i % len(masters)]
            d = DaemonProcess(extra_args=["--device", "cpu", "--log-level", "WARNING", "--host-memory", str(host_bytes),
                                          "--tiers", "host,mooncake", "--mooncake-master", m.master,
                                          "--mooncake-metadata", m.metadata, "--mooncake-segment-size", str(segment)])
            d.start()
            daemons.append(d)
            clients.append(KVTierClient(d.address, timeout=120))
        backends = [ClientBackend(c, scale.model, scale.num_layers, scale.device_tokens) for c in clients]
        res = replay(requests, _Alternate(backends), scale)
        loads = [int(b.client.tier_stats(b.pool_id).prefix_counters.get("loads", 0)) for b in backends]
        for b in backends:
            b.close()
        share = [len(requests[i::len(backends)]) for i in range(len(backends))]
        if loads != share:  # what the daemons counted: each took its turn
            raise RuntimeError(f"the daemons served {loads} requests, not {share} in turn")
        return {"hit_rate": res.hit_rate, "hit_tokens": dict(res.hit_tokens), "tokens": res.tokens,
                "verify_failures": res.verify_failures, "verified_pages": res.verified_pages, "seconds": res.seconds,
                "moves": res.moves, "requests_per_daemon": loads}
    finally:
        for c in clients:
            c.close()
        for d in daemons:
            d.stop()
            d.cleanup()


def simulate_pair(requests: list[Any], *, shared: bool, device_pages: int, host_bytes: int, segment: int) -> dict[str, Any]:
    """The same two-daemon replay over size-only tiers, the store an exact LRU of the same capacity
    (what the hit rates would be if the store evicted by exact LRU; the real master evicts ~5% of its
    objects, approximately LRU, whenever it passes 90% full)."""
    from kvtier.server.pool import PagedTokenAllocator
    from kvtier.server.replay.scale import ReplayScale
    from kvtier.server.replay.trace import RequestKeys
    from kvtier.server.tiers import PrefixCache, SimTierConfig, TierStack
    from kvtier.server.tiers.sim import SimTier

    codec = ReplayScale().codec()
    stores = [SimTier(SimTierConfig(capacity_bytes=segment * (2 if shared else 1), name="mooncake", shared=True))
              for _ in range(1 if shared else 2)]
    caches = [PrefixCache(TierStack([SimTier(SimTierConfig(capacity_bytes=host_bytes, name="host")), stores[i % len(stores)]]),
                          PagedTokenAllocator(device_pages * 64 + 64, 64), codec, pool=None, namespace=b"p:sim")
              for i in range(2)]
    keys_of = RequestKeys(64, 64)
    hits: dict[str, int] = {}
    pages = 0
    for i, req in enumerate(requests):
        cache = caches[i % 2]
        keys = [p.key for p in keys_of.pages(req.hash_ids)]
        ld = cache.load(keys)
        cache.store(ld.lease, keys[ld.loaded_pages:], ld.slots[ld.loaded_pages * 64:])
        cache.release(ld.lease)
        for t in ld.tiers:
            hits[t] = hits.get(t, 0) + 64
        pages += len(keys)
    return {"hit_rate": sum(hits.values()) / (pages * 64), "hit_tokens": hits, "tokens": pages * 64}


def shared_replay(*, requests: int = 2000, device_pages: int = 256, host_bytes: int = 64 * MiB,
                  segment: int = 512 * MiB, trace: Path = TRACE) -> dict[str, Any]:
    """Hit rates of two daemons sharing one store vs two with a private store each (module docstring),
    with the size-only simulation of both beside them."""
    from kvtier.server.replay.trace import read_trace

    reqs = read_trace(trace, limit=requests)
    knobs = {"device_pages": device_pages, "host_bytes": host_bytes, "segment": segment}
    with MooncakeMaster() as one:
        shared = _replay_pair(reqs, [one], **knobs)
    with MooncakeMaster() as m1, MooncakeMaster() as m2:
        private = _replay_pair(reqs, [m1, m2], **knobs)
    sim = {"shared": simulate_pair(reqs, shared=True, **knobs), "private": simulate_pair(reqs, shared=False, **knobs)}
    return {"requests": len(reqs), "device_pages_per_daemon": device_pages, "host_bytes_per_daemon": host_bytes,
            "segment_bytes_per_daemon": segment, "shared": shared, "private": private,
            "hit_rate_gain": shared["hit_rate"] - private["hit_rate"], "simulated_exact_lru": sim,
            "simulated_gain": sim["shared"]["hit_rate"] - sim["private"]["hit_rate"]}


def run(quick: bool = False) -> dict[str, Any]:
    """Both parts (put/get to a peer's segment and to the client's own; the shared replay); ``quick``:
    fewer records, rounds and requests (a smoke run, noisy figures)."""
    n, rounds, requests = (64, 3, 200) if quick else (256, 7, 2000)
    return {"put_get_remote": put_get(records=n, rounds=rounds, remote=True),
            "put_get_local": put_get(records=n, rounds=rounds, remote=False),
            "replay": shared_replay(requests=requests)}
