"""Chained page keys for prefix caching, shared by the daemon and its clients.

A page's key is ``xxh3_128(parent_key || token_ids)`` over the page's ``page_size`` token ids as
little-endian int32, with the root's parent a 16-byte zero string. Equal keys mean equal token
prefixes up to and including that page (with overwhelming probability), so a key names KV content.
Only full pages get keys; a trailing partial page is not cached.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

KEY_BYTES = 16
ROOT_KEY = b"\0" * KEY_BYTES


def page_keys(token_ids: Sequence[int] | np.ndarray, page_size: int, parent: bytes = ROOT_KEY) -> list[bytes]:
    """Keys of the full pages of ``token_ids`` ``(n,)`` ints, in order (``n // page_size`` keys).

    Args:
        token_ids: token ids (any integer dtype; hashed as int32).
        page_size: tokens per page (64 for DSA).
        parent: key of the page before ``token_ids[0]`` (``ROOT_KEY`` at the start of a sequence).

    Raises:
        ValueError: ``page_size`` not positive, ``parent`` not 16 bytes, or ids outside int32.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
    if not isinstance(parent, bytes) or len(parent) != KEY_BYTES:
        raise ValueError(f"parent must be a {KEY_BYTES}-byte key")
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise ValueError("token_ids must be a 1-D sequence of integers")
    if ids.size and (int(ids.min()) < -(2**31) or int(ids.max()) >= 2**31):
        raise ValueError("token ids must fit in int32")
    data = ids.astype("<i4", copy=False)
    keys = []
    for p in range(ids.size // page_size):
        parent = xxhash.xxh3_128(parent + data[p * page_size:(p + 1) * page_size].tobytes()).digest()
        keys.append(parent)
    return keys
