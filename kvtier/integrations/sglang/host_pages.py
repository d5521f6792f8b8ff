"""SGLang's host pools as kvtier units: the stage they describe and their pages' bytes.

SGLang 0.5.23's DSA host pools (``sglang.srt.mem_cache.pool_host``), page-first layouts:

* ``MLATokenToKVPoolHost`` (the KV pool): ``get_page_buffer_meta(indices)`` gives one
  ``(ptr, layers * page_size * kv_cache_dim * itemsize)`` range a page. ``page_first_direct`` holds a
  page as ``(layers, page_size, kv_cache_dim)`` -- exactly a unit's KV part (the record's latent
  payload); ``page_first`` holds it token-major ``(page_size, layers, kv_cache_dim)``, transposed here
  on the way in and out. fp8 DSA rows are 656 uint8 (512 fp8 + 4 fp32 scales + 64 bf16 rope), bf16
  rows 576 bf16. Other layouts (``layer_first``, ``page_first_kv_split``, ``page_unified``) and
  decode-context-parallel shards are refused at registration, clearly.
* ``DSAIndexerPoolHost`` (``PoolName.INDEXER``): one ``(ptr, live layers * 8448)`` range a page, the
  live (indexer-owning) layers of the stage in order -- exactly a unit's index part. Packed MTP draft
  layers (in either pool) are refused.

Pages are reached through ``get_page_buffer_meta`` (raw addresses in this process), so any pool with
that contract and a ``layout`` attribute works.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtier.client.storage import UnitSpaceSpec

PAGE_FIRST = ("page_first", "page_first_direct")
INDEX_QUANT_BLOCK = 128


def _fp8_row(kv_lora_rank: int, rope: int) -> int:
    return kv_lora_rank + kv_lora_rank // INDEX_QUANT_BLOCK * 4 + 2 * rope


def describe_stage(kv_host: Any, index_host: Any | None, *, model_name: str, scope: str) -> UnitSpaceSpec:
    """The unit space of SGLang's host pools (the KV pool and, for DSA, its indexer pool).

    Raises:
        ValueError: a layout, dtype or geometry a unit cannot hold, naming it and what to use instead.
    """
    layout = getattr(kv_host, "layout", None)
    if layout not in PAGE_FIRST:
        raise ValueError(f"kvtier stores whole pages: the host KV pool's layout {layout!r} is not supported; start "
                         f"SGLang with --hicache-mem-layout page_first_direct (or page_first)")
    if getattr(kv_host, "dcp_size", 1) != 1:
        raise ValueError("kvtier does not store decode-context-parallel page shards (dcp_size > 1)")
    layers = int(kv_host.layer_num)
    start, end = int(kv_host.start_layer), int(kv_host.end_layer)
    if end - start != layers:
        raise ValueError(f"the host KV pool holds {layers} layers for model layers {start}..{end - 1}: packed draft "
                         f"(MTP) layers are not supported by kvtier's units")
    rank, rope, dim = int(kv_host.kv_lora_rank), int(kv_host.qk_rope_head_dim), int(kv_host.kv_cache_dim)
    if kv_host.dtype == torch.uint8 and dim == _fp8_row(rank, rope):
        dtype, row = "fp8", dim
    elif kv_host.dtype == torch.bfloat16 and dim == rank + rope:
        dtype, row = "bf16", 2 * dim
    else:
        raise ValueError(f"kvtier units hold fp8 DSA rows ({_fp8_row(rank, rope)} uint8) or bf16 rows ({rank + rope} "
                         f"bfloat16); the host KV pool has {dim} x {kv_host.dtype}")
    page_size = int(kv_host.page_size)
    skip = "F" * layers
    index_head_dim = INDEX_QUANT_BLOCK
    with_index = index_host is not None
    if with_index:
        dev = index_host.device_pool
        skip = "".join("S" if s else "F" for s in dev.skip_topk_layers)
        index_head_dim = int(dev.index_head_dim)
        if len(skip) != layers:
            raise ValueError(f"the indexer pool's device pool has {len(skip)} layers, the KV pool {layers}")
        if int(index_host.layer_num) != skip.count("F"):
            raise ValueError(f"the indexer host pool holds {index_host.layer_num} layers but the stage has "
                             f"{skip.count('F')} live indexer layers: packed draft (MTP) layers are not supported")
        if getattr(index_host, "layout", layout) not in PAGE_FIRST:
            raise ValueError(f"the indexer host pool's layout {index_host.layout!r} is not page-first")
        with_index = skip.count("F") > 0
    return UnitSpaceSpec(model_name, num_layers=layers, start_layer=start, kv_lora_rank=rank, qk_rope_head_dim=rope,
                         index_head_dim=index_head_dim, kv_cache_dtype=dtype, page_size=page_size, latent_row_bytes=row,
                         skip_mask=skip, with_index=with_index, scope=scope)


def _view(ptr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of this process's memory at ``ptr`` (no copy)."""
    return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr)))


class BadHostIndices(ValueError):
    """Host indices that do not name whole pages of the registered host pool (the reason is the message)."""


HOST_BUFFERS = ("kv_buffer", "index_k_with_scale_buffer")


