"""Helpers for tier tests: write and read whole pages of a pool, make records, make keys."""

from __future__ import annotations

import numpy as np
import torch

from kvtier.page_keys import page_keys
from kvtier.server.pool import slots_of_pages

PAGE = 64
ROW = 656
INDEX_PAGE = 64 * 132


def fill_page(pool, page: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """Write random latent rows and live-layer indexer keys/scales onto ``page``; return what was written."""
    g = torch.Generator().manual_seed(seed)
    slots = slots_of_pages(torch.tensor([page]), PAGE)
    written: dict[str, list[torch.Tensor]] = {"latent": [], "index_k": [], "scale": []}
    for layer in range(pool.layer_num):
        rows = torch.randint(0, 256, (PAGE, ROW), dtype=torch.uint8, generator=g)
        pool.set_kv_buffer(layer, slots, rows)
        written["latent"].append(rows)
    for layer in pool.live_layers:
        keys = torch.randint(0, 256, (PAGE, 128), dtype=torch.uint8, generator=g)
        scale = torch.rand(PAGE, generator=g)
        pool.set_index_k_scale_buffer(layer, slots, keys, scale)
        written["index_k"].append(keys)
        written["scale"].append(scale)
    return written


def read_page(pool, page: int) -> dict[str, list[torch.Tensor]]:
    slots = slots_of_pages(torch.tensor([page]), PAGE)
    out: dict[str, list[torch.Tensor]] = {"latent": [], "index_k": [], "scale": []}
    for layer in range(pool.layer_num):
        out["latent"].append(pool.get_kv_buffer_rows(layer, slots).reshape(PAGE, ROW))
    for layer in pool.live_layers:
        k, s = pool.get_index_k_scale(layer, slots)
        out["index_k"].append(k)
        out["scale"].append(s)
    return out


def verify_same_page(a: dict, b: dict) -> None:
    for part in ("latent", "index_k", "scale"):
        assert len(a[part]) == len(b[part])
        for x, y in zip(a[part], b[part]):
            assert torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else x.view(torch.int32),
                               y.view(torch.uint8) if y.dtype != torch.float32 else y.view(torch.int32))


def keys_for(n: int, seed: int = 0) -> list[bytes]:
    return page_keys(np.arange(seed * 100000, seed * 100000 + n * PAGE), PAGE)


def record_of(codec, pool, page: int, seed: int) -> torch.Tensor:
    fill_page(pool, page, seed)
    return codec.encode_from_pool(pool, slots_of_pages(torch.tensor([page]), PAGE))


class HeldLock:
    """Holds ``lock`` on a thread of its own from ``__enter__`` until ``__exit__`` (a slow commit
    holding a tier's index lock, without the slow commit)."""

    def __init__(self, lock) -> None:
        import threading

        self._lock, self._held, self._let_go = lock, threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._hold, daemon=True)

    def _hold(self) -> None:
        with self._lock:
            self._held.set()
            self._let_go.wait(30)

    def __enter__(self) -> HeldLock:
        self._thread.start()
        assert self._held.wait(5), "the lock was never taken"
        return self

    def __exit__(self, *exc: object) -> None:
        self._let_go.set()
        self._thread.join(5)
