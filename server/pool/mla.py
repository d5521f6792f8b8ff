"""MLA latent KV pool: one latent row per token per layer, addressed by token slot.

Layout (DESIGN.md "Byte layouts", same as SGLang's ``MLATokenToKVPool`` for the same arguments):
per layer a buffer of shape ``(size + page_size, 1, kv_cache_dim)``;

* ``bf16``: dtype ``torch.bfloat16``, ``kv_cache_dim = kv_lora_rank + qk_rope_head_dim`` (576);
* ``fp8``:  dtype ``torch.uint8``, ``kv_cache_dim`` = 656 bytes = 512 fp8 latent + 4 fp32 scales +
  64 bf16 rope values (fp8 is stored as uint8 because indexed writes do not exist for fp8 dtypes).

Slot 0 (page 0) is padding for dummy writes; the allocator never hands it out, but the pool
accepts it so padded batches can write there.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvtier.server.hostmem import HostArena
from kvtier.server.model_config import KV_CACHE_DTYPES, latent_row_bytes
from kvtier.memfd import SharedMemory
from kvtier.server.pool.arena import alloc_arena, as_words, check_arena, host_buffer, resolve_device, shared_arena, word_dtype
from kvtier.server.pool.buffer_info import BufInfos
from kvtier.server.pool.device_copy import (MAX_COPY_RUNS, CopyEngine, Job, Part, copy_pairs, run_pairs, scatter_jobs,
                                            scatter_layers, scatter_rows, slot_runs)
from kvtier.server.pool.validation import as_slots, check_layer, check_rows, check_unique

KV_CHUNK_SLOTS = 8192  # get_cpu_copy: latent chunks hold at most this many slots
MAX_OWN_HOST_ARENA_BYTES = 1 << 30  # a pool's own host arena: twice its buffers' bytes, at most this
_STORE_DTYPE = {"bf16": torch.bfloat16, "fp8": torch.uint8}


def whole_pages(slots: torch.Tensor, page_size: int, num_pages: int) -> torch.Tensor | None:
    """The pages ``slots`` cover when they are whole pages in order (slots ``i * page_size ..
    (i + 1) * page_size - 1`` are page ``p_i``'s 64 tokens in order, ``p_i < num_pages``), else None.

    Such copies move page rows (42 KB of latent a layer) instead of token rows: the same bytes in
    64x fewer, larger pieces. Every request on allocator pages is one.
    """
    n = slots.numel()
    if n == 0 or n % page_size:
        return None
    tgt = slots.view(-1, page_size)
    first = tgt[:, 0]
    if bool((first % page_size).any()) or bool((tgt != first[:, None] + torch.arange(page_size, device=slots.device)).any()):
        return None
    pages = first // page_size
    return pages if int(pages.max()) < num_pages else None


def parse_kv_cache_dtype(kv_cache_dtype: Any) -> str:
    """Normalise ``"bf16"``/``"fp8"`` (or ``torch.bfloat16``/``torch.float8_e4m3fn``) to the string form."""
    if isinstance(kv_cache_dtype, torch.dtype):
        if kv_cache_dtype == torch.bfloat16:
            return "bf16"
        if kv_cache_dtype in (torch.float8_e4m3fn, torch.uint8):
            return "fp8"
    elif isinstance(kv_cache_dtype, str) and kv_cache_dtype.lower() in KV_CACHE_DTYPES:
        return kv_cache_dtype.lower()
    raise ValueError(f"kv_cache_dtype must be 'bf16' or 'fp8', got {kv_cache_dtype!r}")


class MLATokenToKVPool:
    """Device pool of MLA latent KV rows.

    Args:
        size: token capacity (slots ``1 .. size + page_size - 1`` are usable; slot 0 is padding).
        page_size: tokens per page.
        kv_lora_rank, qk_rope_head_dim: latent geometry (512, 64 for DeepSeek/GLM).
        layer_num: number of layers.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        kv_cache_dtype: ``"bf16"`` or ``"fp8"``.
        shared: CPU only: put the buffers in anonymous shared memory (:attr:`shared_memory`) so a
            local worker can map them (the daemon's pools; see README "Local attach").
        arenas: build the pool over existing memory instead of allocating: ``{"latent": t}`` (and
            ``"index_k"`` for a DSA pool), each a contiguous 1-D uint8 tensor of exactly the bytes the
            component needs (:meth:`arena_nbytes`) on ``device`` -- an attached worker's mapping of the
            daemon's arenas, so both sides address the same bytes through the same views.
        start_layer: model layer id of the first layer (a pipeline-parallel stage's, as SGLang's
            ``start_layer``); methods taking ``layer_id`` take model layer ids, buffer lists are indexed
            by position (``layer_id - start_layer``).
        host_arena: where ``get_cpu_copy`` results without ``out=`` live (a daemon passes its one
            arena). None: the pool makes its own on first use, twice its buffers' bytes and at most
            1 GiB, faulted in (page-locked on CUDA) once.

    Attributes:
        kv_buffer: list of ``layer_num`` tensors ``(size + page_size, 1, kv_cache_dim)``, position
            ``i`` holding model layer ``start_layer + i``.
        start_layer, end_layer: the model layers ``[start_layer, end_layer)`` the pool holds.
        shared_memory: component -> :class:`~kvtier.memfd.SharedMemory` behind its arena when the pool
            allocated it ``shared`` (empty otherwise).
        store_dtype: ``torch.bfloat16`` or ``torch.uint8``.
        row_bytes: bytes of one latent row (1152 or 656).

    Raises:
        ValueError: non-positive sizes, an unknown dtype or device.
        TypeError/ValueError: an ``arenas`` tensor of the wrong size, dtype, shape, device or alignment.
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
        *,
        shared: bool = False,
        start_layer: int = 0,
        host_arena: HostArena | None = None,
        arenas: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        for name, v in (("size", size), ("page_size", page_size), ("kv_lora_rank", kv_lora_rank),
                        ("qk_rope_head_dim", qk_rope_head_dim), ("layer_num", layer_num)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if isinstance(start_layer, bool) or not isinstance(start_layer, int) or start_layer < 0:
            raise ValueError(f"start_layer must be a non-negative integer, got {start_layer!r}")
        self.start_layer = start_layer
        self.end_layer = start_layer + layer_num
        self.size = size
        self.page_size = page_size
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.layer_num = layer_num
        self.device = resolve_device(device)
        self.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype)
        self.store_dtype = _STORE_DTYPE[self.kv_cache_dtype]
        self.row_bytes = latent_row_bytes(kv_lora_rank, qk_rope_head_dim, self.kv_cache_dtype)
        self.kv_cache_dim = self.row_bytes // self.store_dtype.itemsize
        self.num_slots = size + page_size  # rows per layer, padding page included

        self._lat_word = word_dtype(self.row_bytes)
        if arenas is not None and not isinstance(arenas, Mapping):
            raise TypeError(f"arenas must be a mapping of component -> tensor, got {type(arenas).__name__}")
        if arenas is not None and set(arenas) - {"latent", "index_k"}:
            raise ValueError(f"arenas has unknown components {sorted(set(arenas) - {'latent', 'index_k'})}; "
                             f"known: 'latent', 'index_k'")
        self.shared_memory: dict[str, SharedMemory] = {}
        self._lat_arena = self._arena("latent", layer_num * self.num_slots * self.row_bytes, shared, arenas)
        # (layers, slots, words): the view every copy goes through.
        self._lat_words = self._lat_arena.view(self._lat_word).view(layer_num, self.num_slots, -1)
        self.kv_buffer: list[torch.Tensor] = [
            self._lat_arena.view(layer_num, self.num_slots * self.row_bytes)[i]
            .view(self.store_dtype)
            .view(self.num_slots, 1, self.kv_cache_dim)
            for i in range(layer_num)
        ]
        # (layers, whole pages, page words): page-row view for copies of whole pages
        self._lat_full_pages = self.num_slots // page_size
        self._lat_pages = self._lat_words[:, :self._lat_full_pages * page_size].reshape(layer_num, self._lat_full_pages, -1)
        self._host_arena = host_arena
        self._host_arena_lock = threading.Lock()
        self._copier = CopyEngine(self.device)

    # ----- host memory for copies ---------------------------------------------------------------
    @property
    def host_arena(self) -> HostArena:
        """The arena ``get_cpu_copy`` results live in (made on first use when none was given)."""
        with self._host_arena_lock:
            if self._host_arena is None:
                size = min(max(2 * self.get_kv_size_bytes(), 1 << 20), MAX_OWN_HOST_ARENA_BYTES)
                self._host_arena = HostArena(size, pin=self.device.type == "cuda", name="kvtier-pool-copies")
            return self._host_arena

    def _host_flat(self, nbytes: int, out: torch.Tensor | None) -> torch.Tensor:
        """``out[:nbytes]``, else an arena block of ``nbytes`` (freed when the copy's tensors are gone),
        else -- arena exhausted -- a fresh host buffer (pinned on CUDA), counted as a fallback."""
        if out is not None:
            return out[:nbytes]
        if nbytes:
            arena = self.host_arena
            block = arena.alloc_tensor(nbytes)
            if block is not None:
                return block
            arena.count_fallback()
        return host_buffer((nbytes,), torch.uint8, self.device)

    def _copy_parts(self, slots: torch.Tensor) -> list[Part]:
        """The word views and rows a copy of ``slots`` gathers (latent only here): page rows when the
        slots are whole pages in order (same bytes, same layout), else token rows."""
        pages = whole_pages(slots, self.page_size, self._lat_full_pages)
        if pages is not None:
            return [(self._lat_pages, pages)]
        return [(self._lat_words, slots)]

    def _arena(self, component: str, nbytes: int, shared: bool, arenas: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
        """The arena of ``component``: given (checked), or allocated (in shared memory when ``shared`` on the CPU)."""
        if arenas is not None:
            if component not in arenas and nbytes == 0:
                return torch.empty(0, dtype=torch.uint8, device=self.device)
            return check_arena(arenas.get(component), nbytes, self.device, component)
        if shared and self.device.type == "cpu" and nbytes:
            t, self.shared_memory[component] = shared_arena(nbytes, f"kvtier-{component}")
            return t
        return alloc_arena(nbytes, self.device)

    def arena_nbytes(self) -> dict[str, int]:
        """Bytes of each component's arena (``latent``; ``index_k`` for a DSA pool): what ``arenas=`` must hold."""
        return {"latent": int(self._lat_arena.nbytes)}

    def arena(self, component: str) -> torch.Tensor:
        """The ``(nbytes,)`` uint8 arena of ``component`` (every per-layer buffer is a view of it)."""
        return {"latent": self._lat_arena}[component]

    # ----- sizes and infos ----------------------------------------------------------------------
    def get_kv_size_bytes(self) -> int:
        """Bytes really allocated for this pool's buffers."""
        return int(self._lat_arena.nbytes)

    def get_contiguous_buf_infos(self) -> BufInfos:
        """Latent buffer infos ``(data_ptrs, data_lens, item_lens)``, one entry per layer.

        ``item_len = row_bytes * page_size`` (one page of latent rows).
        """
        ptrs = [b.data_ptr() for b in self.kv_buffer]
        lens = [int(b.nbytes) for b in self.kv_buffer]
        items = [self.row_bytes * self.page_size] * self.layer_num
        return ptrs, lens, items

    # ----- slot checks --------------------------------------------------------------------------
    def _slots(self, loc: Any, what: str = "slots") -> torch.Tensor:
        return as_slots(loc, limit=self.num_slots, what=what, device=self.device)

    # ----- latent rows --------------------------------------------------------------------------
    def set_kv_buffer(self, layer_id: int, loc: Any, rows: torch.Tensor) -> None:
        """Write latent rows for ``loc`` on one layer.

        Args:
            layer_id: model layer id (``start_layer <= layer_id < end_layer``).
            loc: ``(n,)`` int slots, each in ``[0, size + page_size)``, no duplicates.
            rows: ``(n, kv_cache_dim)`` or ``(n, 1, kv_cache_dim)`` of ``store_dtype``, or raw
                ``(n, row_bytes)`` uint8.

        Raises:
            TypeError/ValueError: bad layer, slots, dtype or shape; the pool is unchanged.
        """
        layer_id = check_layer(layer_id, self.layer_num, self.start_layer)
        slots = self._slots(loc)
        check_unique(slots, "slots")
        data = check_rows(rows, slots.numel(), self.kv_cache_dim, self.store_dtype, self.row_bytes, "rows")
        if slots.numel() == 0:
            return
        data = as_words(data, self._lat_word).to(self.device, non_blocking=True)
        scatter_rows(self._lat_words[layer_id], slots, data)

    def set_kv_buffer_layers(self, layer_ids: Sequence[int], loc: Any, rows: Sequence[torch.Tensor]) -> None:
        """:meth:`set_kv_buffer` of ``rows[i]`` on ``layer_ids[i]``, all with the same slots ``loc``:
        the slots are checked, and their runs found, once for every layer (a WriteKV commit).
        Everything is checked before the first row is written.

        Raises:
            TypeError/ValueError: as :meth:`set_kv_buffer`, or unequal lengths; the pool is unchanged.
        """
        if len(layer_ids) != len(rows):
            raise ValueError(f"{len(layer_ids)} layers but {len(rows)} row tensors")
        slots = self._slots(loc)
        check_unique(slots, "slots")
        n = slots.numel()
        todo = [(check_layer(x, self.layer_num, self.start_layer),
                 check_rows(r, n, self.kv_cache_dim, self.store_dtype, self.row_bytes, "rows")) for x, r in zip(layer_ids, rows)]
        if n == 0:
            return
        if self.device.type == "cpu":
            runs = slot_runs(slots, MAX_COPY_RUNS)
            if runs is not None:  # runs of slots (whole pages): block copies, split over the copy threads
                copy_pairs([pair for pos, data in todo for pair in run_pairs(self._lat_words[pos], runs, as_words(data, self._lat_word))])
                return
            # scattered slots: numpy's fancy assignment, the layers split over the copy threads
            scatter_layers([(self._lat_words[pos], as_words(data, self._lat_word)) for pos, data in todo], slots)
            return
        for pos, data in todo:
            words = as_words(data, self._lat_word).to(self.device, non_blocking=True)
            scatter_rows(self._lat_words[pos], slots, words)

    def latent_row_views(self, layer_ids: Sequence[int], loc: Any, max_runs: int) -> list[list[torch.Tensor]] | None:
        """The latent rows of ``loc`` on each model layer of ``layer_ids`` as uint8 views of the
        pool's own memory: for each layer, one ``(count * row_bytes,)`` view per run of consecutive
        slots, in slot order (a read without a gather; the slots are checked and their runs found
        once for every layer). None when the pool is not on the CPU or the slots make more than
        ``max_runs`` runs (gather with :meth:`get_kv_buffer_rows` then).

        The views alias the pool: they hold the bytes of the moment they are read, so the caller
        holds the pool's lock while it reads them (a write may change them at any time after).

        Raises:
            TypeError/ValueError: bad layer or slots.
        """
        positions = [check_layer(x, self.layer_num, self.start_layer) for x in layer_ids]
        slots = self._slots(loc)
        if self.device.type != "cpu":
            return None
        runs = slot_runs(slots, max_runs)
        if runs is None:
            return None
        rb = self.row_bytes
        out = []
        for pos in positions:
            base = pos * self.num_slots
            out.append([self._lat_arena[(base + first) * rb:(base + first + count) * rb] for first, count in runs])
        return out

    def get_kv_buffer_rows(self, layer_id: int, loc: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """Latent rows of ``loc`` on model layer ``layer_id``: ``(n, 1, kv_cache_dim)`` ``store_dtype`` (a copy,
        on the pool's device; with ``out``, a contiguous uint8 host buffer of ``n * row_bytes`` bytes such as a
        :meth:`host_block`, the rows are gathered straight into it and returned as its view).

        Raises:
            TypeError/ValueError: bad layer, slots or ``out``.
        """
        layer_id = check_layer(layer_id, self.layer_num, self.start_layer)
        slots = self._slots(loc)
        if out is None:
            return self.kv_buffer[layer_id].index_select(0, slots)
        n = slots.numel()
        _check_out(out, n * self.row_bytes, self._lat_word.itemsize)
        flat = out[:n * self.row_bytes]
        self._copier.gather_to_host([(self._lat_words[layer_id:layer_id + 1], slots)], flat)
        return flat.view(self.store_dtype).view(n, 1, self.kv_cache_dim)

    def host_block(self, nbytes: int) -> torch.Tensor:
        """A ``(nbytes,)`` uint8 host buffer from :attr:`host_arena` (faulted in already; freed when
        every view of it is gone), or fresh memory when the arena has no room."""
        return self._host_flat(nbytes, None)

    # ----- moves --------------------------------------------------------------------------------
    def _check_move(self, tgt_loc: Any, src_loc: Any) -> tuple[torch.Tensor, torch.Tensor]:
        tgt = self._slots(tgt_loc, "tgt_loc")
        src = self._slots(src_loc, "src_loc")
        if tgt.numel() != src.numel():
            raise ValueError(f"tgt_loc has {tgt.numel()} slots but src_loc has {src.numel()}")
        check_unique(tgt, "tgt_loc")
        return tgt, src

    def move_kv_cache(self, tgt_loc: Any, src_loc: Any) -> None:
        """Copy the KV of slots ``src_loc`` onto slots ``tgt_loc``, every layer, in place.

        All sources are read before any target is written, so overlapping sets are safe.
        Raises TypeError/ValueError (pool unchanged) on bad slots, unequal lengths or duplicate targets.
        """
        tgt, src = self._check_move(tgt_loc, src_loc)
        if tgt.numel():
            self._move_latent(tgt, src)

    def _move_latent(self, tgt: torch.Tensor, src: torch.Tensor) -> None:
        rows = self._lat_words.index_select(1, src)
        self._lat_words.index_copy_(1, tgt, rows)

    # ----- host copies --------------------------------------------------------------------------
    def latent_copy_nbytes(self, n_slots: int) -> int:
        """Host bytes the latent part of a copy of ``n_slots`` slots takes (``layers * n * row_bytes``)."""
        return self.layer_num * n_slots * self.row_bytes

    def _latent_chunks(self, flat: torch.Tensor, n: int) -> list[list[torch.Tensor]]:
        """The latent part of a copied ``flat`` buffer as ``kv[layer][chunk]`` views."""
        rows = flat[:self.latent_copy_nbytes(n)].view(self.layer_num, n, self.row_bytes).view(self.store_dtype)
        rows = rows.view(self.layer_num, n, 1, self.kv_cache_dim)
        return [[rows[layer, i:i + KV_CHUNK_SLOTS] for i in range(0, n, KV_CHUNK_SLOTS)] for layer in range(self.layer_num)]

    def get_cpu_copy(self, indices: Any, out: torch.Tensor | None = None) -> dict[str, Any]:
        """Copy slots ``indices`` to host memory.

        Args:
            indices: ``(n,)`` int slots.
            out: optional flat uint8 host buffer of at least ``latent_copy_nbytes(n)`` bytes to copy
                into; without it the copy lives in :attr:`host_arena` (see :meth:`_host_flat`).

        Returns:
            ``{"kv": kv, "src_loc": src}``: ``kv[layer]`` is a list of chunks ``(c, 1, kv_cache_dim)``
            ``store_dtype`` with ``c <= 8192``; ``src`` the ``(n,)`` int64 source slots.
        """
        slots = self._slots(indices, "indices")
        nbytes = self.latent_copy_nbytes(slots.numel())
        _check_out(out, nbytes, self._lat_word.itemsize)
        flat = self._host_flat(nbytes, out)
        self._copier.gather_to_host(self._copy_parts(slots), flat)
        return {"kv": self._latent_chunks(flat, slots.numel()), "src_loc": slots.to("cpu", copy=True)}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _check_latent_copy(self, kv: Any, n: int) -> None:
        if not isinstance(kv, Sequence) or len(kv) != self.layer_num:
            got = len(kv) if isinstance(kv, Sequence) else type(kv).__name__
            raise ValueError(f"copy['kv'] must have {self.layer_num} layers, got {got}")
        for layer, chunks in enumerate(kv):
            sizes = _chunk_rows(chunks, f"copy['kv'][{layer}]")
            if sum(sizes) != n:
                raise ValueError(f"copy['kv'][{layer}] holds {sum(sizes)} rows but {n} target slots were given")
            expected = [min(KV_CHUNK_SLOTS, n - i) for i in range(0, n, KV_CHUNK_SLOTS)]
            if sizes != expected:
                raise ValueError(f"copy['kv'][{layer}] chunk lengths {sizes} differ from the pool's {expected}")
            for c in chunks:
                check_rows(c, c.shape[0], self.kv_cache_dim, self.store_dtype, self.row_bytes, f"copy['kv'][{layer}]")

    def _latent_sources(self, kv: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Each checked chunk as a ``(rows, words)`` view, where it lies (nothing written yet)."""
        return [[as_words(c.reshape(c.shape[0], -1), self._lat_word) for c in chunks] for chunks in kv]

    def _latent_jobs(self, sources: list[list[torch.Tensor]], slots: torch.Tensor) -> list[Job]:
        """The ``(dst, index, src)`` scatters of checked source chunks (already on the pool's device)
        onto ``slots``: page rows when the slots are whole pages in order (chunks hold whole pages),
        else token rows."""
        ps = self.page_size
        pages = whole_pages(slots, ps, self._lat_full_pages)
        jobs = []
        for layer, chunks in enumerate(sources):
            start = 0
            for data in chunks:
                rows = data.shape[0]
                if pages is not None:
                    jobs.append((self._lat_pages[layer], pages[start // ps:(start + rows) // ps], data.reshape(rows // ps, -1)))
                else:
                    jobs.append((self._lat_words[layer], slots[start:start + rows], data))
                start += rows
        return jobs

    def _scatter(self, jobs: list[Job]) -> None:
        """Run scatters (:meth:`_latent_jobs`): on the CPU split over the copy threads
        (:func:`scatter_jobs`), on a device one ``index_copy_`` each."""
        if self.device.type == "cpu":
            scatter_jobs(jobs)
            return
        for dst, index, src in jobs:
            scatter_rows(dst, index, src)

    def _upload(self, sources: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """``sources`` (nested lists of host tensors) on the pool's device, nesting kept (one DMA on
        CUDA when they lie back to back; the tensors themselves on the CPU)."""
        flat = [t for group in sources for t in group]
        moved = iter(self._copier.to_device(flat))
        return [[next(moved) for _ in group] for group in sources]

    def load_cpu_copy(self, copy: Mapping[str, Any], indices: Any) -> None:
        """Write a :meth:`get_cpu_copy` result onto slots ``indices`` (may differ from the source slots).

        Raises:
            TypeError/ValueError: layout mismatch (layers, chunk lengths, row bytes) or bad slots;
                raised before anything is written.
        """
        slots = self._slots(indices, "indices")
        check_unique(slots, "indices")
        if not isinstance(copy, Mapping) or "kv" not in copy:
            raise ValueError("copy must be a mapping with a 'kv' entry (a get_cpu_copy result)")
        self._check_latent_copy(copy["kv"], slots.numel())
        self._scatter(self._latent_jobs(self._upload(self._latent_sources(copy["kv"])), slots))
        self._copier.finish()


def _check_out(out: torch.Tensor | None, nbytes: int, align: int = 1) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
        raise TypeError("out must be a contiguous 1-D uint8 tensor")
    if out.storage_offset() % align:
        raise ValueError(f"out must start {align}-byte aligned in its storage, got offset {out.storage_offset()}")
    if out.device.type != "cpu":
        raise ValueError("out must be in host memory")
    if out.numel() < nbytes:
        raise ValueError(f"out holds {out.numel()} bytes but the copy needs {nbytes}")


def _chunk_rows(chunks: Any, what: str) -> list[int]:
    if not isinstance(chunks, Sequence) or isinstance(chunks, torch.Tensor):
        raise ValueError(f"{what} must be a list of tensors")
    sizes = []
    for c in chunks:
        if not isinstance(c, torch.Tensor) or c.dim() < 1:
            raise TypeError(f"{what} must hold tensors")
        sizes.append(int(c.shape[0]))
    return sizes