def host_buffers(host_pool: Any) -> list[tuple[int, int]]:
    """``(data_ptr, nbytes)`` of the pool's host buffers (SGLang's ``kv_buffer`` of the MLA host pool,
    ``index_k_with_scale_buffer`` of the DSA indexer host pool): every page range must lie in one."""
    out = []
    for name in HOST_BUFFERS:
        t = getattr(host_pool, name, None)
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel():
            out.append((int(t.data_ptr()), t.numel() * t.element_size()))
    return out


class PagePart:
    """One part of a unit in one host pool: which pages, and how their bytes map onto the part.

    Args:
        host_pool: a pool with ``get_page_buffer_meta(indices) -> (ptrs, sizes)``, ``page_size``,
            ``size`` (host tokens) and its host buffer (``kv_buffer`` or ``index_k_with_scale_buffer``).
        part_nbytes: bytes of the part (each page's range must be exactly this long).
        token_major: ``(page_size, layers, row_bytes)`` when the host page holds the part's rows
            token-major (``page_first``): copies transpose to the unit's layer-major order.
    """

    def __init__(self, host_pool: Any, part_nbytes: int, token_major: tuple[int, int, int] | None = None) -> None:
        self.host_pool = host_pool
        self.page_size = int(host_pool.page_size)
        self.part_nbytes = part_nbytes
        self.token_major = token_major

    def check(self, host_indices: Any, n_pages: int) -> torch.Tensor:
        """The ``n_pages`` first token indices (int64) of ``host_indices``, checked to be whole pages.

        ``host_indices``: a 1-D CPU integer tensor of ``n_pages * page_size`` host token indices,
        page by page, each page ``p * page_size .. (p + 1) * page_size - 1`` with ``p`` inside the
        pool (``0 <= p * page_size``, ``(p + 1) * page_size <= host_pool.size``).

        Raises:
            BadHostIndices: anything else (floats, bools, 2-D, a wrong count, an offset or shuffled
                page, a page outside the pool), before any memory is touched.
        """
        t, ps = host_indices, self.page_size
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dim() != 1:
            raise BadHostIndices(f"host indices must be a 1-D CPU tensor, not {type(t).__name__} "
                                 f"{tuple(getattr(t, 'shape', ()))}")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise BadHostIndices(f"host indices must be integers, not {t.dtype}")
        if t.numel() != n_pages * ps:
            raise BadHostIndices(f"{t.numel()} host indices for {n_pages} pages of {ps} tokens")
        rows = t.to(torch.int64).reshape(n_pages, ps)
        firsts = rows[:, 0]
        if n_pages and not torch.equal(rows, firsts[:, None] + torch.arange(ps, dtype=torch.int64)):
            raise BadHostIndices("host indices are not whole pages (each page's tokens in order)")
        size = int(self.host_pool.size)
        if n_pages and (bool((firsts % ps != 0).any()) or int(firsts.min()) < 0 or int(firsts.max()) + ps > size):
            raise BadHostIndices(f"host indices name pages outside the host pool ({size} tokens, pages of {ps})")
        return firsts

    def pages(self, host_indices: Any, n_pages: int) -> list[torch.Tensor]:
        """Views of the ``n_pages`` host pages at ``host_indices`` (``n_pages * page_size`` token
        indices, page by page), each ``part_nbytes`` uint8 inside the pool's host buffer.

        Raises:
            BadHostIndices: indices :meth:`check` refuses, or a range the pool reports that does
                not lie whole inside its registered host buffers (nothing is read or written then).
        """
        self.check(host_indices, n_pages)
        if n_pages == 0:
            return []
        ptrs, sizes = self.host_pool.get_page_buffer_meta(host_indices.to(torch.int64))
        if len(ptrs) != n_pages or any(int(s) != self.part_nbytes for s in sizes):
            raise BadHostIndices(f"the host pool's page ranges ({len(ptrs)}) do not match {n_pages} pages of "
                                 f"{self.part_nbytes} bytes")
        buffers = host_buffers(self.host_pool)
        for p in ptrs:
            p = int(p)
            if not any(base <= p and p + self.part_nbytes <= base + n for base, n in buffers):
                raise BadHostIndices("a page range lies outside the host pool's registered buffers")
        return [_view(int(p), self.part_nbytes) for p in ptrs]

    def gather(self, pages: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """Copy the pages' part bytes into ``out`` (``len(pages) * part_nbytes`` uint8, unit order)."""
        for i, page in enumerate(pages):
            dst = out[i * self.part_nbytes:(i + 1) * self.part_nbytes]
            if self.token_major is None:
                dst.copy_(page)
            else:
                ps, layers, row = self.token_major
                dst.view(layers, ps, row).copy_(page.view(ps, layers, row).transpose(0, 1))

    def scatter(self, rows: torch.Tensor, pages: Sequence[torch.Tensor], which: Sequence[int]) -> None:
        """Copy ``rows[i]`` (unit ``i``'s part bytes: ``rows`` is ``(n, part_nbytes)`` uint8, rows
        contiguous) onto ``pages[i]`` for each ``i`` in ``which``."""
        for i in which:
            if self.token_major is None:
                pages[i].copy_(rows[i])
            else:
                ps, layers, row = self.token_major
                pages[i].view(ps, layers, row).copy_(rows[i].view(layers, ps, row).transpose(0, 1))
