"""One soak process: ``python soak_worker.py ADDRESS SECONDS THREADS SEED`` runs THREADS clients, each
looping random scenarios for SECONDS, and prints one JSON line: ``{"ops": {...}, "errors": [...]}``.

Scenarios: KV write/read/move, a write that allocates, offload/restore, prefix requests, monitoring
calls and self-pulls. Every scenario checks its own bytes and leaves nothing behind (slots freed, copies dropped, leases
released), so after all workers end the daemon's pools and tiers must be back to where they started.
Pools (made by the test): ``soak`` (KV, 512 pages), ``soak-dst`` (PullKV destinations), ``soak-pfx``
(prefix cache, 128 pages: the 48 shared page keys cached at setup never leave the device tier).
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import threading
import time
import traceback
import uuid
from collections import Counter

import torch

from kvtier.client import KVTierClient
from kvtier.page_keys import page_keys

PS = 64
LAYERS = 2  # GLM-5.2's first two layers: both own an indexer buffer
PREFIX_KEYS = page_keys(list(range(48 * PS)), PS)


def content(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    latent = {x: torch.randint(0, 256, (n, 656), dtype=torch.uint8, generator=g) for x in range(LAYERS)}
    index = {x: (torch.randint(0, 256, (n, 128), dtype=torch.uint8, generator=g), torch.rand(n, generator=g))
             for x in range(LAYERS)}
    return latent, index


def check(kv, latent, index) -> None:
    for x in latent:
        if not torch.equal(kv.latent[x], latent[x]):
            raise AssertionError(f"latent layer {x} differs")
    for x in index:
        if not (torch.equal(kv.index_k[x], index[x][0]) and torch.equal(kv.index_scale[x], index[x][1])):
            raise AssertionError(f"indexer layer {x} differs")


def key_seed(key: bytes) -> int:
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little")


def kv_round_trip(c: KVTierClient, rng: random.Random) -> None:
    n = rng.randint(1, 4) * PS - rng.randint(0, 63)
    s = c.allocate_slots("soak", 2 * n)
    try:
        lat, idx = content(rng.getrandbits(31), n)
        c.write_kv("soak", s[:n], latent=lat, index=idx)
        check(c.read_kv("soak", s[:n]), lat, idx)
        c.move_kv("soak", s[n:], s[:n])
        check(c.read_kv("soak", s[n:]), lat, idx)
    finally:
        c.free_slots("soak", s)


def kv_write_new(c: KVTierClient, rng: random.Random) -> None:
    """A write that allocates its pages (WriteKV with allocate_tokens), read back, freed."""
    n = rng.randint(1, 4) * PS - rng.randint(0, 63)
    lat, idx = content(rng.getrandbits(31), n)
    s = c.write_new_kv("soak", latent=lat, index=idx)
    try:
        if s.numel() != n:
            raise AssertionError(f"write_new_kv gave {s.numel()} slots for {n} tokens")
        check(c.read_kv("soak", s), lat, idx)
    finally:
        c.free_slots("soak", s)


def offload_restore(c: KVTierClient, rng: random.Random) -> None:
    n = rng.randint(1, 4) * PS
    s = c.allocate_slots("soak", n)
    lat, idx = content(rng.getrandbits(31), n)
    try:
        c.write_kv("soak", s, latent=lat, index=idx)
    except BaseException:
        c.free_slots("soak", s)
        raise
    key = f"soak-{uuid.uuid4().hex}"
    c.offload("soak", key, s, free_slots=True)
    back = c.restore("soak", key, drop=True)
    try:
        check(c.read_kv("soak", back), lat, idx)
    finally:
        c.free_slots("soak", back)


def prefix_request(c: KVTierClient, rng: random.Random) -> None:
    """1-3 of the shared keys (all cached since the test's setup: device hits, checked byte for byte),
    then, every other time, a key nobody stored: its fresh page is written and offered to StorePrefix
    under an already cached key (adopted: 0, the cache keeps its own page) and freed at release."""
    shared = rng.sample(PREFIX_KEYS, rng.randint(1, 3))
    keys = shared + ([uuid.uuid4().bytes] if rng.random() < 0.5 else [])
    lease = c.load_prefix("soak-pfx", keys)
    try:
        if lease.loaded_pages != len(shared):
            raise AssertionError(f"{lease.loaded_pages} of {len(shared)} cached pages loaded")
        kv = c.read_kv("soak-pfx", lease.slots[:len(shared) * PS])
        for j, k in enumerate(shared):
            lat, idx = content(key_seed(k), PS)
            rows = slice(j * PS, (j + 1) * PS)
            if not all(torch.equal(kv.latent[x][rows], lat[x]) for x in lat):
                raise AssertionError("a loaded prefix page differs")
        if len(keys) > len(shared):
            fresh = lease.slots[len(shared) * PS:]
            lat, idx = content(rng.getrandbits(31), PS)
            c.write_kv("soak-pfx", fresh, latent=lat, index=idx)
            check(c.read_kv("soak-pfx", fresh), lat, idx)
            if c.store_prefix(lease, shared[:1], fresh) != 0:
                raise AssertionError("a cached key adopted a second page")
    finally:
        c.release_prefix(lease)


def store_shared_keys(c: KVTierClient) -> None:
    """The test's setup: every shared key cached with its own deterministic content."""
    lease = c.load_prefix("soak-pfx", PREFIX_KEYS)
    parts = [content(key_seed(k), PS) for k in PREFIX_KEYS]
    lat = {x: torch.cat([p[0][x] for p in parts]) for x in range(LAYERS)}
    idx = {x: (torch.cat([p[1][x][0] for p in parts]), torch.cat([p[1][x][1] for p in parts])) for x in range(LAYERS)}
    c.write_kv("soak-pfx", lease.slots, latent=lat, index=idx)
    c.store_prefix(lease, PREFIX_KEYS, lease.slots)
    c.release_prefix(lease)


def monitor(c: KVTierClient, rng: random.Random) -> None:
    c.stats()
    c.tier_stats("")
    c.tier_stats("soak-pfx")
    if c.health() != "SERVING":
        raise AssertionError("daemon not SERVING")
    c.list_pools()
    c.describe_pool("soak")
    c.buffer_infos("soak")
    c.where_is("soak-pfx", PREFIX_KEYS[:4])
    c.lookup_prefix("soak-pfx", PREFIX_KEYS[:4])


def pull(c: KVTierClient, rng: random.Random) -> None:
    src = c.allocate_slots("soak", PS)
    dst = c.allocate_slots("soak-dst", PS)
    try:
        lat, idx = content(rng.getrandbits(31), PS)
        c.write_kv("soak", src, latent=lat, index=idx)
        c.pull_kv("soak-dst", c.address, "soak", src_slots=src, dst_slots=dst, transport="grpc")
        check(c.read_kv("soak-dst", dst), lat, idx)
    finally:
        c.free_slots("soak", src)
        c.free_slots("soak-dst", dst)


SCENARIOS = [(kv_round_trip, 3), (kv_write_new, 2), (offload_restore, 3), (prefix_request, 4), (monitor, 3), (pull, 1)]


def run(address: str, seconds: float, threads: int, seed: int) -> dict:
    ops: Counter[str] = Counter()
    errors: list[str] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds
    names, weights = [f for f, _ in SCENARIOS], [w for _, w in SCENARIOS]

    def client_loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with KVTierClient(address, timeout=60, retries=0) as c:
            while time.monotonic() < end:
                fn = rng.choices(names, weights)[0]
                try:
                    fn(c, rng)
                    with lock:
                        ops[fn.__name__] += 1
                except Exception as e:  # noqa: BLE001 - every error is reported
                    with lock:
                        errors.append(f"{fn.__name__}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")

    workers = [threading.Thread(target=client_loop, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return {"ops": dict(ops), "errors": errors}


if __name__ == "__main__":
    address, seconds, threads, seed = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(run(address, seconds, threads, seed)))
