"""Helpers for in-process daemon tests: a Daemon on the CPU, pools, pages of known bytes."""

from __future__ import annotations

import torch

from kvtier.page_keys import page_keys
from kvtier.server.daemon import Daemon, DaemonConfig
from kvtier.server.daemon.pools import PoolRequest
from kvtier.server.daemon.tenants import Caller

PS = 64
A, B = Caller("team-a", "tok-a-0123456789abcdef"), Caller("team-b", "tok-b-0123456789abcdef")


def daemon(**config) -> Daemon:
    return Daemon(DaemonConfig(device="cpu", **config))


def pool(d: Daemon, caller: Caller, pool_id: str = "p", tokens: int = 512, layers: int = 4):
    return d.pools.create(caller, PoolRequest(pool_id=pool_id, preset="glm-5.2", num_layers=layers, size_tokens=tokens))


def rows(n: int, row_bytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def fill(d: Daemon, caller: Caller, pool_id: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate ``n`` slots and write the same random latent rows on every layer, stamped as a WriteKV
    commit stamps them (:meth:`PoolEntry.changed`); returns ``(slots, rows)``."""
    with d.pools.locked(caller, pool_id, exclusive=True) as e:
        slots = e.alloc(n)
        r = rows(n, e.pool.row_bytes, seed)
        for layer in range(e.pool.layer_num):
            e.pool.set_kv_buffer(layer, slots, r)
        e.changed(torch.unique(slots // e.page_size))
    return slots, r


def read_rows(d: Daemon, caller: Caller, pool_id: str, slots: torch.Tensor, layer: int = 0) -> torch.Tensor:
    with d.pools.locked(caller, pool_id, exclusive=False) as e:
        return e.pool.get_kv_buffer_rows(layer, slots).reshape(slots.numel(), -1).clone()


def keys(n: int, seed: int = 0) -> list[bytes]:
    return page_keys(list(range(seed * 100000, seed * 100000 + n * PS)), PS)


def store_prefix(d: Daemon, caller: Caller, pool_id: str, ks: list[bytes], seed: int) -> None:
    """One request that misses: load, write known rows into the fresh pages, store, release."""
    ld = d.tiers.load(caller, pool_id, ks, None)
    with d.pools.locked(caller, pool_id, exclusive=True) as e:
        for layer in range(e.pool.layer_num):
            e.pool.set_kv_buffer(layer, ld.slots, rows(ld.slots.numel(), e.pool.row_bytes, seed))
    d.tiers.store(caller, pool_id, ld.lease, ks, ld.slots.tolist())
    d.tiers.release(caller, pool_id, ld.lease)
