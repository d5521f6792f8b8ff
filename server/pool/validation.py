"""Argument checks shared by the pools: every check runs before any byte of a pool is written."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def as_slots(loc: Any, *, limit: int, what: str = "slots", device: torch.device | None = None) -> torch.Tensor:
    """Turn ``loc`` into a 1-D int64 tensor of slots and check every one lies in ``[0, limit)``.

    Args:
        loc: 1-D integer tensor, numpy array or sequence of token slots.
        limit: exclusive upper bound (``size + page_size`` for a pool).
        what: name used in error messages.
        device: device of the returned tensor (the pool's).

    Raises:
        TypeError: not integers (float, bool or other dtypes).
        ValueError: not 1-D, or a slot is negative or >= ``limit``.
    """
    if isinstance(loc, torch.Tensor):
        t = loc
    elif isinstance(loc, np.ndarray):
        if loc.dtype.kind not in "iu":
            raise TypeError(f"{what} must be integers, got numpy dtype {loc.dtype}")
        t = torch.from_numpy(np.ascontiguousarray(loc).astype(np.int64, copy=False))
    else:
        seq = list(loc)
        if not set(map(type, seq)) <= {int} and \
                any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in seq):
            raise TypeError(f"{what} must be integers")
        t = torch.tensor(seq, dtype=torch.int64)
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{what} must be an integer tensor, got dtype {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    t = t.to(dtype=torch.int64)
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0:
            raise ValueError(f"{what} contains negative slot {lo}")
        if hi >= limit:
            raise ValueError(f"{what} contains slot {hi} outside the pool [0, {limit})")
    if device is not None and t.device != device:
        t = t.to(device)
    return t


def check_unique(t: torch.Tensor, what: str) -> None:
    """Raise ValueError if the 1-D tensor ``t`` holds a value twice (duplicate target slots race)."""
    if t.numel() > 1 and torch.unique(t).numel() != t.numel():
        raise ValueError(f"{what} contains duplicate slots; each target slot may be written once per call")


def check_layer(layer_id: Any, layer_num: int, start_layer: int = 0) -> int:
    """The buffer position of model layer ``layer_id`` in a pool of ``layer_num`` layers starting at
    model layer ``start_layer`` (``layer_id - start_layer``, as SGLang's pools index their lists).

    Raises:
        TypeError: not an int. ValueError: outside ``[start_layer, start_layer + layer_num)``.
    """
    if isinstance(layer_id, bool) or not isinstance(layer_id, (int, np.integer)):
        raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__}")
    if not start_layer <= int(layer_id) < start_layer + layer_num:
        raise ValueError(f"layer_id {layer_id} out of range [{start_layer}, {start_layer + layer_num})")
    return int(layer_id) - start_layer


def check_rows(rows: torch.Tensor, n: int, row_elems: int, dtype: torch.dtype, row_bytes: int, what: str) -> torch.Tensor:
    """Validate ``rows`` for ``n`` tokens and return them as a contiguous ``(n, row_bytes)`` uint8 view.

    Accepted: ``(n, row_elems)`` or ``(n, 1, row_elems)`` of ``dtype``, or raw ``(n, row_bytes)`` uint8.

    Raises:
        TypeError: not a tensor, or the wrong dtype.
        ValueError: the wrong shape or token count.
    """
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(rows).__name__}")
    r = rows.reshape(rows.shape[0], rows.shape[2]) if rows.dim() == 3 and rows.shape[1] == 1 else rows
    if r.dim() != 2:
        raise ValueError(f"{what} must have shape (n, {row_elems}) or (n, 1, {row_elems}), got {tuple(rows.shape)}")
    if r.shape[0] != n:
        raise ValueError(f"{what} has {r.shape[0]} rows but {n} slots were given")
    if r.dtype == dtype and r.shape[1] == row_elems:
        pass
    elif r.dtype == torch.uint8 and r.shape[1] == row_bytes:
        pass
    elif r.dtype not in (dtype, torch.uint8):
        raise TypeError(f"{what} must be {dtype} (or raw uint8 bytes), got {r.dtype}")
    else:
        raise ValueError(f"{what} rows must hold {row_elems} {dtype} values or {row_bytes} bytes, got shape {tuple(rows.shape)} {r.dtype}")
    return r.contiguous().view(torch.uint8).reshape(n, row_bytes)
