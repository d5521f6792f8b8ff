"""The unit store: an engine's pages (KV part + indexer part) as ONE record each in the tier stack.

What SGLang's HiCache calls its L3 storage (``kvtier.integrations.sglang`` is the adapter): put, get
and longest-prefix exists of *units* under the engine's page keys, over the daemon's host -> disk
tiers (the same tiers, budgets, quotas and health rules as the prefix caches and offloaded copies).

* One unit, one record (:mod:`~kvtier.server.daemon.unit_space`): a unit is stored only when both
  parts are there, so exists never counts a page whose indexer is missing (or the reverse), a read
  returns both parts of one record, and eviction removes both.
* Parts that arrive apart wait in the :class:`~kvtier.server.daemon.unit_pending.PendingTable`,
  invisible, until the other part comes or they time out. A tenant's waiting parts are capped by its
  ``host_bytes`` quota (and the table's budget); past either its own oldest waiting parts are
  dropped, never another tenant's, and a part with no room is not accepted.
* Keys: ``tenant_key(tenant, b"u:" + space digest + page key)``: tenant, model fingerprint with its
  layer range (the pipeline stage), indexer or not, and shard scope, above the tiers.
* A shared tier (Mooncake Store) gets each completed unit at once (:meth:`TierStack.publish`) when
  its namespaces include ``u:`` (``[tiers.mooncake] namespaces = ["p:", "u:"]``): daemons on one
  store then serve each other's units (SGLang on another machine reads them).
* A part for a unit that is already whole and present is accepted and dropped (the engine re-sends
  pages it wrote before), as SGLang's file backend skips existing pages.
* Bytes are counted by the way they travelled (``via``): ``stream`` (gRPC messages, PutUnits /
  GetUnits), ``staged`` (an attach session's shared-memory staging buffer, PutUnitsStaged /
  GetUnitsStaged: only keys and offsets travel over gRPC), ``call`` (in process):
  ``put_bytes_<via>``, ``get_bytes_<via>`` beside the totals ``put_bytes``, ``get_bytes``.

A clear is final (attack pass F8): once ClearUnits has returned, none of the units it removed comes
back. The store's clear guard (a readers-writer lock) is held exclusive by a clear and shared by the
two things that could put a unit back behind it: a read's promotion of a unit it found below the host
tier (skipped when a clear came since the read began, :attr:`UnitStore.clears`), and a put's commit
(a part that waited before the clear joins its other half only if the clear did not drop it). Units
on their way down between two tiers are waited for by the clear (:meth:`TierStack.remove_prefix`).

Locking: the clear guard, then the pending table's lock (level 4, a dict); the tier index locks are
taken by the tier calls (level 6) with no store lock but the guard held. Nothing here imports grpc.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.server.daemon.errors import InvalidArgument, always, still_wanted, time_left_of
from kvtier.server.daemon.locks import RWLock
from kvtier.server.daemon.quotas import Quotas
from kvtier.server.daemon.tenants import Caller, tenant_key, tenant_of_key
from kvtier.server.daemon.unit_pending import PendingTable
from kvtier.server.daemon.unit_settings import UnitSettings
from kvtier.server.daemon.unit_space import BOTH, INDEX, KV, SpaceRequest, UnitSpace, resolve_space
from kvtier.server.tiers import RecordError, TierStack

log = logging.getLogger("kvtier.daemon")

UNIT_PREFIX = b"u:"
MAX_KEYS = 4096
MAX_KEY_BYTES = 256
_SPACE_CACHE = 256
VIAS = ("call", "stream", "staged")
MAX_WRITER_BYTES = 64


@dataclass(frozen=True)
class PutResult:
    """Per key whether the part was accepted (stored, waiting, or the unit was already whole), how
    many units this call completed, how many parts now wait."""

    accepted: list[bool]
    completed: int
    pending: int


class UnitPut:
    """A put being received: one destination view per key, filled in key order by :meth:`add`.

    Sizes are checked at creation (before any data is read); each unit's buffer is allocated when its
    first byte arrives, so memory follows the bytes really sent. KV and both-part puts are received
    straight into record-sized tensors (no second copy), index parts into their own small tensors.
    """

    def __init__(self, store: UnitStore, caller: Caller, space: UnitSpace, keys: list[bytes], part: str,
                 via: str = "call") -> None:
        self.store, self.caller, self.space, self.keys, self.part, self.via = store, caller, space, keys, part, via
        n_part = space.part_nbytes(part)
        self.total = n_part * len(keys)
        if self.total > store.settings.max_call_bytes:
            raise InvalidArgument(f"{len(keys)} units of {n_part} bytes are {self.total} bytes, more than one call "
                                  f"may carry ({store.settings.max_call_bytes}, units.max_call_bytes); split the batch")
        self.n_part = n_part
        self.bufs: list[torch.Tensor] = []    # allocated as each unit's first byte arrives
        self.views: list[np.ndarray] = []
        self.filled = 0
        self.writer = b""                     # who writes (set by UnitStore.begin_put)
        self._at = 0

    def _next_view(self) -> np.ndarray:
        if self.part == INDEX:
            buf = torch.empty(self.n_part, dtype=torch.uint8)
            view = buf
        else:
            h, nbytes = self.space.codec.header_nbytes, self.space.codec.page_nbytes()
            top = self.store.stack.tiers[0] if self.store.stack.tiers else None
            # built in the host tier's arena where it has one: stored then without a copy
            buf = top.record_buffer(nbytes) if hasattr(top, "record_buffer") else torch.empty(nbytes, dtype=torch.uint8)
            view = buf[h:h + self.n_part]
        self.bufs.append(buf)
        self.views.append(view.numpy())
        return self.views[-1]

    def add(self, data: bytes | memoryview | torch.Tensor) -> None:
        """Copy the next ``data`` bytes in. Raises InvalidArgument past the announced total."""
        src = data.reshape(-1).view(torch.uint8).numpy() if isinstance(data, torch.Tensor) else np.frombuffer(data, np.uint8)
        n = int(src.size)
        if self.filled + n > self.total:
            raise InvalidArgument(f"PutUnits carries more than the {self.total} bytes its keys and part announce")
        done = 0
        while done < n:
            view = self.views[-1] if self._at else self._next_view()
            take = min(n - done, view.size - self._at)
            view[self._at:self._at + take] = src[done:done + take]
            done += take
            self._at = 0 if self._at + take == view.size else self._at + take
        self.filled += n

    def ends_a_part(self) -> bool:
        """True when the bytes so far end exactly at a unit's part boundary."""
        return self._at == 0

    def commit(self, wanted: Callable[[], bool] = always) -> PutResult:
        """Store what arrived.

        Raises:
            InvalidArgument: fewer bytes came than announced.
            Cancelled: ``wanted()`` was false once the commit held the clear guard (its caller gave
                up while a ClearUnits ran): nothing is stored (attack pass 6, A6-5)."""
        if self.filled != self.total:
            raise InvalidArgument(f"PutUnits carried {self.filled} of the {self.total} bytes its keys and part announce")
        return self.store._commit(self, wanted)


