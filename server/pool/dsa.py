"""DSA pool: MLA latent KV plus the paged indexer key cache, none for skip-topk layers.

Indexer layout (DESIGN.md "Byte layouts"; SGLang's ``NSATokenToKVPool`` for the same arguments):
per layer a uint8 buffer ``(num_pages, page_size * (index_head_dim + index_head_dim // 128 * 4))``
with ``num_pages = (index_buf_size + page_size + 1) // page_size``. Inside a page row the first
``page_size * 128`` bytes are the FP8 keys (token ``t`` at byte ``t * 128``), then ``page_size`` FP32
scales (token ``t`` at byte ``page_size * 128 + 4 * t``). A token slot ``loc`` lives at page
``loc // page_size``, offset ``loc % page_size`` -- never at row ``loc``.

A skip-topk layer's indexer buffer has shape ``(0, cols)``: zero bytes, present so that layer
positions line up with peers. It is never read, written, copied, hashed or sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvtier.server.hostmem import HostArena
from kvtier.server.model_config import index_token_bytes
from kvtier.server.pool.arena import as_words, word_dtype
from kvtier.server.pool.buffer_info import BufferRange, BufInfos, live_ranges
from kvtier.server.pool.device_copy import Part
from kvtier.server.pool.mla import MLATokenToKVPool, _check_out, _chunk_rows, whole_pages
from kvtier.server.pool.validation import check_layer, check_unique

INDEX_CHUNK_PAGES = 128  # get_cpu_copy: indexer chunks hold at most this many page rows


def first_appearance_pages(slots: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages touched by ``slots`` in order of first appearance, and each slot's index into them.

    Args:
        slots: ``(n,)`` int64 token slots (CPU or device).
        page_size: tokens per page.

    Returns:
        ``(pages (p,) int64, page_idx (n,) int64)`` with ``pages[page_idx[i]] == slots[i] // page_size``.
    """
    pages = (slots // page_size).cpu().numpy()
    if pages.size == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty
    if pages.size == 1 or bool(np.all(pages[1:] >= pages[:-1])):  # common case: sorted slots
        uniq, page_idx = np.unique(pages, return_inverse=True)
        return torch.from_numpy(uniq), torch.from_numpy(page_idx.astype(np.int64))
    uniq, first, inv = np.unique(pages, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return torch.from_numpy(uniq[order]), torch.from_numpy(rank[inv].astype(np.int64))


class DSATokenToKVPool(MLATokenToKVPool):
    """Skip-aware DSA KV pool: latent rows for every layer, indexer pages for live layers only.

    Args:
        size, page_size, kv_lora_rank, qk_rope_head_dim, layer_num, device, kv_cache_dtype:
            as :class:`MLATokenToKVPool`.
        index_head_dim: indexer key width (128 FP8 values, one FP32 scale each 128).
        index_buf_size: tokens the indexer buffers cover (default ``size``).
        skip_topk_layers: ``(layer_num,)`` booleans, True where the layer skips top-k (no indexer
            buffer). None: no layer skips. The model's layer 0 may not skip; a pipeline stage's first
            layer (``start_layer > 0``) may.
        start_layer: model layer id of the first layer (see :class:`MLATokenToKVPool`).
        shared, arenas: see :class:`MLATokenToKVPool`; ``arenas["index_k"]`` holds the live layers'
            indexer pages (may be left out when no layer is live).

    Attributes:
        index_k_with_scale_buffer: list of ``layer_num`` uint8 tensors ``(num_pages, page_bytes)``,
            ``(0, page_bytes)`` on skip layers.
        live_layers: positions (0-based; model layer ``start_layer + i``) of the layers with an indexer buffer.

    Raises:
        ValueError: bad sizes, a mask of the wrong length, or the model's layer 0 marked skip.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str | torch.device = "auto",
        kv_cache_dtype: Any = "fp8",
        index_head_dim: int = 128,
        index_buf_size: int | None = None,
        skip_topk_layers: Sequence[bool] | None = None,
        *,
        shared: bool = False,
        start_layer: int = 0,
        host_arena: HostArena | None = None,
        arenas: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        if isinstance(index_head_dim, bool) or not isinstance(index_head_dim, int) or index_head_dim <= 0 or index_head_dim % 128:
            raise ValueError(f"index_head_dim must be a positive multiple of 128, got {index_head_dim!r}")
        mask = tuple(bool(x) for x in skip_topk_layers) if skip_topk_layers is not None else (False,) * layer_num
        if len(mask) != layer_num:
            raise ValueError(f"skip_topk_layers has {len(mask)} entries but layer_num is {layer_num}")
        if mask and mask[0] and start_layer == 0:
            raise ValueError("skip_topk_layers marks layer 0 as skip, but layer 0 has no earlier top-k to reuse")
        index_buf_size = size if index_buf_size is None else index_buf_size
        if isinstance(index_buf_size, bool) or not isinstance(index_buf_size, int) or index_buf_size <= 0:
            raise ValueError(f"index_buf_size must be a positive integer, got {index_buf_size!r}")
        super().__init__(size, page_size, kv_lora_rank, qk_rope_head_dim, layer_num, device, kv_cache_dtype, shared=shared,
                         start_layer=start_layer, host_arena=host_arena, arenas=arenas)

        self.index_head_dim = index_head_dim
        self.index_buf_size = index_buf_size
        self.skip_topk_layers = mask
        self.live_layers: tuple[int, ...] = tuple(i for i, s in enumerate(mask) if not s)
        self._live_pos = {layer: i for i, layer in enumerate(self.live_layers)}
        self.index_token_bytes = index_token_bytes(index_head_dim)
        self.index_page_bytes = page_size * self.index_token_bytes
        self.index_scale_bytes = self.index_token_bytes - index_head_dim  # per token: 4 per 128 keys
        self.num_pages = (index_buf_size + page_size + 1) // page_size
        self.index_slots = self.num_pages * page_size

        n_live = len(self.live_layers)
        self._idx_arena = self._arena("index_k", n_live * self.num_pages * self.index_page_bytes, shared, arenas)
        pages = self._idx_arena.view(n_live, self.num_pages, self.index_page_bytes)
        # Word views of the page rows: keys (live, pages, page_size, key_words) and
        # scales (live, pages, page_size, scale_words); both address a token by (page, offset).
        self._key_word = word_dtype(self.index_page_bytes, index_head_dim)
        kw = index_head_dim // self._key_word.itemsize
        self._page_words = pages.view(self._key_word)
        self._keys = self._page_words[:, :, : page_size * kw].unflatten(2, (page_size, kw))
        sw_per_page = self.index_page_bytes // 4
        scale_start = page_size * index_head_dim // 4
        sw = self.index_scale_bytes // 4
        self._scales = pages.view(torch.int32)[:, :, scale_start: scale_start + page_size * sw].unflatten(2, (page_size, sw))
        assert scale_start + page_size * sw == sw_per_page

        empty = torch.empty((0, self.index_page_bytes), dtype=torch.uint8, device=self.device)
        self.index_k_with_scale_buffer: list[torch.Tensor] = [
            empty if s else pages[self._live_pos[i]] for i, s in enumerate(mask)
        ]

    def arena_nbytes(self) -> dict[str, int]:
        """Bytes of the ``latent`` and ``index_k`` arenas (what ``arenas=`` must hold)."""
        return {"latent": int(self._lat_arena.nbytes), "index_k": int(self._idx_arena.nbytes)}

    def arena(self, component: str) -> torch.Tensor:
        """The ``(nbytes,)`` uint8 arena of ``latent`` or ``index_k``."""
        return {"latent": self._lat_arena, "index_k": self._idx_arena}[component]

    # ----- sizes and infos ----------------------------------------------------------------------
    def get_kv_size_bytes(self) -> int:
        """Bytes really allocated: latent buffers plus live-layer indexer buffers (skip layers: 0)."""
        return int(self._lat_arena.nbytes) + int(self._idx_arena.nbytes)

    def get_index_size_bytes(self) -> int:
        """Bytes of the indexer buffers alone."""
        return int(self._idx_arena.nbytes)

    def get_state_buf_infos(self) -> BufInfos:
        """Indexer buffer infos ``(data_ptrs, data_lens, item_lens)``, one entry per layer.

        ``item_len`` is one page row (8448 bytes). Skip layers report ``(0, 0, 0)`` so layer
        positions agree across PD peers; use :meth:`get_live_state_buf_infos` for a transfer engine.
        """
        ptrs, lens, items = [], [], []
        for i, buf in enumerate(self.index_k_with_scale_buffer):
            live = not self.skip_topk_layers[i]
            ptrs.append(buf.data_ptr() if live else 0)
            lens.append(int(buf.nbytes) if live else 0)
            items.append(self.index_page_bytes if live else 0)
        return ptrs, lens, items

    def get_live_state_buf_infos(self) -> list[BufferRange]:
        """Indexer ranges of live layers only, each with its layer id (no zero-length entry)."""
        return live_ranges("index_k", self.get_state_buf_infos())

    def get_live_contiguous_buf_infos(self) -> list[BufferRange]:
        """Latent ranges with their layer ids (every layer has one)."""
        return live_ranges("latent", self.get_contiguous_buf_infos())

    # ----- indexer keys and scales --------------------------------------------------------------
    def _check_live_layer(self, layer_id: Any) -> int:
        pos = check_layer(layer_id, self.layer_num, self.start_layer)
        if self.skip_topk_layers[pos]:
            raise ValueError(f"layer {layer_id} skips top-k and has no indexer buffer")
        return pos

    def _index_slots(self, loc: Any, what: str = "slots") -> torch.Tensor:
        slots = self._slots(loc, what)
        if slots.numel() and int(slots.max()) >= self.index_slots:
            raise ValueError(f"{what} contains slot {int(slots.max())} outside the indexer buffer [0, {self.index_slots})")
        return slots

    def _check_keys_scales(self, index_k: Any, scale: Any, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        hd, sw = self.index_head_dim, self.index_scale_bytes // 4
        if not isinstance(index_k, torch.Tensor) or not isinstance(scale, torch.Tensor):
            raise TypeError("index_k and scale must be torch.Tensors")
        if index_k.dtype not in (torch.uint8, torch.float8_e4m3fn):
            raise TypeError(f"index_k must be uint8 or float8_e4m3fn, got {index_k.dtype}")
        if tuple(index_k.shape) != (n, hd):
            raise ValueError(f"index_k must have shape ({n}, {hd}), got {tuple(index_k.shape)}")
        if scale.dtype != torch.float32:
            raise TypeError(f"scale must be float32, got {scale.dtype}")
        if tuple(scale.shape) not in ((n,), (n, sw)) or (scale.dim() == 1 and sw != 1):
            raise ValueError(f"scale must have shape ({n},) or ({n}, {sw}), got {tuple(scale.shape)}")
        keys = as_words(index_k, self._key_word).reshape(n, hd // self._key_word.itemsize)
        scales = scale.contiguous().view(torch.int32).reshape(n, sw)
        return keys.to(self.device), scales.to(self.device)

    def set_index_k_scale_buffer(self, layer_id: int, loc: Any, index_k: torch.Tensor, scale: torch.Tensor) -> None:
        """Write FP8 indexer keys and FP32 scales of slots ``loc`` on one live layer.

        Args:
            layer_id: model layer id of a live (non-skip) layer.
            loc: ``(n,)`` int slots, no duplicates.
            index_k: ``(n, index_head_dim)`` uint8 or float8_e4m3fn keys.
            scale: ``(n,)`` (or ``(n, index_head_dim // 128)``) float32 scales.

        Raises:
            TypeError/ValueError: skip layer, bad slots, dtype or shape; the pool is unchanged.
        """
        self.set_index_k_scale_layers([layer_id], loc, [index_k], [scale])

    def set_index_k_scale_layers(self, layer_ids: Sequence[int], loc: Any, index_k: Sequence[torch.Tensor],
                                 scale: Sequence[torch.Tensor]) -> None:
        """:meth:`set_index_k_scale_buffer` of ``index_k[i]``, ``scale[i]`` on live layer
        ``layer_ids[i]``, all with the same slots ``loc``: the slots are checked (and found to be
        whole pages or not) once for every layer, and everything is checked before the first key is
        written (a WriteKV commit).

        Raises:
            TypeError/ValueError: as :meth:`set_index_k_scale_buffer`, or unequal lengths; the pool is unchanged.
        """
        if not len(layer_ids) == len(index_k) == len(scale):
            raise ValueError(f"{len(layer_ids)} layers but {len(index_k)} key and {len(scale)} scale tensors")
        positions = [self._live_pos[self._check_live_layer(x)] for x in layer_ids]
        slots = self._index_slots(loc)
        check_unique(slots, "slots")
        n = slots.numel()
        todo = [(pos, *self._check_keys_scales(k, sc, n)) for pos, k, sc in zip(positions, index_k, scale)]
        if n == 0 or not todo:
            return
        pages = whole_pages(slots, self.page_size, self._keys.shape[1])
        if pages is None:  # scattered tokens: each at (page, offset)
            page, off = slots // self.page_size, slots % self.page_size
            for pos, keys, scales in todo:
                self._keys[pos].index_put_((page, off), keys)
                self._scales[pos].index_put_((page, off), scales)
            return
        k = pages.numel()  # whole pages in order (every request's): a block copy a page, not a row a token
        for pos, keys, scales in todo:
            self._keys[pos].index_copy_(0, pages, keys.view(k, self.page_size, -1))
            self._scales[pos].index_copy_(0, pages, scales.view(k, self.page_size, -1))

    def get_index_k_scale_layers(self, layer_ids: Sequence[int], loc: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`get_index_k_scale` of each live layer of ``layer_ids``, all with the same slots
        ``loc`` (checked, and found to be whole pages or not, once), gathered into one host block of
        the pool's host arena (faulted in already) on a CPU pool.

        Returns:
            ``[(index_k (n, index_head_dim) uint8, scale (n,) or (n, k) float32)]`` in the order of
            ``layer_ids``, views of that block.

        Raises:
            TypeError/ValueError: a skip layer, bad slots.
        """
        positions = [self._live_pos[self._check_live_layer(x)] for x in layer_ids]
        slots = self._index_slots(loc)
        pages = whole_pages(slots, self.page_size, self._keys.shape[1])
        if pages is None or self.device.type != "cpu" or not positions:
            return [self.get_index_k_scale(x, slots) for x in layer_ids]
        n, hd, sb = slots.numel(), self.index_head_dim, self.index_scale_bytes
        block = self.host_block(len(positions) * n * (hd + sb))
        out = []
        for i, pos in enumerate(positions):
            at = i * n * (hd + sb)
            keys = block[at:at + n * hd]
            scales = block[at + n * hd:at + n * (hd + sb)]
            torch.index_select(self._keys[pos], 0, pages, out=keys.view(self._keys.dtype).view(pages.numel(), self.page_size, -1))
            torch.index_select(self._scales[pos], 0, pages, out=scales.view(torch.int32).view(pages.numel(), self.page_size, -1))
            s = scales.view(torch.float32)
            out.append((keys.view(n, hd), s if sb == 4 else s.view(n, sb // 4)))
        return out

    def get_index_k_scale(self, layer_id: int, loc: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer data of slots ``loc`` on one live layer.

        Returns:
            ``(index_k (n, index_head_dim) uint8, scale (n,) float32)`` (scale ``(n, k)`` when
            ``index_head_dim = 128 * k`` with k > 1).
        """
        local = self._check_live_layer(layer_id)
        slots = self._index_slots(loc)
        pos = self._live_pos[local]
        pages = whole_pages(slots, self.page_size, self._keys.shape[1])
        if pages is not None:  # whole pages in order: page blocks, 7x faster than token by token
            n = slots.numel()
            keys = self._keys[pos].index_select(0, pages).view(n, -1).view(torch.uint8)
            scales = self._scales[pos].index_select(0, pages).view(n, -1).view(torch.float32)
        else:
            page, off = slots // self.page_size, slots % self.page_size
            keys = self._keys[pos][page, off].contiguous().view(torch.uint8)
            scales = self._scales[pos][page, off].contiguous().view(torch.float32)
        return keys, (scales.reshape(-1) if scales.shape[1] == 1 else scales)

    # ----- moves --------------------------------------------------------------------------------
    def move_kv_cache(self, tgt_loc: Any, src_loc: Any) -> None:
        """Copy latent and indexer data of ``src_loc`` onto ``tgt_loc`` token by token.

        Indexer keys and scales move by (page, offset): the other tokens of a target page stay as
        they were. All sources are read before any target is written. Skip layers are not touched.
        Empty moves are a no-op.

        Raises:
            TypeError/ValueError: bad slots, unequal lengths or duplicate targets; pool unchanged.
        """
        tgt, src = self._check_move(tgt_loc, src_loc)
        if tgt.numel() == 0:
            return
        for what, t in (("tgt_loc", tgt), ("src_loc", src)):
            if int(t.max()) >= self.index_slots:
                raise ValueError(f"{what} contains slot {int(t.max())} outside the indexer buffer")
        self._move_latent(tgt, src)
        if self.live_layers:
            sp, so = src // self.page_size, src % self.page_size
            tp, to = tgt // self.page_size, tgt % self.page_size
            keys = self._keys[:, sp, so]  # advanced indexing copies: sources read first
            scales = self._scales[:, sp, so]
            self._keys[:, tp, to] = keys
            self._scales[:, tp, to] = scales

    # ----- host copies --------------------------------------------------------------------------
    def cpu_copy_nbytes(self, indices: Any) -> int:
        """Host bytes :meth:`get_cpu_copy` of ``indices`` takes: latent rows plus live-layer page rows."""
        slots = self._index_slots(indices, "indices")
        pages, _ = first_appearance_pages(slots, self.page_size)
        return self.latent_copy_nbytes(slots.numel()) + len(self.live_layers) * pages.numel() * self.index_page_bytes

    def _copy_parts(self, slots: torch.Tensor, pages: torch.Tensor | None = None) -> list[Part]:
        """Latent rows of ``slots``, then the live layers' page rows of ``pages`` (those the slots touch)."""
        parts = super()._copy_parts(slots)
        if pages is None:
            pages, _ = first_appearance_pages(slots, self.page_size)
        if self.live_layers and pages.numel():
            parts.append((self._page_words, pages.to(self.device)))
        return parts

    def get_cpu_copy(self, indices: Any, out: torch.Tensor | None = None) -> dict[str, Any]:
        """Copy slots ``indices`` (latent and live indexer data) to host memory.

        Called as SGLang calls it (no ``out``), the copy lives in :attr:`host_arena`: one block holds
        every chunk, and it is freed when the caller has dropped all of them (when the arena has no
        room the copy is a fresh host buffer instead; same result, slower). The call itself is one
        gather per layer and component straight into that block (on CUDA: one gather per component on
        the device into a staging buffer, then one DMA on a side stream, waited for with an event).

        Args:
            indices: ``(n,)`` int slots.
            out: optional flat uint8 host buffer of at least :meth:`cpu_copy_nbytes` bytes; the
                returned chunks are then views into it (latent first, then indexer pages).

        Returns:
            ``{"kv", "index_k", "src_loc"}``:

            * ``kv[layer]``: chunks ``(c, 1, kv_cache_dim)`` ``store_dtype``, ``c <= 8192`` slots;
            * ``index_k[layer]``: chunks ``(p, 8448)`` uint8 of whole page rows, ``p <= 128``, the
              pages the slots touch in order of first appearance; ``[]`` on skip layers;
            * ``src_loc``: ``(n,)`` int64 source slots (where in those pages each token lies).

            On CUDA the chunks are in page-locked memory and complete when this returns.
        """
        slots = self._index_slots(indices, "indices")
        pages, _ = first_appearance_pages(slots, self.page_size)
        lat_bytes = self.latent_copy_nbytes(slots.numel())
        idx_bytes = len(self.live_layers) * pages.numel() * self.index_page_bytes
        _check_out(out, lat_bytes + idx_bytes, max(self._lat_word.itemsize, self._key_word.itemsize))
        flat = self._host_flat(lat_bytes + idx_bytes, out)
        self._copier.gather_to_host(self._copy_parts(slots, pages), flat)
        index_k: list[list[torch.Tensor]] = [[] for _ in range(self.layer_num)]
        p = pages.numel()
        if self.live_layers and p:
            rows = flat[lat_bytes:lat_bytes + idx_bytes].view(len(self.live_layers), p, self.index_page_bytes)
            for layer in self.live_layers:
                r = rows[self._live_pos[layer]]
                index_k[layer] = [r[i:i + INDEX_CHUNK_PAGES] for i in range(0, p, INDEX_CHUNK_PAGES)]
        return {"kv": self._latent_chunks(flat, slots.numel()), "index_k": index_k, "src_loc": slots.to("cpu", copy=True)}

    def check_cpu_copy(self, copy: Mapping[str, Any], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Check that ``copy`` matches this pool's layout for ``n`` target slots.

        Checks layer count, skip mask (empty lists exactly on skip layers), row bytes, dtypes and
        chunk lengths. A copy without ``src_loc`` (e.g. from SGLang) is read as page-aligned:
        token ``i`` at page ``i // page_size``, offset ``i % page_size``.

        Returns:
            ``(page_idx (n,), offset (n,))``: where each token's indexer data lies in the copy's pages.

        Raises:
            ValueError/TypeError: naming the first mismatch.
        """
        if not isinstance(copy, Mapping) or "kv" not in copy or "index_k" not in copy:
            raise ValueError("copy must be a mapping with 'kv' and 'index_k' entries (a get_cpu_copy result)")
        self._check_latent_copy(copy["kv"], n)
        src = copy.get("src_loc")
        if src is not None:
            if not isinstance(src, torch.Tensor) or src.dim() != 1 or src.numel() != n:
                raise ValueError(f"copy['src_loc'] must be a (n,) int tensor with n = {n}")
            if src.dtype not in (torch.int64, torch.int32) or (n and int(src.min()) < 0):
                raise ValueError("copy['src_loc'] must hold non-negative integer slots")
            pages, page_idx = first_appearance_pages(src.to(torch.int64), self.page_size)
            n_pages, offset = pages.numel(), (src.to(torch.int64).cpu() % self.page_size)
        else:
            page_idx = torch.arange(n, dtype=torch.int64) // self.page_size
            offset = torch.arange(n, dtype=torch.int64) % self.page_size
            n_pages = -(-n // self.page_size)
        index_k = copy["index_k"]
        if not isinstance(index_k, Sequence) or len(index_k) != self.layer_num:
            raise ValueError(f"copy['index_k'] must have {self.layer_num} layers")
        expected = [min(INDEX_CHUNK_PAGES, n_pages - i) for i in range(0, n_pages, INDEX_CHUNK_PAGES)]
        for layer, chunks in enumerate(index_k):
            sizes = _chunk_rows(chunks, f"copy['index_k'][{layer}]")
            if self.skip_topk_layers[layer]:
                if sizes:
                    raise ValueError(f"copy['index_k'][{layer}] has data, but layer {layer} skips top-k here (skip masks differ)")
                continue
            if sizes != expected:
                if not sizes and n_pages:
                    raise ValueError(f"copy['index_k'][{layer}] is empty, but layer {layer} owns an indexer buffer here (skip masks differ)")
                raise ValueError(f"copy['index_k'][{layer}] chunk lengths {sizes} differ from the expected {expected} pages")
            for c in chunks:
                if c.dtype != torch.uint8 or c.dim() != 2 or c.shape[1] != self.index_page_bytes:
                    raise ValueError(
                        f"copy['index_k'][{layer}] chunks must be (pages, {self.index_page_bytes}) uint8, "
                        f"got {tuple(c.shape)} {c.dtype}"
                    )
        return page_idx, offset

    def _index_source(self, chunks: Sequence[torch.Tensor]) -> torch.Tensor:
        """A checked layer's page-row chunks as one ``(pages, page_words)`` tensor (where they lie)."""
        rows = chunks[0] if len(chunks) == 1 else torch.cat(list(chunks))
        return as_words(rows, self._key_word)

    def _split_page_words(self, words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pages, page_words)`` -> keys ``(pages, page_size, key_words)`` and scales
        ``(pages, page_size, scale_words)`` int32 views, addressed by (page index, offset)."""
        p, ps = words.shape[0], self.page_size
        kw, sw = self._keys.shape[3], self._scales.shape[3]
        keys = words[:, : ps * kw].unflatten(1, (ps, kw))
        scale_start = ps * self.index_head_dim // 4
        scales = words.view(torch.int32).view(p, -1)[:, scale_start: scale_start + ps * sw].unflatten(1, (ps, sw))
        return keys, scales

    def _whole_pages(self, slots: torch.Tensor, page_idx: torch.Tensor, offset: torch.Tensor) -> torch.Tensor | None:
        """The target pages when a load can copy whole indexer page rows: the target slots are whole
        pages in order (:func:`whole_pages`) and token ``i`` comes from copy page ``i // page_size`` at
        offset ``i % page_size`` (every ``get_cpu_copy`` of whole pages). None otherwise."""
        pages = whole_pages(slots, self.page_size, self.num_pages)
        if pages is None:
            return None
        pos = torch.arange(slots.numel())
        if not torch.equal(page_idx.cpu(), pos // self.page_size) or not torch.equal(offset.cpu(), pos % self.page_size):
            return None
        return pages

    def load_cpu_copy(self, copy: Mapping[str, Any], indices: Any) -> None:
        """Write a :meth:`get_cpu_copy` result onto slots ``indices`` (may differ from the source slots).

        Latent rows go row by row; indexer keys and scales token by token at (page, offset), so
        when the target slots cover part of a page only those tokens' bytes change (whole target
        pages filled from whole copy pages are copied as page rows: the same bytes, one scatter).
        On CUDA the copy goes up in one DMA on a side stream (when its chunks lie back to back), the
        scatters run on the device after an event, and only their own event is waited for.

        Raises:
            TypeError/ValueError: bad slots or a layout mismatch (:meth:`check_cpu_copy`), raised
                before anything is written.
        """
        slots = self._index_slots(indices, "indices")
        check_unique(slots, "indices")
        page_idx, offset = self.check_cpu_copy(copy, slots.numel())
        if slots.numel() == 0:
            return
        # Every source view is made before the first write, so nothing below can fail half-way.
        lat_sources = self._latent_sources(copy["kv"])
        idx_sources = [[self._index_source(copy["index_k"][layer])] for layer in self.live_layers]
        uploaded = self._upload(lat_sources + idx_sources)
        lat_sources, idx_words = uploaded[:self.layer_num], [g[0] for g in uploaded[self.layer_num:]]
        whole = self._whole_pages(slots, page_idx, offset) if self.live_layers else None
        jobs = self._latent_jobs(lat_sources, slots)
        if self.live_layers and whole is not None:  # every layer's scatter in one split over the copy threads
            jobs += [(self._page_words[pos], whole, words) for pos, words in enumerate(idx_words)]
        self._scatter(jobs)
        if self.live_layers:
            if whole is None:
                tp, to = slots // self.page_size, slots % self.page_size
                page_idx, offset = page_idx.to(self.device), offset.to(self.device)
                for pos, words in enumerate(idx_words):
                    src_keys, src_scales = self._split_page_words(words)
                    self._keys[pos].index_put_((tp, to), src_keys[page_idx, offset])
                    self._scales[pos].index_put_((tp, to), src_scales[page_idx, offset])
        self._copier.finish()
