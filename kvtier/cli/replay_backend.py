"""The replay driver's backend over gRPC: a daemon's TierService and PoolService through the client.

Latent rows travel as raw uint8 rows; the indexer's page rows (64 FP8 keys of 128 bytes, then 64 FP32
scales) are split into per-token keys and scales for WriteKV and joined back after ReadKV, so the
driver compares exactly the bytes a page record holds.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.client import KVTierClient
from kvtier.client.tiers import PrefixLease


class ClientBackend:
    """A fresh pool on a daemon, driven through :class:`KVTierClient`.

    Args:
        client: connected client.
        model: preset name.
        num_layers: first N layers of the model.
        device_tokens: pool capacity in tokens.
        pool_id: id of the pool to create ("" = a fresh ``replay-...`` id).
    """

    simulate = False

    def __init__(self, client: KVTierClient, model: str, num_layers: int, device_tokens: int, pool_id: str = "") -> None:
        self.client = client
        self.pool_id = pool_id or f"replay-{uuid.uuid4().hex[:8]}"
        info = client.create_pool(model, num_layers=num_layers, size_tokens=device_tokens, pool_id=self.pool_id)
        lay = info.layout
        self.page_size = lay.page_size
        self.layers = lay.num_layers
        self.live = [i for i, c in enumerate(lay.skip_mask) if c == "F"]
        self.key_bytes = self.page_size * lay.index_head_dim
        self._leases: dict[int, PrefixLease] = {}

    def lookup(self, keys: Sequence[bytes]) -> dict[str, int]:
        return self.client.lookup_prefix(self.pool_id, keys).per_tier

    def load(self, keys: Sequence[bytes]) -> tuple[int, np.ndarray, list[str]]:
        lease = self.client.load_prefix(self.pool_id, keys)
        self._leases[lease.lease_id] = lease
        return lease.lease_id, lease.slots.numpy(), lease.tiers

    def read(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        kv = self.client.read_kv(self.pool_id, slots)
        n = len(slots)
        p = n // self.page_size
        lat = np.stack([kv.latent[layer].reshape(n, -1).view(torch.uint8).numpy() for layer in range(self.layers)])
        idx = np.empty((len(self.live), p, self.key_bytes + self.page_size * 4), dtype=np.uint8)
        for pos, layer in enumerate(self.live):
            idx[pos, :, :self.key_bytes] = kv.index_k[layer].numpy().reshape(p, -1)
            idx[pos, :, self.key_bytes:] = kv.index_scale[layer].contiguous().view(torch.uint8).numpy().reshape(p, -1)
        return lat, idx

    def write(self, slots: np.ndarray, latent: np.ndarray, index: np.ndarray) -> None:
        n = len(slots)
        lat = {layer: torch.from_numpy(latent[layer]) for layer in range(self.layers)}
        ix = {}
        for pos, layer in enumerate(self.live):
            rows = index[pos]
            keys = np.ascontiguousarray(rows[:, :self.key_bytes]).reshape(n, -1)
            scales = np.ascontiguousarray(rows[:, self.key_bytes:]).view(np.float32).reshape(n)
            ix[layer] = (torch.from_numpy(keys), torch.from_numpy(scales))
        self.client.write_kv(self.pool_id, slots, latent=lat, index=ix)

    def store(self, lease: int, keys: Sequence[bytes], slots: np.ndarray) -> None:
        self.client.store_prefix(self._leases[lease], keys, slots)

    def release(self, lease: int) -> None:
        self.client.release_prefix(self._leases.pop(lease))

    def moves(self) -> dict[str, dict[str, int]]:
        return self.client.tier_stats(self.pool_id).moves

    def close(self) -> None:
        self.client.delete_pool(self.pool_id, force=True)
