"""Each disk record is bound to the key it was written under.

A record's checksum (``record.py``) proves its bytes are whole and of one model, not that they are
the record written under the key that yielded them. LMDB maps a key to its value through page
pointers: one damaged pointer (a flipped word in a leaf node, a reused page) makes key A yield key
B's intact record, and the read would serve B's bytes as A's hit (attack pass 4, A4-1: a one-word
change of ``data.mdb`` made ``Restore("A")`` return B's bytes with ``damaged 0``).

So the disk tier keeps a second sub-database, ``sums``: key -> the 8 bytes of the record's own
checksum field, written in the same transaction as the record and deleted with it. A read compares
the checksum field of the record it got with ``sums[key]``; the startup scrub does the same for
every record. A record whose field differs, or that has no entry (written before this binding
existed), is damaged: dropped and read as a miss, never served. A single damaged pointer cannot make
both sub-databases agree on another record, and the record's own checksum covers its field.

Cost: one 8-byte value a record, one extra look-up a read (inside the read's transaction).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lmdb

from kvtier.server.tiers.record import CHECKSUM_OFFSET

SUM_BYTES = 8
MISMATCH = -100
"""A read code (beside ``disk_reads``' negative codes): the record is not the one written under its key."""
REASON = ("the record under this key is not the one written under it (a damaged LMDB mapping, or a record "
          "written before records were bound to their keys)")


def record_sum(view: Any) -> bytes:
    """The record's checksum field (its bytes ``CHECKSUM_OFFSET:+8``): what ``sums`` holds for its key.
    ``view``: a buffer of the whole record (a memoryview, ctypes array, bytes)."""
    return bytes(memoryview(view).cast("B")[CHECKSUM_OFFSET:CHECKSUM_OFFSET + SUM_BYTES])


def bound(txn: lmdb.Transaction, sums: Any, key: bytes, view: Any) -> bool:
    """Whether ``view`` (the value LMDB gave for ``key`` in ``txn``) is the record written under it."""
    if len(view) < CHECKSUM_OFFSET + SUM_BYTES:
        return False  # too short to hold a checksum field: the record checks name it
    want = txn.get(key, db=sums)
    return want is not None and bytes(want) == record_sum(view)


def unbound(txn: lmdb.Transaction, sums: Any, keys: Sequence[bytes], views: Sequence[Any],
            skip: Sequence[bool] | None = None) -> list[int]:
    """Indices of ``views`` (None: absent, left out) that are not the record written under their key;
    ``skip[i]``: the view is a pending write's own record (bound by construction)."""
    return [i for i, (k, v) in enumerate(zip(keys, views))
            if v is not None and not (skip is not None and skip[i]) and len(v) and not bound(txn, sums, k, v)]
