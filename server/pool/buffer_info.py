"""Buffer infos: the (pointer, length, item length) ranges transfer engines register and move.

``get_state_buf_infos`` (indexer) and ``get_contiguous_buf_infos`` (latent) return SGLang's triple
of lists, one entry per layer, so PD peers agree on layer positions. A skip-topk layer's indexer
entry is ``(0, 0, 0)``: present, zero bytes. Transfer engines must never see such an entry, so
:func:`live_ranges` gives only the ranges with bytes, each with its layer id.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BufferRange:
    """One layer's buffer of one component.

    Attributes:
        layer_id: model layer id.
        component: ``"latent"`` or ``"index_k"``.
        data_ptr: address of the buffer's first byte.
        data_len: bytes in the buffer.
        item_len: bytes of one page (``row_bytes * page_size`` for latent, 8448 for the indexer).
    """

    layer_id: int
    component: str
    data_ptr: int
    data_len: int
    item_len: int

    def page_range(self, page: int) -> tuple[int, int]:
        """``(address, nbytes)`` of page ``page`` in this buffer. Raises ValueError outside it."""
        if self.item_len <= 0:
            raise ValueError(f"layer {self.layer_id} {self.component} has no buffer")
        if not 0 <= page < self.data_len // self.item_len:
            raise ValueError(f"page {page} outside layer {self.layer_id} {self.component} buffer")
        return self.data_ptr + page * self.item_len, self.item_len


BufInfos = tuple[list[int], list[int], list[int]]


def live_ranges(component: str, infos: BufInfos) -> list[BufferRange]:
    """The entries of ``infos`` with bytes (``data_len > 0`` and ``item_len > 0``), with layer ids."""
    ptrs, lens, items = infos
    if not len(ptrs) == len(lens) == len(items):
        raise ValueError("buffer infos lists differ in length")
    return [
        BufferRange(i, component, p, n, it)
        for i, (p, n, it) in enumerate(zip(ptrs, lens, items))
        if n > 0 and it > 0
    ]
