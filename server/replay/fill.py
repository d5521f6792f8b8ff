"""Deterministic KV bytes for a replay: every byte is a function of (hash id, layer, position).

A page's latent rows are a fixed random pattern ``(layers, page_size, row_bytes)`` XOR a per-(hash id,
page in block, layer) 64-bit word; its indexer page rows (live layers only) likewise. A page loaded
into the wrong place, from the wrong block, with another layer's data or with a stale indexer
differs from what :meth:`PageFill.expected` computes, so every loaded byte is checked.

Two ways to use it:

* on host arrays (:meth:`PageFill.expected`, :meth:`PageFill.count_bad_pages`): a backend that moves
  KV as bytes (over gRPC) writes and reads such arrays;
* in place, on a pool's memory (:meth:`PageFill.fill_pool`, :meth:`PageFill.count_bad_in_pool`): a
  backend with the pool's arenas at hand -- in this process, or attached to a daemon's pool --
  writes each page straight into the pool and checks it where it lies, one pass over its bytes and
  no copy; ``(layers, slots, words)`` and ``(live layers, pages, words)`` uint64 views of the arenas
  come from :func:`pool_words`.

The per-page words are splitmix64 of (hash id, page in block, layer, salt), computed for a whole
request at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.server.model_config import DSAModelConfig

def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on each uint64 of ``x`` (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def pool_words(pool: object) -> tuple[np.ndarray, np.ndarray]:
    """uint64 views of a pool's arenas (host memory): latent ``(layers, size + page_size, row_bytes / 8)``
    and indexer ``(live layers, num_pages, index_page_bytes / 8)``; writes through them are writes to the pool."""
    lat = pool.arena("latent").numpy().view(np.uint64)  # type: ignore[attr-defined]
    idx = pool.arena("index_k").numpy().view(np.uint64)  # type: ignore[attr-defined]
    live = len(pool.live_layers)  # type: ignore[attr-defined]
    return (lat.reshape(pool.layer_num, pool.num_slots, -1),  # type: ignore[attr-defined]
            idx.reshape(live, pool.num_pages, -1) if live else idx.reshape(0, 0, 0))  # type: ignore[attr-defined]


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
        self._scratch_lat = np.empty_like(self._lat)
        self._scratch_idx = np.empty_like(self._idx)

    @staticmethod
    def _words_for(pages: Sequence[tuple[int, int]], layers: np.ndarray, salt: int) -> np.ndarray:
        """``(p, len(layers))`` uint64: the word of each (page, layer)."""
        if not pages:
            return np.empty((0, layers.size), dtype=np.uint64)
        pg = np.asarray(pages, dtype=np.uint64).reshape(-1, 2)
        x = _splitmix64(pg[:, 0] ^ np.uint64(salt << 62))
        x = _splitmix64(x ^ pg[:, 1])
        return _splitmix64(x[:, None] ^ (layers[None, :] + np.uint64(1)))

    def words(self, pages: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """``(latent words (p, layers), indexer words (p, live layers))`` of ``pages``."""
        return self._words_for(pages, self._lat_layers, 0), self._words_for(pages, self._idx_layers, 1)

    def expected(self, pages: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """KV of ``pages`` ``[(hash_id, page_in_block), ...]`` (``p`` pages).

        Returns:
            ``(latent (layers, p * page_size, row_bytes) uint8, index (live layers, p, index_page_bytes) uint8)``.
        """
        L, ps, rb = self.model.num_layers, self.model.page_size, self.model.latent_row_bytes
        p = len(pages)
        lw, iw = self.words(pages)
        lat = self._lat[:, None] ^ lw.T[:, :, None, None]  # (L, p, ps, words)
        idx = self._idx[:, None] ^ iw.T[:, :, None] if self.live else np.empty((0, p, self._idx.shape[-1]), np.uint64)
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

    # ----- in place on a pool's memory ------------------------------------------------------------
    def fill_pool(self, pages: Sequence[tuple[int, int]], lat: np.ndarray, idx: np.ndarray, pool_pages: Sequence[int]) -> None:
        """Write the KV of ``pages`` onto pool pages ``pool_pages`` through :func:`pool_words` views:
        one XOR a page and component, straight into the pool."""
        ps = self.model.page_size
        lw, iw = self.words(pages)
        for i, page in enumerate(pool_pages):
            page = int(page)
            np.bitwise_xor(self._lat, lw[i][:, None, None], out=lat[:, page * ps:(page + 1) * ps])
            if self.live:
                np.bitwise_xor(self._idx, iw[i][:, None], out=idx[:, page])

    def count_bad_in_pool(self, pages: Sequence[tuple[int, int]], lat: np.ndarray, idx: np.ndarray,
                          pool_pages: Sequence[int]) -> int:
        """Pages among ``pages`` (lying on pool pages ``pool_pages``) whose bytes in the pool differ
        anywhere from what :meth:`expected` computes; reads each page where it lies (no copy)."""
        ps = self.model.page_size
        lw, iw = self.words(pages)
        bad = 0
        for i, page in enumerate(pool_pages):
            page = int(page)
            np.bitwise_xor(self._lat, lw[i][:, None, None], out=self._scratch_lat)
            ok = np.array_equal(self._scratch_lat, lat[:, page * ps:(page + 1) * ps])
            if ok and self.live:
                np.bitwise_xor(self._idx, iw[i][:, None], out=self._scratch_idx)
                ok = np.array_equal(self._scratch_idx, idx[:, page])
            bad += not ok
        return bad