def _into(rec: torch.Tensor, out: object) -> torch.Tensor:
    """``rec``, or a copy of it in ``out`` (a shared tier's staging memory) when one is given."""
    if isinstance(out, torch.Tensor):
        out[:rec.numel()].copy_(rec)
        return out[:rec.numel()]
    return rec


class UnitStore:
    """Units of every tenant in the daemon's tier stack.

    Args:
        stack: the daemon's host/disk tiers (with no tier every put is refused: ``accepted`` False).
        settings: the pending table's budget and timeout, the largest call.
        quotas: per-tenant quotas: a tenant's ``host_bytes`` caps its waiting parts too (the pending
            table is host memory), each tenant making room from its own waiting parts only.
    """

    def __init__(self, stack: TierStack, settings: UnitSettings | None = None, quotas: Quotas | None = None) -> None:
        self.stack = stack
        self.settings = settings or UnitSettings()
        self.quotas = quotas or Quotas()
        self.pending = PendingTable(self.settings.pending_bytes, self.settings.pending_seconds,
                                    tenant_of=tenant_of_key, cap_of=lambda t: self.quotas.tier_bytes(t, "host"))
        self._spaces: dict[SpaceRequest, UnitSpace] = {}
        self._lock = threading.Lock()  # leaf: the counters and the space cache (dict operations only)
        self._counters: dict[str, dict[str, int]] = {}
        self._guard = RWLock()  # clears exclusive; promotions and put commits shared (module docstring)
        self.clears = 0
        """Clears so far (any tenant, any space; changed under the guard held exclusive): a read
        promotes a unit only if none came since it began."""

    # ----- names --------------------------------------------------------------------------------
    def space(self, req: SpaceRequest) -> UnitSpace:
        """The checked space of ``req`` (cached). Raises InvalidArgument."""
        with self._lock:
            got = self._spaces.get(req)
        if got is None:
            got = resolve_space(req)
            with self._lock:
                if len(self._spaces) >= _SPACE_CACHE:
                    self._spaces.clear()
                self._spaces[req] = got
        return got

    @staticmethod
    def check_keys(keys: Sequence[bytes]) -> list[bytes]:
        """Raise InvalidArgument unless there are at most 4096 keys of 1..256 bytes each."""
        if len(keys) > MAX_KEYS:
            raise InvalidArgument(f"at most {MAX_KEYS} unit keys a call, got {len(keys)}")
        keys = [bytes(k) for k in keys]
        if any(not 1 <= len(k) <= MAX_KEY_BYTES for k in keys):
            raise InvalidArgument(f"unit keys must be 1..{MAX_KEY_BYTES} bytes each")
        return keys

    @staticmethod
    def _space_prefix(caller: Caller, space: UnitSpace) -> bytes:
        return tenant_key(caller.tenant, UNIT_PREFIX + space.digest)

    def _count(self, caller: Caller, **deltas: int) -> None:
        with self._lock:
            mine = self._counters.setdefault(caller.tenant, {})
            for k, v in deltas.items():
                mine[k] = mine.get(k, 0) + v

    def _present(self, tkeys: list[bytes]) -> list[bool]:
        """For each tier key, whether a healthy tier holds its unit (one batched question a tier)."""
        out = [False] * len(tkeys)
        for t in self.stack.tiers:
            ask = [i for i, h in enumerate(out) if not h]
            if not ask:
                break
            for i, h in zip(ask, t.contains([tkeys[i] for i in ask])):
                out[i] = out[i] or h
        return out

    # ----- presence -----------------------------------------------------------------------------
    def exists(self, caller: Caller, space: UnitSpace, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` whose units are whole and present in a healthy
        tier (a waiting part is never counted). Raises InvalidArgument (bad keys)."""
        keys = self.check_keys(keys)
        self.pending.sweep()  # parts past their timeout leave now, also when no put comes
        prefix = self._space_prefix(caller, space)
        held = self._present([prefix + k for k in keys])
        n = held.index(False) if False in held else len(held)
        self._count(caller, exists_calls=1)
        return n

    # ----- put ----------------------------------------------------------------------------------
    def begin_put(self, caller: Caller, space: UnitSpace, keys: Sequence[bytes], part: str,
                  via: str = "call", writer: bytes = b"") -> UnitPut:
        """Start a put of ``part`` for ``keys``; feed it with :meth:`UnitPut.add`, end with
        :meth:`UnitPut.commit`. Keys must not repeat; ``via`` names how the bytes travel (module
        docstring; counted); ``writer`` who writes (a unit's parts pair only within one writer:
        ``unit_pending.py``; empty: the caller's attach session, else one writer for the tenant).
        Raises InvalidArgument (keys, part, size, a writer of more than 64 bytes)."""
        assert via in VIAS, via
        keys = self.check_keys(keys)
        if len(set(keys)) != len(keys):
            raise InvalidArgument("unit keys of one put must not repeat")
        if len(writer) > MAX_WRITER_BYTES:
            raise InvalidArgument(f"a unit writer id takes at most {MAX_WRITER_BYTES} bytes, got {len(writer)}")
        put = UnitPut(self, caller, space, keys, space.check_part(part), via)
        # one namespace each, so no id a client sends can name another's session
        put.writer = (b"w" + bytes(writer) if writer else
                      b"s" + caller.session.session_id.encode() if caller.session is not None else b"")
        return put

    def put(self, caller: Caller, space: UnitSpace, keys: Sequence[bytes], part: str,
            data: bytes | memoryview | torch.Tensor, via: str = "call", writer: bytes = b"") -> PutResult:
        """:meth:`begin_put`, one :meth:`UnitPut.add` of all ``data``, :meth:`UnitPut.commit`."""
        p = self.begin_put(caller, space, keys, part, via, writer)
        p.add(data)
        return p.commit()

    def _commit(self, p: UnitPut, wanted: Callable[[], bool] = always) -> PutResult:
        """Store ``p`` holding the clear guard shared; the caller is checked before and again after
        the tier writes (a write-through put without write-behind commits to LMDB here, seconds on a
        slow disk): a caller gone by then has what this call stored taken back, and is told
        Cancelled (attack pass 8, A8-11: a PutUnits told DEADLINE_EXCEEDED was stored)."""
        with self._guard.shared():  # a clear comes wholly before (it dropped the waiting parts) or after
            still_wanted(wanted, "PutUnits")
            result, made, waiting, joined = self._commit_unguarded(p, lambda: not wanted())
            if made is None:  # its caller left once the tier writes were done: taken back
                self._take_back(p, waiting, joined)
                still_wanted(lambda: False, "PutUnits")
            return result

    def _take_back(self, p: UnitPut, made: list[bytes], joined: list[tuple[bytes, torch.Tensor | None]]) -> None:
        """Undo a put whose caller left: remove the units it stored (``made``: none was there before
        it; a reader may have seen them meanwhile, as it may see any unit before an eviction), and
        give the waiting parts it completed back to the pending table (``joined``: the other part,
        from this writer's earlier call, waits again). Parts it left waiting are withdrawn."""
        if made:
            self.stack.remove(made)  # (queued on a write-behind disk; durable with the next commit)
        for tkey, other in joined:
            if other is not None:
                if p.part == KV:
                    self.pending.offer(tkey, index=other, writer=p.writer)
                else:
                    self.pending.offer(tkey, kv_rec=other, writer=p.writer)
        prefix = self._space_prefix(p.caller, p.space)
        mine = [prefix + k for k, buf in zip(p.keys, p.bufs)]
        self.pending.withdraw(mine, p.writer, p.bufs)

    def _commit_unguarded(self, p: UnitPut, gone: Callable[[], bool] = lambda: False
                          ) -> tuple[PutResult, list[bytes] | None, list[bytes], list[tuple[bytes, torch.Tensor | None]]]:
        """The put's work; returns ``(result, made, made_keys, joined)``. When ``gone()`` is true once
        the tier writes are done, ``made`` is None, nothing is published or counted, and the caller
        takes the put back (:meth:`_take_back` with ``made_keys`` and ``joined``)."""
        space, codec, ps = p.space, p.space.codec, p.space.model.page_size
        prefix = self._space_prefix(p.caller, space)
        accepted, completed, stored_before = [], 0, 0
        tkeys = [prefix + k for k in p.keys]
        present = self._present(tkeys)
        made: list[tuple[bytes, torch.Tensor]] = []
        joined: list[tuple[bytes, torch.Tensor | None]] = []  # units completed with an earlier part: that part
        for tkey, buf, there in zip(tkeys, p.bufs, present):
            if there:
                accepted.append(True)
                stored_before += 1
                continue
            rec, index = None, None
            if p.part == BOTH or not space.with_index:
                rec = buf
            else:
                m = self.pending.offer(tkey, kv_rec=buf, writer=p.writer) if p.part == KV else \
                    self.pending.offer(tkey, index=buf, writer=p.writer)
                if m is None:
                    accepted.append(self.pending.waits(tkey, p.writer))
                    continue
                rec, index = m.kv_rec, m.index
                # the earlier part, kept to wait again if this put is taken back (the completion below
                # rewrites a KV record past its KV bytes only; an arena block lives while referenced)
                joined.append((tkey, index if p.part == KV else rec))
            if index is not None:
                h, lat = codec.header_nbytes, space.kv_nbytes
                rec[h + lat:h + lat + space.index_nbytes].copy_(index)
            _, _, src = codec.payload(rec, ps, 1)
            torch.arange(ps, dtype=torch.int64, out=src)
            codec.seal(rec, ps, 1)
            placed = self.stack.put(tkey, rec, source="client")
            accepted.append(bool(placed))
            completed += bool(placed)
            made.append((tkey, rec))
        if gone():
            return PutResult(accepted, completed, 0), None, [k for k, _ in made], joined
        if made and self.stack.shared:  # a shared tier (Mooncake Store) keeps them too, if it keeps "u:" keys
            self.stack.publish([k for k, _ in made], lambda i, out: _into(made[i][1], out), source="client",
                               record_size=codec.page_nbytes())
        n_pending = sum(1 for k in p.keys if self.pending.waits(prefix + k, p.writer))
        self._count(p.caller, units_stored=completed, parts_already_stored=stored_before,
                    units_dropped_no_room=sum(1 for a in accepted if not a), put_bytes=p.total,
                    **{f"put_bytes_{p.via}": p.total})
        return PutResult(accepted, completed, n_pending), [k for k, _ in made], [], joined

    # ----- get ----------------------------------------------------------------------------------
    def read(self, caller: Caller, space: UnitSpace, keys: Sequence[bytes], part: str,
             via: str = "call") -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(position, bytes of part)`` for each key whose unit is whole and present, in key
        order. Each view lies in one record (the host tier's own tensor, pinned, or a verified copy
        from disk or a shared store) and is valid until the next item is asked for: copy it out
        before. A unit read from a tier below the host tier is put back into the host tier (counted
        ``disk->host``, ``mooncake->host``), unless a clear came since the read began. A record that fails its checks is dropped, counted and
        read as a miss. ``via`` names how the caller moves the bytes on (counted). Raises
        InvalidArgument (keys, part)."""
        assert via in VIAS, via
        keys = self.check_keys(keys)
        space.check_part(part)
        prefix = self._space_prefix(caller, space)
        codec, h = space.codec, space.codec.header_nbytes
        start = h + (space.kv_nbytes if part == INDEX else 0)
        end = start + space.part_nbytes(part)
        hits = 0
        clears = self.clears  # before the first look: a unit found after a clear is not put back by us
        tkeys = [prefix + k for k in keys]
        tiers = self.stack.tiers
        held = [t.contains(tkeys) for t in tiers]  # one presence question a tier; misses cost no read
        top = self.stack.cascade[0] if self.stack.cascade else None
        for i, tkey in enumerate(tkeys):
            for level, tier in enumerate(tiers):
                if not held[level][i]:
                    continue
                with tier.borrow([tkey]) as (rec,):
                    if rec is None:  # evicted since the presence question
                        continue
                    assert isinstance(rec, torch.Tensor)
                    try:
                        info = codec.check(rec)
                        if info.n_tokens != space.model.page_size or info.n_pages != 1:
                            raise RecordError("not a one-page unit record")
                    except RecordError as e:
                        tier.report_damaged(tkey, e)
                        continue
                    hits += 1
                    yield i, rec[start:end]
                    if top is not None and tier is not top:  # a hit below the host tier comes up to it...
                        with self._guard.shared():
                            if self.clears == clears:  # ...unless a clear removed it meanwhile
                                self.stack.put(tkey, rec, source=tier.name)
                    break
        self._count(caller, hits=hits, misses=len(keys) - hits, get_bytes=hits * (end - start),
                    **{f"get_bytes_{via}": hits * (end - start)})

    def read_into(self, caller: Caller, space: UnitSpace, keys: Sequence[bytes], part: str, out: torch.Tensor,
                  via: str = "call") -> list[bool]:
        """Copy ``part`` of each key's whole, present unit into ``out`` (unit ``i`` at byte
        ``i * part bytes``; ``out`` a ``(len(keys) * part bytes,)`` uint8 tensor, e.g. a staging
        region); returns per key whether it was found (a miss leaves its bytes as they were).

        Raises:
            InvalidArgument: keys, part, or ``out`` of another size (checked before anything is read).
        """
        keys = self.check_keys(keys)
        n = space.part_nbytes(space.check_part(part))
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != n * len(keys):
            raise InvalidArgument(f"{len(keys)} units of {n} bytes need a {n * len(keys)}-byte region, got "
                                  f"{tuple(out.shape)} {out.dtype}")
        found = [False] * len(keys)
        for i, view in self.read(caller, space, keys, part, via):
            out[i * n:(i + 1) * n].copy_(view)
            found[i] = True
        return found

    # ----- housekeeping -------------------------------------------------------------------------
    def clear(self, caller: Caller, space: UnitSpace, wanted: Callable[[], bool] = always) -> int:
        """Remove the caller's units of ``space`` from every tier and its waiting parts; returns how
        many. None of them comes back afterwards (module docstring).

        Raises:
            Cancelled: ``wanted()`` turned false while the clear waited for the units' writers and
                the tiers: nothing is removed (attack pass 5, A5-7)."""
        prefix = self._space_prefix(caller, space)
        # the long waits first, holding nothing: every tier's write-behind (every tenant's records)
        # drains here, not under the guard, which every tenant's unit puts and promotions take
        # (attack pass 7, A7-7: one tenant's clear of an empty space held them all for the backlog)
        self.stack.quiesce(lambda k: isinstance(k, bytes) and k.startswith(prefix))
        with self._guard.exclusive():  # no put commits, no read promotes: the order below is free
            # a unit may lie in several tiers: counted once. Under the guard no disk commit is waited
            # for (the disk queues its deletes; attack pass 9, A9-4): only records in flight
            units = self.stack.remove_prefix(prefix, ready=lambda: still_wanted(wanted, "ClearUnits"),
                                             quiesced=True)
            self.clears += 1
            removed = self.pending.drop_prefix(prefix)
        self.stack.drain_writes(time_left_of(wanted))  # its deletes committed before it answers, holding nothing
        self._count(caller, cleared=removed + len(units))
        return removed + len(units)

    def stats(self, caller: Caller) -> dict[str, int]:
        """The caller's tenant's counters, its waiting parts and their bytes, and the daemon-wide
        ``partial_expired``/``partial_evicted`` (monitoring: the table's and counters' leaf locks only)."""
        self.pending.sweep()
        parts, nbytes = self.pending.count_prefix(tenant_key(caller.tenant, UNIT_PREFIX))
        with self._lock:
            out = dict(self._counters.get(caller.tenant, {}))
        out.update(parts_pending=parts, pending_bytes=nbytes, partial_expired=self.pending.expired,
                   partial_evicted=self.pending.evicted)
        return out
