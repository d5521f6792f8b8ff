"""The daemon's offload store backed by the tier stack: copies are records in the host tier that
spill to the LMDB disk tier (write-back or write-through) and come back from either.

Implements :class:`~kvtier.server.service.offload_store.CopyStore`. A copy is one record: its latent
rows and live-layer indexer pages live and die together. Unlike the plain ``OffloadStore`` it does
not refuse when full: older copies move down (and, past the last tier, are gone: a later restore of
them is NOT_FOUND). A copy larger than every tier is refused with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from kvtier.server.service.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from kvtier.server.service.offload_store import HostCopy
from kvtier.server.tiers import RecordCodec, RecordError, TierStack, disk_charge
from kvtier.server.tiers.record import model_from_fingerprint, read_header

OFFLOAD_PREFIX = b"o:"


class TieredCopyStore:
    """Offloaded copies in the tier stack under keys ``b"o:" + key``.

    Args:
        stack: the daemon's host/disk tiers (shared with the prefix caches).
    """

    def __init__(self, stack: TierStack) -> None:
        if not stack.tiers:
            raise ValueError("a tiered copy store needs at least one tier")
        self.stack = stack
        self._sources: dict[str, str] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(key: str) -> bytes:
        if not key:
            raise InvalidArgument("offload key must not be empty")
        raw = key.encode()
        if len(raw) > 400:
            raise InvalidArgument("offload key must be at most 400 bytes")
        return OFFLOAD_PREFIX + raw

    def _fits_somewhere(self, nbytes: int) -> bool:
        for t in self.stack.tiers:
            charge = disk_charge(nbytes) if t.name == "disk" else nbytes
            if charge <= t.index.capacity:
                return True
        return False

    def check_room(self, key: str, nbytes: int) -> None:
        """AlreadyExists if ``key`` holds a copy; ResourceExhausted if ``nbytes`` (+ record header)
        exceeds every tier's budget."""
        if self.contains(key):
            raise AlreadyExists(f"offload key {key!r} already holds a copy; drop it first")
        if not self._fits_somewhere(nbytes + 4096):
            top = self.stack.tiers[0]
            raise ResourceExhausted(f"host tier full: the copy needs {nbytes} bytes, the {top.name} tier holds "
                                    f"{top.index.capacity} bytes and no tier below can take it")

    def put(self, key: str, copy: HostCopy) -> None:
        """Store ``copy`` as one record (latent + indexer + src_loc) in the top tier."""
        tkey = self._key(key)
        with self._lock:
            self.check_room(key, copy.nbytes)
            codec = RecordCodec(model_from_fingerprint(dict(copy.layout)))
            try:
                src = torch.as_tensor(copy.copy.get("src_loc"), dtype=torch.int64).reshape(-1)
                pages = int(torch.unique(src // codec.page_size).numel())
                rec = codec.encode_copy(dict(copy.copy), out=self.stack.tiers[0].record_buffer(codec.nbytes(src.numel(), pages)))
            except ValueError as e:
                raise InvalidArgument(f"copy {key!r}: {e}") from None
            if not self.stack.put(tkey, rec, source="device"):
                raise ResourceExhausted(f"host tier full: no tier could take the {rec.numel()}-byte copy {key!r}")
            self._sources[key] = copy.source_pool

    def get(self, key: str) -> HostCopy:
        """The copy under ``key``, checked (a damaged record is dropped and NOT_FOUND)."""
        tkey = self._key(key)
        for tier in self.stack.tiers:
            with tier.borrow([tkey]) as (rec,):
                if rec is None:
                    continue
                assert isinstance(rec, torch.Tensor)
                try:
                    model, mask, info = read_header(rec)
                    copy = RecordCodec(model, mask).to_cpu_copy(rec)
                except RecordError as e:
                    tier.report_damaged(tkey, e)
                    continue
            return HostCopy(copy, info.latent_nbytes + info.index_nbytes, info.n_tokens, model.fingerprint(),
                            model.fingerprint_digest(), self._sources.get(key, ""))
        raise NotFound(f"no offloaded copy under key {key!r}")

    def drop(self, key: str) -> HostCopy | None:
        """Remove the copy under ``key`` from every tier; returns it (None if there was none)."""
        try:
            copy = self.get(key)
        except NotFound:
            return None
        self.stack.remove([self._key(key)])
        with self._lock:
            self._sources.pop(key, None)
        return copy

    def contains(self, key: str) -> bool:
        """Whether any tier holds ``key``'s copy."""
        tkey = self._key(key)
        return any(t.contains([tkey])[0] for t in self.stack.tiers)

    def usage_bytes(self) -> int:
        """Bytes the top (host) tier holds."""
        return self.stack.tiers[0].index.used

    def budget_bytes(self) -> int:
        """The top (host) tier's budget."""
        return self.stack.tiers[0].index.capacity

    def tier_usage(self) -> list[Any]:
        """Usage of each tier (prefix pages and copies together), as ``state.TierUsage`` items."""
        from kvtier.server.service.state import TierUsage  # state imports this module

        return [TierUsage(t.name, t.index.used, t.index.capacity, len(t.index)) for t in self.stack.tiers]

    def __len__(self) -> int:
        return sum(1 for t in self.stack.tiers for k in t.index.keys() if isinstance(k, bytes) and k.startswith(OFFLOAD_PREFIX))
