"""The replay driver's backends on a daemon: attached to the replay pool (local), or KV bytes over gRPC.

Both create a fresh pool on the daemon and drive its prefix cache through :class:`KVTierClient`
(LoadPrefix, StorePrefix, ReleasePrefix).

* :class:`AttachedBackend` (``--transport attach``; the default whenever the daemon is local):
  the pool is attached (``KVTierClient.attach``), the misses' KV is written straight into the
  attached tensors and every loaded page is verified where it lies -- no KV byte crosses gRPC.
  Ordering: the writes are plain CPU stores, complete before StorePrefix is called; LoadPrefix's
  pages are complete when it returns.
* :class:`ClientBackend` (``--transport grpc``): KV travels as WriteKV/ReadKV streams. Latent rows
  travel as raw uint8 rows; the indexer's page rows (64 FP8 keys of 128 bytes, then 64 FP32 scales)
  are split into per-token keys and scales for WriteKV and joined back after ReadKV, so the driver
  compares exactly the bytes a page record holds.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.client import KVTierClient
from kvtier.client.tiers import PrefixLease


class ClientBackend:
    """A fresh pool on a daemon, KV bytes over gRPC.

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
        self._leases: dict[str, PrefixLease] = {}

    def load(self, keys: Sequence[bytes]) -> tuple[str, np.ndarray, list[str]]:
        lease = self.client.load_prefix(self.pool_id, keys)
        self._leases[lease.lease_id] = lease
        return lease.lease_id, lease.slots.numpy(), lease.tiers

    def read(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """KV of whole-page ``slots``: ``(latent (L, n, row_bytes), index (live, n / page_size, page_bytes))`` uint8."""
        kv = self.client.read_kv(self.pool_id, slots)
        n = len(slots)
        p = n // self.page_size
        lat = np.stack([kv.latent[layer].reshape(n, -1).view(torch.uint8).numpy() for layer in range(self.layers)])
        idx = np.empty((len(self.live), p, self.key_bytes + self.page_size * 4), dtype=np.uint8)
        for pos, layer in enumerate(self.live):
            idx[pos, :, :self.key_bytes] = kv.index_k[layer].numpy().reshape(p, -1)
            idx[pos, :, self.key_bytes:] = kv.index_scale[layer].contiguous().view(torch.uint8).numpy().reshape(p, -1)
        return lat, idx

    def verify(self, fill, pages, slots: np.ndarray) -> int:  # type: ignore[no-untyped-def]
        return fill.count_bad_pages(pages, *self.read(slots))

    def write(self, fill, pages, slots: np.ndarray) -> None:  # type: ignore[no-untyped-def]
        latent, index = fill.expected(pages)
        n = len(slots)
        lat = {layer: torch.from_numpy(latent[layer]) for layer in range(self.layers)}
        ix = {}
        for pos, layer in enumerate(self.live):
            rows = index[pos]
            keys = np.ascontiguousarray(rows[:, :self.key_bytes]).reshape(n, -1)
            scales = np.ascontiguousarray(rows[:, self.key_bytes:]).view(np.float32).reshape(n)
            ix[layer] = (torch.from_numpy(keys), torch.from_numpy(scales))
        self.client.write_kv(self.pool_id, slots, latent=lat, index=ix)

    def store(self, lease: str, keys: Sequence[bytes], slots: np.ndarray, release: bool = False) -> None:
        self.client.store_prefix(self._leases[lease], keys, slots, release=release)
        if release:
            del self._leases[lease]

    def release(self, lease: str) -> None:
        self.client.release_prefix(self._leases.pop(lease))

    def moves(self) -> dict[str, dict[str, int]]:
        return self.client.tier_stats(self.pool_id).moves

    def close(self) -> None:
        self.client.delete_pool(self.pool_id, force=True)


class AttachedBackend(ClientBackend):
    """A fresh pool on a local daemon, attached: KV written and verified in the attached tensors.

    Args: as :class:`ClientBackend` (the client must reach the daemon by its unix socket).

    Raises:
        FailedPreconditionError: the daemon is not local (attach needs its unix socket).
    """

    def __init__(self, client: KVTierClient, model: str, num_layers: int, device_tokens: int, pool_id: str = "") -> None:
        super().__init__(client, model, num_layers, device_tokens, pool_id)
        try:
            self.attached = client.attach(self.pool_id)
        except BaseException:
            client.delete_pool(self.pool_id, force=True)
            raise
        from kvtier.server.replay.fill import pool_words  # the fill works on the pool core's views

        self._words = pool_words(self.attached.pool)

    def load(self, keys: Sequence[bytes]) -> tuple[str, np.ndarray, list[str]]:
        lease = self.attached.load_prefix(keys)  # over the attach connection, in the session
        self._leases[lease.lease_id] = lease
        return lease.lease_id, lease.slots.numpy(), lease.tiers

    def verify(self, fill, pages, slots: np.ndarray) -> int:  # type: ignore[no-untyped-def]
        return fill.count_bad_in_pool(pages, *self._words, slots[::self.page_size] // self.page_size)

    def write(self, fill, pages, slots: np.ndarray) -> None:  # type: ignore[no-untyped-def]
        fill.fill_pool(pages, *self._words, slots[::self.page_size] // self.page_size)

    def store(self, lease: str, keys: Sequence[bytes], slots: np.ndarray, release: bool = False) -> None:
        self.attached.store_prefix(self._leases[lease], keys, slots, release=release)
        if release:
            del self._leases[lease]

    def release(self, lease: str) -> None:
        self.attached.release_prefix(self._leases.pop(lease))

    def close(self) -> None:
        self._words = None  # type: ignore[assignment]
        self.attached.detach()
        super().close()
