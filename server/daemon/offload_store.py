"""The daemon's one offload store, backed by the tier stack: ``Offload`` puts a pool's
:meth:`~kvtier.server.pool.DSATokenToKVPool.get_cpu_copy` result here under a key, ``Restore`` gets it
back for ``load_cpu_copy``, ``Drop`` removes it.

Copies are records in the host tier that spill to the LMDB disk tier (write-back or write-through)
and come back from either: the stack's cascade. A shared tier (the Mooncake Store tier) never holds
a copy: copies are named by each daemon's clients and would collide between daemons. A copy is one
record: its latent rows and live-layer indexer pages live and die together, never apart. The store does not refuse when full: older copies move down (and,
past the last tier, are gone: a later restore of them is NOT_FOUND). A copy larger than every tier
(or a daemon without any tier) is refused with RESOURCE_EXHAUSTED.

Keys belong to tenants: a copy's tier key is ``tenant_key(tenant, b"o:" + key)``, so two tenants may
use the same key and never see each other's copy (another tenant's key is NOT_FOUND, or ``Drop``
drops nothing, exactly as for an absent key). A tenant's ``host_bytes``/``disk_bytes`` quotas apply
in the tiers (``kvtier.server.daemon.quotas``): a copy that fits no tier within them is refused with
RESOURCE_EXHAUSTED naming them.

An unhealthy tier (its storage failed: ENOSPC, EIO) is bypassed: a copy it holds cannot be restored
until it recovers (UNAVAILABLE, not NOT_FOUND: the copy exists), its key stays taken (ALREADY_EXISTS)
unless dropped, and a copy that only that tier could take is UNAVAILABLE. :meth:`OffloadStore.put`
returns whether the copy is durable (it reached a persistent tier: write-through, or straight to the
disk tier when the host tier could not take it).

Locking: a lock per copy key (:class:`~kvtier.server.daemon.locks.KeyLocks`): one call at a time on
a key (a put's room check and write go together; a drop, a restore's drop and a put's take-back of
the same key wait for it), taken after the pool's lock and before the tier index locks. Calls on
different keys never wait for each other, so one tenant's copy whose disk commit is slow (write-through
without write-behind, a write past ``write_behind_bytes``, a removal waiting for the write-behind)
holds up no other copy (attack pass 8, A8-7). The store's own dict lock guards its bookkeeping
(put numbers, sources, copies being taken) for one dict operation, never a tier call. Reads take no
store lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.server.daemon.errors import (AlreadyExists, InvalidArgument, NotFound, ResourceExhausted, Unavailable,
                                         always, still_wanted, time_left_of)
from kvtier.server.daemon.locks import KeyLocks
from kvtier.server.daemon.quotas import Quotas
from kvtier.server.daemon.tenants import Caller, tenant_key
from kvtier.server.tiers import RecordCodec, RecordError, TierStack, disk_charge
from kvtier.server.tiers.record import model_from_fingerprint, read_header

OFFLOAD_PREFIX = b"o:"
MAX_KEY_BYTES = 400
RECORD_OVERHEAD_BYTES = 4096  # room a record's header takes beside the copy's bytes (generous)


@dataclass(frozen=True)
class HostCopy:
    """One offloaded request.

    Attributes:
        copy: the ``get_cpu_copy`` result (``{"kv", "index_k", "src_loc"}``, host tensors).
        nbytes: host bytes its tensors take (latent rows plus live-layer indexer page rows).
        num_tokens: slots it covers.
        layout: the fingerprint (``DSAModelConfig.fingerprint()``) of the pool layout it came from.
        layout_digest: that fingerprint's digest; restore refuses a pool whose digest differs.
        source_pool: id of the pool it came from.
    """

    copy: Mapping[str, Any]
    nbytes: int
    num_tokens: int
    layout: Mapping[str, Any]
    layout_digest: str
    source_pool: str


class OffloadStore:
    """Offloaded copies in the tier stack under each tenant's keys.

    Args:
        stack: the daemon's host/disk tiers (shared with the prefix caches); with no tier at all
            every copy is refused (RESOURCE_EXHAUSTED).
        quotas: per-tenant tier quotas (the tiers enforce them; the store names them in refusals).
    """

    def __init__(self, stack: TierStack, quotas: Quotas | None = None) -> None:
        self.stack = stack
        self.quotas = quotas or Quotas()
        self._sources: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()  # the dicts below: one operation at a time, no tier call under it
        self._keys = KeyLocks()  # one call at a time per tier key (module docstring)
        self._taken: dict[bytes, int] = {}  # keys a Restore(drop=True) is taking -> the put it took (under _lock)
        self._puts: dict[bytes, int] = {}  # key -> a number of its latest put (under _lock)
        self._put_seq = 0

    @staticmethod
    def check_key(key: str) -> bytes:
        """``key`` as bytes. Raises InvalidArgument: empty, or above :data:`MAX_KEY_BYTES` bytes."""
        if not key:
            raise InvalidArgument("offload key must not be empty")
        if not key.isprintable():  # (attack pass 6, A6-10: control characters were taken)
            raise InvalidArgument(f"offload key must be printable characters (no control characters), got {key[:64]!r}")
        raw = key.encode()
        if len(raw) > MAX_KEY_BYTES:
            raise InvalidArgument(f"offload key must be at most {MAX_KEY_BYTES} bytes")
        return raw

    def _key(self, caller: Caller, key: str) -> bytes:
        return tenant_key(caller.tenant, OFFLOAD_PREFIX + self.check_key(key))

    def _fitting_tiers(self, tenant: str, nbytes: int) -> list[Any]:
        """The cascade tiers whose budget (and the tenant's quota there) can take ``nbytes``, healthy or not."""
        out = []
        for t in self.stack.cascade:
            charge = disk_charge(nbytes) if t.name == "disk" else nbytes
            quota = self.quotas.tier_bytes(tenant, t.name)
            if charge <= t.index.capacity and (quota is None or charge <= quota):
                out.append(t)
        return out

    def _unhealthy_holder(self, tkey: bytes) -> Any:
        """The unhealthy tier whose storage holds ``tkey``'s record (unreachable until it recovers), or None."""
        return next((t for t in self.stack.cascade if t.held_while_unhealthy(tkey)), None)

    @staticmethod
    def _retry_hint(tier: Any) -> str:
        return (f"the {tier.name} tier is unhealthy ({tier.health.snapshot().reason}); retry when health "
                f"service {tier.health.service_name} is SERVING")

    def _refusal(self, tenant: str, key: str, nbytes: int) -> ResourceExhausted:
        if not self.stack.cascade:
            return ResourceExhausted(f"host tier full: the copy needs {nbytes} bytes and the daemon has no "
                                     f"tier to keep copies in (host memory budget 0, no disk tier)")
        caps = [(t.name, self.quotas.tier_bytes(tenant, t.name), t.index) for t in self.stack.cascade]
        named = [f"{name}_bytes quota {q} bytes ({ix.group_used(tenant)} in use)" for name, q, ix in caps if q is not None]
        if named:
            return ResourceExhausted(f"tier quota of tenant {tenant!r}: the {nbytes}-byte copy {key!r} fits no tier "
                                     f"within the tenant's {', '.join(named)}")
        top = self.stack.cascade[0]
        return ResourceExhausted(f"host tier full: the copy needs {nbytes} bytes, the {top.name} tier holds "
                                 f"{top.index.capacity} bytes and no tier below can take it")

    def check_room(self, caller: Caller, key: str, nbytes: int) -> None:
        """AlreadyExists if the tenant's ``key`` holds a copy (also one on an unhealthy tier);
        ResourceExhausted if ``nbytes`` (+ record header) fits no tier's budget (within the tenant's
        quotas); Unavailable if only unhealthy tiers could take it."""
        if self.contains(caller, key):
            raise AlreadyExists(f"offload key {key!r} already holds a copy; drop it first")
        held = self._unhealthy_holder(self._key(caller, key))
        if held is not None:
            raise AlreadyExists(f"offload key {key!r} already holds a copy on the {held.name} tier, which is "
                                f"unhealthy; drop it first")
        fitting = self._fitting_tiers(caller.tenant, nbytes + RECORD_OVERHEAD_BYTES)
        if not fitting:
            raise self._refusal(caller.tenant, key, nbytes)
        if not any(t.health.healthy for t in fitting):
            raise Unavailable(f"the copy needs {nbytes} bytes, more than the {self.stack.cascade[0].name} tier "
                              f"holds; {self._retry_hint(fitting[0])}")

    def put(self, caller: Caller, key: str, copy: HostCopy, *, wanted: Callable[[], bool] = always) -> bool:
        """Store ``copy`` as one record (latent + indexer + src_loc) in the top tier (older records,
        the tenant's own first when over a quota, move down to make room).

        Only the key's own lock is held, while the record is placed and while a durable copy waits
        for the disk's commit: Offloads and Restores of other keys, of every tenant, go on meanwhile
        (attack pass 7, A7-2, and pass 8, A8-7: one tenant's durable offload held every tenant's
        Offload and Restore(drop) for as long as the disk took). A Restore(drop) or a Drop of the same
        key waits for the put's outcome, so none takes a copy its Offload then reports failed (A9-3).

        Returns:
            True if the copy is durable: committed to a persistent tier (LMDB) before this returned.

        Raises:
            AlreadyExists, ResourceExhausted, Unavailable: as :meth:`check_room` (also when no tier
                could take the record because a tier it needed is unhealthy). InvalidArgument: the
                copy does not encode. Cancelled: ``wanted()`` turned false before the copy was placed,
                or while a durable copy waited for its commit (then the copy is removed again: a
                caller told its Offload failed finds no copy under its key, A7-2). Nothing is stored
                on error.
        """
        tkey = self._key(caller, key)
        with self._keys.holding(tkey):
            self.check_room(caller, key, copy.nbytes)
            codec = RecordCodec(model_from_fingerprint(dict(copy.layout)))
            try:  # built where the top cascade tier keeps records (its host arena: no copy on entry)
                src = torch.as_tensor(copy.copy.get("src_loc"), dtype=torch.int64).reshape(-1)
                pages = int(torch.unique(src // codec.page_size).numel())
                top = self.stack.cascade[0] if self.stack.cascade else None
                out = top.record_buffer(codec.nbytes(src.numel(), pages)) if top is not None else None
                rec = codec.encode_copy(dict(copy.copy), out=out)
            except ValueError as e:
                raise InvalidArgument(f"copy {key!r}: {e}") from None
            still_wanted(wanted, "Offload")  # the last check before the copy can be seen
            placed = self.stack.put(tkey, rec, source="device")
            with self._lock:
                self._sources[(caller.tenant, key)] = copy.source_pool
                self._put_seq += 1
                seq = self._puts[tkey] = self._put_seq
            stored = [t for t in self.stack.cascade if t.persistent and t.name in placed]
            for t in stored:  # durable means committed: wait for the disk tier's write-behind (only this key's lock held)
                t.drain()
            with self._lock:
                if self._puts.get(tkey) != seq:  # dropped or taken meanwhile: it was stored, and is another call's now
                    return bool(stored)
            # its transaction failed (storage fault: unhealthy; LMDB's map full with nothing left to
            # evict: the tier serves on without it): the copy is not there, and never reported durable
            missing = [t for t in stored if not t.health.healthy or not t.contains([tkey])[0]]
            if missing:
                placed = [n for n in placed if all(t.name != n for t in missing)]
            gone = bool(placed) and not wanted()
            if not placed or gone:
                self._unput_held(caller, key, tkey, seq)
                self.stack.drain_writes(time_left_of(wanted))  # taken back for good before it answers (A10-2)
                if gone:
                    still_wanted(lambda: False, "Offload")  # its copy is taken back: nothing was changed
                sick = next((t for t in self.stack.cascade if not t.health.healthy), None)
                if sick is not None:
                    raise Unavailable(f"no tier could take the {rec.numel()}-byte copy {key!r}; {self._retry_hint(sick)}")
                raise self._refusal(caller.tenant, key, int(rec.numel()))
            return any(t.persistent for t in self.stack.cascade if t.name in placed)

    def _unput_held(self, caller: Caller, key: str, tkey: bytes, seq: int) -> None:
        """(The key's lock held.) Take back the put numbered ``seq`` (a copy its caller will be told
        failed), unless it was dropped or taken since."""
        with self._lock:
            if self._puts.get(tkey) != seq:
                return
        self.stack.remove([tkey])
        with self._lock:
            self._sources.pop((caller.tenant, key), None)
            self._puts.pop(tkey, None)

    def get(self, caller: Caller, key: str, *, settle: bool = True) -> HostCopy:
        """The tenant's copy under ``key``, checked (a damaged record is dropped and NOT_FOUND; one on
        an unhealthy tier is UNAVAILABLE). A copy on its way down between two tiers is waited for
        (``settle``) and read where it lands, never NOT_FOUND."""
        tkey = self._key(caller, key)
        for tier in self.stack.cascade:
            with tier.borrow([tkey]) as (rec,):
                if rec is None:
                    continue
                assert isinstance(rec, torch.Tensor)
                try:  # one hash: none at all when the tier verified the record as it read it
                    model, mask, info = read_header(rec, checksum=not tier.verifies_reads)
                    copy = RecordCodec(model, mask).to_cpu_copy(rec, checksum=False)
                except RecordError as e:
                    tier.report_damaged(tkey, e)
                    continue
            return HostCopy(copy, info.latent_nbytes + info.index_nbytes, info.n_tokens, model.fingerprint(),
                            model.fingerprint_digest(), self._sources.get((caller.tenant, key), ""))
        if self.stack.in_flight(tkey) and settle:  # on its way down: found where it lands (A9-7)
            self.stack.settle(lambda k: k == tkey)
            return self.get(caller, key, settle=False)
        held = self._unhealthy_holder(tkey)
        if held is not None:
            raise Unavailable(f"the offloaded copy under key {key!r} is on the {held.name} tier; {self._retry_hint(held)}")
        raise NotFound(f"no offloaded copy under key {key!r}")

    @contextmanager
    def taking(self, caller: Caller, key: str) -> Iterator[HostCopy]:
        """The tenant's copy under ``key`` (as :meth:`get`) for a Restore with drop: while the ``with``
        block runs no other taker gets it (NOT_FOUND, as if the first had already taken it), so two
        Restore(drop=True) of one copy never both succeed (attack pass 4, A4-12: 449 of 600 copies
        were restored twice). The block drops the copy once it is loaded; a failure leaves it."""
        tkey = self._key(caller, key)
        with self._keys.holding(tkey), self._lock:  # a put of the key in progress has recorded its number first (A9-3)
            if tkey in self._taken:
                raise NotFound(f"no offloaded copy under key {key!r} (another Restore with drop is taking it)")
            self._taken[tkey] = self._puts.get(tkey, 0)
        try:
            yield self.get(caller, key)
        finally:
            with self._lock:
                self._taken.pop(tkey, None)

    def settle_drop(self, wanted: Callable[[], bool] = always) -> None:
        """After a Restore with drop let its locks go: wait for the drop's delete to commit (bounded
        by the caller's deadline, :meth:`TierStack.drain_writes`), so a crash after the answer
        cannot bring the taken copy back (attack pass 10, A10-2)."""
        self.stack.drain_writes(time_left_of(wanted))

    def quiesce_key(self, caller: Caller, key: str) -> None:
        """Wait for what a removal of the tenant's copy under ``key`` waits for (its record in flight
        between tiers, the disk's write-behind queued so far), holding no lock: a Restore with drop
        calls it before it takes its pool's lock (:func:`~kvtier.server.daemon.kv_ops.restore`)."""
        tkey = self._key(caller, key)
        self.stack.quiesce(lambda k: k == tkey)

    def drop_taken(self, caller: Caller, key: str, nbytes: int, *, ready: Callable[[], None] | None = None,
                   quiesced: bool = False) -> bool:
        """Inside :meth:`taking`: drop the copy that was taken -- only if no newer copy was put under
        ``key`` since (a Drop and a new Offload meanwhile must not lose the new one: attack pass 5,
        A5-6). Returns whether it dropped.

        The wait for the tiers (records in flight, the disk's write-behind) comes first, holding no
        lock (``quiesced``: the caller has waited already, :meth:`quiesce_key`); ``ready`` is then
        called holding the key's lock and every tier's index lock, just before the copy goes
        (:meth:`TierStack.remove`).

        Raises:
            Whatever ``ready`` raises (Cancelled: the caller is gone): nothing is dropped (attack
            pass 7, A7-3: a Restore(drop=True) told DEADLINE_EXCEEDED had taken the copy)."""
        tkey = self._key(caller, key)
        if not quiesced:
            self.stack.quiesce(lambda k: k == tkey)  # the long waits, holding nothing
        with self._keys.holding(tkey):  # (as a put: no put of this key lands in between)
            with self._lock:
                if self._puts.get(tkey, 0) != self._taken.get(tkey):
                    return False
            self.stack.remove([tkey], ready=ready)
            with self._lock:
                self._sources.pop((caller.tenant, key), None)
                self._puts.pop(tkey, None)
            return True

    def drop(self, caller: Caller, key: str, *, known_nbytes: int | None = None,
             wanted: Callable[[], bool] = always) -> int | None:
        """Remove the tenant's copy under ``key`` from every tier; returns its bytes (None if there was
        none). A copy on an unhealthy tier is dropped too (deleted there when the tier recovers); it
        cannot be read then, so its bytes are unknown and 0 is returned. ``known_nbytes``: the
        caller has just read the copy (a Restore with drop) and knows its bytes, so no tier reads it
        again to learn them (a 7 MB disk record was read and checksummed twice).

        Raises:
            Cancelled: ``wanted()`` turned false (the caller cancelled, or its deadline passed)
                while the drop waited for the tiers (checked holding their locks,
                :meth:`TierStack.remove`): nothing is dropped (attack pass 5, A5-7)."""
        tkey = self._key(caller, key)
        self.stack.settle(lambda k: k == tkey)  # a copy on its way down is found where it lands (A9-7)
        nbytes = known_nbytes
        for tier in self.stack.cascade if known_nbytes is None else ():
            with tier.borrow([tkey]) as (rec,):
                if rec is not None and nbytes is None:
                    try:
                        _, _, info = read_header(rec)  # type: ignore[arg-type]
                        nbytes = info.latent_nbytes + info.index_nbytes
                    except RecordError as e:
                        tier.report_damaged(tkey, e)
        if nbytes is None:
            if self._unhealthy_holder(tkey) is None:
                return None
            nbytes = 0
        with self._keys.holding(tkey):  # no put of this key lands between the removal and the bookkeeping
            self.stack.remove([tkey], ready=lambda: still_wanted(wanted, "Drop"))
            with self._lock:
                self._sources.pop((caller.tenant, key), None)
                self._puts.pop(tkey, None)
        # the delete committed before the Drop answers, holding nothing (or, its deadline coming
        # first, queued: the Drop is done and answers before it; A10-1)
        self.stack.drain_writes(time_left_of(wanted))
        return nbytes

    def contains(self, caller: Caller, key: str) -> bool:
        """Whether any tier holds the tenant's copy under ``key``, also while it moves down between
        two (:meth:`TierStack.holds`)."""
        return self.stack.holds(self._key(caller, key))
