"""Deterministic KV bytes for a replay: every byte is a function of (hash id, layer, position).

A page's latent rows are a fixed random pattern ``(layers, page_size, row_bytes)`` XOR a per-(hash id,
page in block, layer) 64-bit word; its indexer page rows (live layers only) likewise. A page loaded
into the wrong place, from the wrong block, with another layer's data or with a stale indexer
differs from what :meth:`PageFill.expected` computes, so every loaded byte is checked.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from kvtier.server.model_config import DSAModelConfig


class PageFill:
    """Fills and checks pages of one model geometry.

    Args:
        model: geometry (its latent row bytes, page size, layers).
        indexer_layers: ``(num_layers,)`` True where pages carry indexer data (the pool's live layers).
    """

    def __init__(self, model: DSAModelConfig, indexer_layers: Sequence[bool]) -> None:
        self.model = model
        self.live = [i for i, m in enumerate(indexer_layers) if m]
        rng = np.random.default_rng(20260101)
        ps, rb, L = model.page_size, model.latent_row_bytes, model.num_layers
        if rb % 8 or model.index_page_bytes % 8:
            raise ValueError("fill needs row and page bytes that are multiples of 8")
        self._lat = rng.integers(0, 2**63, size=(L, ps, rb // 8), dtype=np.uint64)
        self._idx = rng.integers(0, 2**63, size=(len(self.live), model.index_page_bytes // 8), dtype=np.uint64)
        self._lat_layers = np.arange(L, dtype=np.uint64)
        self._idx_layers = np.array(self.live, dtype=np.uint64)

    @staticmethod
    def _words(hash_id: int, page_in_block: int, layers: np.ndarray, salt: int) -> np.ndarray:
        return np.array([xxhash.xxh3_64_intdigest(np.array([hash_id, page_in_block, int(layer), salt], dtype=np.int64).tobytes())
                         for layer in layers], dtype=np.uint64)

    def expected(self, pages: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """KV of ``pages`` ``[(hash_id, page_in_block), ...]`` (``p`` pages).

        Returns:
            ``(latent (layers, p * page_size, row_bytes) uint8, index (live layers, p, index_page_bytes) uint8)``.
        """
        L, ps, rb = self.model.num_layers, self.model.page_size, self.model.latent_row_bytes
        p = len(pages)
        lat = np.empty((L, p, ps, rb // 8), dtype=np.uint64)
        idx = np.empty((len(self.live), p, self.model.index_page_bytes // 8), dtype=np.uint64)
        for i, (h, j) in enumerate(pages):
            np.bitwise_xor(self._lat, self._words(h, j, self._lat_layers, 0)[:, None, None], out=lat[:, i])
            if self.live:
                np.bitwise_xor(self._idx, self._words(h, j, self._idx_layers, 1)[:, None], out=idx[:, i])
        return lat.view(np.uint8).reshape(L, p * ps, rb), idx.view(np.uint8).reshape(len(self.live), p, -1)

    def count_bad_pages(self, pages: Sequence[tuple[int, int]], latent: np.ndarray, index: np.ndarray) -> int:
        """Pages among ``pages`` whose ``latent``/``index`` (shapes as :meth:`expected`) differ anywhere."""
        if not pages:
            return 0
        exp_lat, exp_idx = self.expected(pages)
        ps = self.model.page_size
        p = len(pages)
        lat_bad = (latent.reshape(latent.shape[0], p, ps, -1) != exp_lat.reshape(exp_lat.shape[0], p, ps, -1)).any(axis=(0, 2, 3))
        idx_bad = (index != exp_idx).any(axis=(0, 2)) if self.live else np.zeros(p, dtype=bool)
        return int((lat_bad | idx_bad).sum())
