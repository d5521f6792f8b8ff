"""The daemon's offload store backed by the tier stack: copies are records in the host tier that
spill to the LMDB disk tier (write-back or write-through) and come back from either.

Implements :class:`~kvtier.server.service.offload_store.CopyStore`. A copy is one record: its latent
rows and live-layer indexer pages live and die together. Unlike the plain ``OffloadStore`` it does
not refuse when full: older copies move down (and, past the last tier, are gone: a later restore of
them is NOT_FOUND). A copy larger than every tier is refused with RESOURCE_EXHAUSTED.

An unhealthy tier (its storage failed) is bypassed: a copy it holds cannot be restored until it
recovers (UNAVAILABLE, not NOT_FOUND: the copy exists), its key stays taken (ALREADY_EXISTS) unless
dropped, and a copy that only that tier could take is UNAVAILABLE. :meth:`TieredCopyStore.put`
returns whether the copy is durable (it reached a persistent tier: write-through, or straight to the
disk tier when the host tier could not take it).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from kvtier.server.service.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted, Unavailable
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

    def _fitting_tiers(self, nbytes: int) -> list[Any]:
        return [t for t in self.stack.tiers
                if (disk_charge(nbytes) if t.name == "disk" else nbytes) <= t.index.capacity]

    def _unhealthy_holder(self, tkey: bytes) -> Any:
        return next((t for t in self.stack.tiers if t.held_while_unhealthy(tkey)), None)

    @staticmethod
    def _retry_hint(tier: Any) -> str:
        return (f"the {tier.name} tier is unhealthy ({tier.health.snapshot().reason}); retry when health "
                f"service {tier.health.service_name} is SERVING")

    def check_room(self, key: str, nbytes: int) -> None:
        """AlreadyExists if ``key`` holds a copy (also one on an unhealthy tier); ResourceExhausted if
        ``nbytes`` (+ record header) exceeds every tier's budget; Unavailable if only unhealthy tiers
        could take it."""
        if self.contains(key):
            raise AlreadyExists(f"offload key {key!r} already holds a copy; drop it first")
        held = self._unhealthy_holder(self._key(key))
        if held is not None:
            raise AlreadyExists(f"offload key {key!r} already holds a copy on the {held.name} tier, which is "
                                f"unhealthy; drop it first")
        fitting = self._fitting_tiers(nbytes + 4096)
        if not fitting:
            top = self.stack.tiers[0]
            raise ResourceExhausted(f"host tier full: the copy needs {nbytes} bytes, the {top.name} tier holds "
                                    f"{top.index.capacity} bytes and no tier below can take it")
        if not any(t.health.healthy for t in fitting):
            raise Unavailable(f"the copy needs {nbytes} bytes, more than the {self.stack.tiers[0].name} tier holds; "
                              f"{self._retry_hint(fitting[0])}")

    def put(self, key: str, copy: HostCopy) -> bool:
        """Store ``copy`` as one record (latent + indexer + src_loc) in the top tier.

        Returns:
            True if the copy is durable: committed to a persistent tier (LMDB) before this returned.
        """
        tkey = self._key(key)
        with self._lock:
            self.check_room(key, copy.nbytes)
            codec = RecordCodec(model_from_fingerprint(dict(copy.layout)))
            pin = bool(getattr(self.stack.tiers[0], "pin_memory", False))
            try:
                rec = codec.encode_copy(dict(copy.copy), pin_memory=pin)
            except ValueError as e:
                raise InvalidArgument(f"copy {key!r}: {e}") from None
            placed = self.stack.put(tkey, rec, source="device")
            if not placed:
                sick = next((t for t in self.stack.tiers if not t.health.healthy), None)
                if sick is not None:
                    raise Unavailable(f"no tier could take the {rec.numel()}-byte copy {key!r}; {self._retry_hint(sick)}")
                raise ResourceExhausted(f"host tier full: no tier could take the {rec.numel()}-byte copy {key!r}")
            self._sources[key] = copy.source_pool
            return any(t.persistent for t in self.stack.tiers if t.name in placed)

    def get(self, key: str) -> HostCopy:
        """The copy under ``key``, checked (a damaged record is dropped and NOT_FOUND; one on an
        unhealthy tier is UNAVAILABLE)."""
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
        held = self._unhealthy_holder(tkey)
        if held is not None:
            raise Unavailable(f"the offloaded copy under key {key!r} is on the {held.name} tier; {self._retry_hint(held)}")
        raise NotFound(f"no offloaded copy under key {key!r}")

    def drop(self, key: str) -> HostCopy | None:
        """Remove the copy under ``key`` from every tier; returns it (None if there was none). A copy on
        an unhealthy tier is dropped too (deleted there when the tier recovers); it cannot be read
        then, so what is returned names its source pool only (no tensors, ``nbytes`` 0)."""
        try:
            copy = self.get(key)
        except NotFound:
            return None
        except Unavailable:
            self.stack.remove([self._key(key)])
            with self._lock:
                source = self._sources.pop(key, "")
            return HostCopy({}, 0, 0, {}, "", source)
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

        out = []
        for t in self.stack.tiers:
            h = t.health.snapshot()
            out.append(TierUsage(t.name, t.index.used, t.index.capacity, len(t.index), h.healthy, h.reason,
                                 h.next_probe_in_s))
        return out

    def __len__(self) -> int:
        return sum(1 for t in self.stack.tiers for k in t.index.keys() if isinstance(k, bytes) and k.startswith(OFFLOAD_PREFIX))
