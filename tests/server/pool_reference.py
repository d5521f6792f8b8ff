"""A plain numpy reference of a DSA pool's bytes, and helpers the pool tests share.

The reference knows only DESIGN.md's byte layout: a latent row per (layer, slot), and for a live
layer an indexer page row of 8448 bytes where token ``t`` of page ``loc // 64`` keeps its key at byte
``t * 128`` and its scale at byte ``64 * 128 + 4 * t``. It applies that rule by hand, so comparing
it with the pool checks the pool's indexing, not a copy of it.

Also the small builders the pool tests share (``small_pool``, ``scattered_slots``, ``snapshot``).
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import DSATokenToKVPool, create_pool


def latent_view(pool: DSATokenToKVPool, layer: int) -> torch.Tensor:
    """Layer ``layer``'s latent buffer as raw ``(size + page_size, row_bytes)`` uint8 (a view)."""
    return pool.kv_buffer[layer].view(torch.uint8).reshape(pool.size + pool.page_size, -1)


def randomize(pool: DSATokenToKVPool, seed: int) -> None:
    """Fill every latent row and every live indexer page with random bytes."""
    g = torch.Generator().manual_seed(seed)
    for layer in range(pool.layer_num):
        lat = latent_view(pool, layer)
        lat.copy_(torch.randint(0, 256, tuple(lat.shape), dtype=torch.uint8, generator=g))
        idx = pool.index_k_with_scale_buffer[layer]
        if idx.numel():
            idx.copy_(torch.randint(0, 256, tuple(idx.shape), dtype=torch.uint8, generator=g))


def snapshot(pool: DSATokenToKVPool) -> list[np.ndarray]:
    """Copies of every latent and indexer buffer's bytes (indexer buffers of skip layers are empty)."""
    lat = [latent_view(pool, layer).cpu().numpy().copy() for layer in range(pool.layer_num)]
    idx = [pool.index_k_with_scale_buffer[layer].cpu().numpy().copy() for layer in range(pool.layer_num)]
    return lat + idx


def assert_same_bytes(before: list[np.ndarray], after: list[np.ndarray]) -> None:
    """Every buffer byte-identical (shapes included)."""
    assert len(before) == len(after)
    for i, (b, a) in enumerate(zip(before, after)):
        assert b.shape == a.shape, f"buffer {i}: shape {b.shape} -> {a.shape}"
        if not np.array_equal(b, a):
            raise AssertionError(f"buffer {i}: {int((b != a).sum())} bytes changed")


class RefPool:
    """Numpy model of a pool's bytes: ``lat[layer]`` ``(slots, row_bytes)``, ``idx[layer]`` ``(pages, 8448)``."""

    KEY = 128  # FP8 key bytes per token
    SCALE = 4  # FP32 scale bytes per token

    def __init__(self, pool: DSATokenToKVPool) -> None:
        self.page_size = pool.page_size
        self.live = [layer for layer in range(pool.layer_num) if pool.index_k_with_scale_buffer[layer].numel()]
        snap = snapshot(pool)
        self.lat = snap[: pool.layer_num]
        self.idx = snap[pool.layer_num:]

    def buffers(self) -> list[np.ndarray]:
        return self.lat + self.idx

    def key(self, layer: int, slot: int) -> np.ndarray:
        page, t = divmod(int(slot), self.page_size)
        return self.idx[layer][page, t * self.KEY:(t + 1) * self.KEY]

    def scale(self, layer: int, slot: int) -> np.ndarray:
        page, t = divmod(int(slot), self.page_size)
        start = self.page_size * self.KEY + self.SCALE * t
        return self.idx[layer][page, start:start + self.SCALE]

    def token(self, slot: int) -> list[tuple[bytes, ...]]:
        """Everything slot ``slot`` holds: per layer (latent, key, scale) bytes (key/scale b'' on skip layers)."""
        out = []
        for layer in range(len(self.lat)):
            lat = self.lat[layer][int(slot)].tobytes()
            if layer in self.live:
                out.append((lat, self.key(layer, slot).tobytes(), self.scale(layer, slot).tobytes()))
            else:
                out.append((lat, b"", b""))
        return out

    def put_token(self, slot: int, data: list[tuple[bytes, ...]]) -> None:
        for layer, (lat, key, scale) in enumerate(data):
            self.lat[layer][int(slot)] = np.frombuffer(lat, dtype=np.uint8)
            if layer in self.live:
                self.key(layer, slot)[:] = np.frombuffer(key, dtype=np.uint8)
                self.scale(layer, slot)[:] = np.frombuffer(scale, dtype=np.uint8)

    def move(self, tgt, src) -> None:
        """Read every source first, then write every target."""
        data = [self.token(s) for s in src]
        for t, d in zip(tgt, data):
            self.put_token(t, d)


SMALL_LIVE = [0, 1, 2, 6]  # GLM-5.2's rules on its first 8 layers


def small_pool(dtype: str = "fp8", size: int = 1024, seed: int = 0, role: str = "target") -> DSATokenToKVPool:
    """A CPU pool with GLM-5.2's rules on 8 layers (live 0, 1, 2, 6), filled with random bytes."""
    model = DSAModelConfig.from_preset("glm-5.2", num_layers=8, kv_cache_dtype=dtype)
    pool = create_pool(model, size, role=role, device="cpu")
    randomize(pool, seed)
    return pool


def scattered_slots(n: int, seed: int, limit: int, exclude=()) -> torch.Tensor:
    """``n`` distinct slots in ``[1, limit)``, in random (non-contiguous, non-aligned) order."""
    rng = np.random.default_rng(seed)
    free = np.setdiff1d(np.arange(1, limit), np.asarray(list(exclude), dtype=np.int64))
    return torch.from_numpy(rng.choice(free, size=n, replace=False).astype(np.int64))
