"""A worker process for the attach tests: ``python attach_worker.py ADDRESS POOL SCENARIO ARGS_JSON``.

It attaches the pool, works on it through its tensors only (no KV bytes over gRPC) and prints one
JSON object per line: what it saw, for the test (another process) to check against its own reference.

Scenarios:
  ``store``  ARGS {"keys": [hex], "seeds": [int]}: one request per key (load -> write the seeded page
             through the tensors -> store -> release); prints ``{"stored": n}``.
  ``read``   ARGS {"keys": [hex]}: load the keys, read every loaded page through the tensors, print
             ``{"tiers": [...], "digests": [hex per page]}``, release.
  ``hold``   ARGS {"slots": n, "keys": [hex]}: allocate ``n`` slots and load ``keys`` (a lease), print
             ``{"ready": true, "slots": [...], "lease_slots": [...]}`` and sleep until killed.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from kv_helpers import LAYERS4, LIVE4, PAGE_SIZE, random_kv

from kvtier.client import KVTierClient


def page_digest(ap, slots: torch.Tensor) -> str:
    """sha256 of one page read through the attached tensors: latent rows of every layer, then keys and
    scales of every live layer (the order :func:`expected_digest` uses)."""
    import hashlib

    h = hashlib.sha256()
    for layer in LAYERS4:
        h.update(ap.kv_buffer[layer][slots].reshape(PAGE_SIZE, -1).contiguous().view(torch.uint8).numpy().tobytes())
    for layer in LIVE4:
        keys, scales = ap.get_index_k_scale(layer, slots)
        h.update(keys.numpy().tobytes())
        h.update(scales.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_page(ap, slots: torch.Tensor, seed: int) -> None:
    """The seeded page written through the tensors: latent rows by plain indexing (as an attention
    kernel's cache write would), indexer keys and scales with the pool's own method."""
    latent, index = random_kv(PAGE_SIZE, seed, layers=LAYERS4, live=LIVE4)
    for layer, rows in latent.items():
        ap.kv_buffer[layer][slots] = rows.view(PAGE_SIZE, 1, -1)
    for layer, (keys, scales) in index.items():
        ap.set_index_k_scale_buffer(layer, slots, keys, scales)


def main() -> None:
    address, pool_id, scenario, args = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    keys = [bytes.fromhex(k) for k in args.get("keys", [])]
    with KVTierClient(address, timeout=60) as c, c.attach(pool_id) as ap:
        if scenario == "store":
            for key, seed in zip(keys, args["seeds"]):
                lease = ap.load_prefix([key])
                try:
                    if not lease.tiers:
                        write_page(ap, lease.slots, seed)
                        ap.store_prefix(lease, [key], lease.slots)  # the writes above are complete: plain CPU stores
                finally:
                    ap.release_prefix(lease)
            print(json.dumps({"stored": len(keys)}), flush=True)
        elif scenario == "read":
            lease = ap.load_prefix(keys)
            try:
                digests = [page_digest(ap, lease.slots[i * PAGE_SIZE:(i + 1) * PAGE_SIZE]) for i in range(lease.loaded_pages)]
                print(json.dumps({"tiers": lease.tiers, "digests": digests}), flush=True)
            finally:
                ap.release_prefix(lease)
        elif scenario == "hold":
            slots = ap.allocate_slots(args["slots"])
            lease = ap.load_prefix(keys)
            print(json.dumps({"ready": True, "slots": slots.tolist(), "lease_slots": lease.slots.tolist()}), flush=True)
            time.sleep(3600)
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main()
