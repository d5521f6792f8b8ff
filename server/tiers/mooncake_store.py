"""The distributed lowest tier: page records in a Mooncake Store shared by many daemons.

One object per unit: the object's bytes are the record exactly as :mod:`kvtier.server.tiers.record`
makes it (header with model fingerprint and layer mask, latent rows of every layer and indexer rows
of the live layers together, xxh3_64 checksum), so an object that is damaged, or not a record, or
another model's, fails the reader's checks and is a miss (counted ``damaged``, removed), never data.

Keys: the stack hands tiers opaque byte keys that already carry tenant, namespace, model fingerprint
and layer range (the daemon's are ``tenant_key(tenant, b"p:" + layout digest) + chained page hash``;
the digest covers the layer range). A key maps to the store key ``key_prefix + key.hex()``, the same
in every daemon, which is how daemons share prefixes: a tenant's pages are found by the same tenant
on another daemon and by no other tenant (its keys differ). Only keys of the configured shared
namespaces (``p:``, prefix pages, of every tenant) go to the store: offloaded copies (``o:``) are
named by each daemon's clients and would collide between daemons; they are refused on write and miss
on read without a store call. The namespace is matched in the key's *body*: what
:meth:`MooncakeStoreTier.set_key_body` says lies past the part the daemon puts before it (the
tenant); the tier itself never interprets that part.

Quotas: none per tenant here. The store is shared by daemons (and by the tenants of each), its room
is the segments its clients mount, and it evicts on its own (approximate LRU), so no daemon can
enforce a per-tenant byte cap in it; the daemon's ``[quotas]`` cover pools and the host and disk
tiers only. ``TierIndex`` groups still account the ledger per tenant (``tenant_used_bytes``: bytes
of the tenant's objects this daemon put).

How records get here: this tier is *shared* (``Tier.shared``). The stack does not cascade evictions
into it; instead every page the prefix cache adopts at StorePrefix is published to it at once
(:meth:`TierStack.publish`: one ``batch_is_exist``, then one ``batch_put_from`` of the absent pages),
so a prefix one daemon computed is visible to every other daemon right away, not only after it fell
through this daemon's host and disk tiers. Records evicted from the tiers above are simply dropped
there: the store keeps its own copy until its own eviction (approximate LRU at a high watermark).

Presence comes from the store (``batch_is_exist``), never from a local index: other daemons add
objects and the store evicts them. The tier's :class:`TierIndex` is a *ledger* of the objects this
daemon put (bounded by ``capacity_bytes``, oldest forgotten first, nothing removed from the store);
``stats()`` ``used_bytes``/``entries`` count that ledger, hits/misses/damaged/bytes count this
daemon's reads and writes.

Health (the same mechanism as the disk tier's, :mod:`kvtier.server.tiers.health`): a store call that
fails for reasons that are not the caller's (master unreachable -900, peer gone -800, client not set
up) marks the tier unhealthy (health service ``kvtier.tier.mooncake``); while unhealthy every lookup
and read is a miss without a store call, and a write raises
:class:`~kvtier.server.tiers.errors.TierUnavailableError` (as does the write whose store call
failed; records of its batch put before the failure are its ``written``): the stack's publish skips
the records and counts them ``device->mooncake(unhealthy)``. The daemon's tier monitor calls
:meth:`MooncakeStoreTier.probe` with backoff: it sets the client up if it never was, then puts,
reads back, checks and removes a probe object, so it succeeds again once the master is back. Store
full (-200) is not a failure of the store: the write raises :class:`TierFullError`. Facts about the
client: ``mooncake_client``.

Monitoring: :meth:`stats` (from :class:`~kvtier.server.tiers.base.Tier`) takes only the counter lock
and reads the ledger's plain integers, never the index lock nor the store.

Bytes move through one registered staging region (:mod:`staging`, swappable source): a write copies
records into an extent and puts them from there, unless they already lie in the region (records the
prefix cache builds in memory :meth:`MooncakeStoreTier.staged` lends, or a shared arena's); a read
gets into an extent and copies out verified records (``read_into``) or lends the views to a caller
that checks them itself (``borrow``, as the host tier lends its tensors), so a record is hashed once.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from kvtier.server.tiers.base import EvictHook, RecordLike, Tier
from kvtier.server.tiers.errors import RecordError, TierFullError, TierUnavailableError
from kvtier.server.tiers.mooncake_client import (
    FULL_CODES, INVALID_PARAMS, MISS_CODES, OBJECT_ALREADY_EXISTS, OBJECT_HAS_LEASE, OBJECT_NOT_FOUND, StoreClient,
    StoreUnavailable, code_name,
)
from kvtier.server.tiers.mooncake_config import MooncakeStoreTierConfig
from kvtier.server.tiers.policy import TierIndex
from kvtier.server.tiers.record import verify_record
from kvtier.server.tiers.staging import HostBufferSource, StagingArea, StagingTimeout, aligned

log = logging.getLogger(__name__)

class MooncakeStoreTier(Tier):
    """Records as objects of a Mooncake Store shared by many daemons.

    Args:
        config: :class:`MooncakeStoreTierConfig`.
        buffer_source: where the registered staging region comes from (default: a plain host
            tensor; a shared host arena can pass its own).

    Raises:
        ValueError: a bad config field, or the ``mooncake`` package is missing (``pip install 'kvtier[mooncake]'``).
    """

    name = "mooncake"
    shared: ClassVar[bool] = True

    def __init__(self, config: MooncakeStoreTierConfig, *, buffer_source: HostBufferSource | None = None) -> None:
        config.validate()
        super().__init__(TierIndex(config.capacity_bytes))
        self.config = config
        self.client = StoreClient(config.client_settings())
        self.staging = StagingArea(config.staging_bytes, buffer_source)
        self._replicate = self.client.replicate_config(config.replicas, config.soft_pin, config.soft_pin_ttl_ms)
        self._namespaces = tuple(n.encode() for n in config.namespaces)
        self._key_body: Callable[[bytes], bytes] = lambda key: key
        self._read_hint = 0  # largest record seen: what a read reserves per key
        self._hint_lock = threading.Lock()
        self._probe_key = f"{config.key_prefix}probe/{uuid.uuid4().hex}"
        self._extra = {"write_failures": 0, "read_failures": 0, "already_present": 0}

    # ----- keys and health -----------------------------------------------------------------------
    def store_key(self, key: bytes) -> str:
        """The store key of a tier key: ``key_prefix + key.hex()``."""
        return self.config.key_prefix + key.hex()

    def set_key_body(self, body_of: Callable[[bytes], bytes]) -> None:
        """Say where a key's namespace starts: ``body_of(key)`` is the key past whatever its owner
        puts before the namespace (the daemon: the tenant, ``kvtier.server.daemon.tenants.key_body``).
        The default is the key itself. The store key is always made of the whole key."""
        self._key_body = body_of

    def is_shared_key(self, key: bytes) -> bool:
        """Whether ``key`` belongs to a namespace this tier keeps in the store (``namespaces``,
        matched at the start of the key's body, see :meth:`set_key_body`)."""
        return isinstance(key, bytes) and self._key_body(key).startswith(self._namespaces)

    def _serving(self) -> bool:
        return self.health.healthy and self.client.is_open

    def _fail(self, what: str, err: Exception | str) -> None:
        self.health.mark_unhealthy(f"{what}: {err}")

    def open(self) -> None:
        """Set the store client up now; if the master does not answer, the tier starts unhealthy
        (lookups miss) and :meth:`probe` sets it up later. Never raises for an unreachable store."""
        try:
            self.client.open([(self.staging.ptr, self.staging.nbytes)])
        except StoreUnavailable as e:
            self._fail("open", e)

    def probe(self) -> None:
        """Set the client up if needed, then put, read back, verify and remove a probe object.

        Raises:
            StoreUnavailable: naming the step that failed.
        """
        self.client.open([(self.staging.ptr, self.staging.nbytes)])
        payload = uuid.uuid4().bytes * 4
        n = len(payload)
        with self.staging.extent(2 * n, timeout_s=5.0) as ext:
            ext.view[:n].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            code = self.client.put_from([self._probe_key], [ext.ptr], [n], self._replicate, upsert=True)[0]
            if code != 0:
                raise StoreUnavailable(f"probe put failed: {code_name(code)}")
            got = self.client.get_into([self._probe_key], [ext.ptr + n], [n])[0]
            if got != n or bytes(ext.view[n:2 * n].numpy()) != payload:
                raise StoreUnavailable(f"probe read back {code_name(got) if got < 0 else f'{got} bytes'}, not the bytes put")
            self.client.remove([self._probe_key], force=True)

    # ----- presence ------------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        out = [False] * len(keys)
        idx = [i for i, k in enumerate(keys) if self.is_shared_key(k)]
        if not idx or not self._serving():
            return out
        try:
            found = self.client.exist([self.store_key(keys[i]) for i in idx])
        except StoreUnavailable as e:
            self._fail("batch_is_exist", e)
            return out
        for i, f in zip(idx, found):
            out[i] = f
        return out

    def lookup(self, keys: Sequence[bytes]) -> int:
        n = 0
        for present in self.contains(keys):
            if not present:
                break
            n += 1
        return n

    def nbytes(self, keys: Sequence[bytes]) -> list[int | None]:
        """Object bytes per key (None where absent), read with one batch get into staging."""
        with self.borrow(keys, touch=False) as recs:
            return [None if r is None else int(r.numel()) for r in recs]

    # ----- reads ---------------------------------------------------------------------------------
    def _reserve(self) -> int:
        """Room a read reserves per key: the largest record seen (all records of a model's pages have
        one size), or ``max_object_bytes`` before any was seen."""
        return aligned(min(self._read_hint or self.config.max_object_bytes, self.config.max_object_bytes))

    def _note_size(self, n: int) -> None:
        if n > self._read_hint:
            with self._hint_lock:
                self._read_hint = max(self._read_hint, n)

    @property
    def borrow_batch(self) -> int:
        """Most keys one :meth:`borrow` lends as views of one staging extent (the prefix cache loads
        runs of this many pages per store call)."""
        return max(1, min(self.config.max_batch_keys, self.staging.nbytes // 2 // self._reserve()))

    def _groups(self, n_keys: int, per_key: int) -> list[slice]:
        per_call = max(1, min(self.config.max_batch_keys, self.staging.nbytes // 2 // per_key or 1))
        return [slice(i, min(i + per_call, n_keys)) for i in range(0, n_keys, per_call)]

    def _get_group(self, keys: Sequence[bytes], ext_view: torch.Tensor, ext_ptr: int, per_key: int,
                   verify: bool) -> list[torch.Tensor | None]:
        """Get ``keys`` into consecutive ``per_key`` slots of one extent; views (checked if ``verify``) or None."""
        skeys = [self.store_key(k) for k in keys]
        codes = self.client.get_into(skeys, [ext_ptr + i * per_key for i in range(len(keys))], [per_key] * len(keys))
        out: list[torch.Tensor | None] = []
        for i, (key, code) in enumerate(zip(keys, codes)):
            if code > 0:
                view = ext_view[i * per_key:i * per_key + code]
                if verify:
                    try:
                        verify_record(view)
                    except RecordError as e:
                        self.report_damaged(key, e)
                        out.append(None)
                        continue
                self._note_size(code)
                out.append(view)
            elif code in MISS_CODES or code == 0:
                out.append(None)
            elif code == INVALID_PARAMS:  # the object is larger than the room reserved for it
                out.append(self._get_large(key, verify))
            else:
                raise StoreUnavailable(f"batch_get_into of {skeys[i]} failed: {code_name(code)}")
        return out

    def _get_large(self, key: bytes, verify: bool) -> torch.Tensor | None:
        """Read one object larger than the current reservation (up to ``max_object_bytes``), copied out."""
        room = aligned(self.config.max_object_bytes)
        with self.staging.extent(room, timeout_s=1.0) as ext:  # short: the caller may hold an extent
            code = self.client.get_into([self.store_key(key)], [ext.ptr], [room])[0]
            if code <= 0:
                with self._stats_lock:
                    self._extra["read_failures"] += 1
                return None
            rec = ext.view[:code].clone()
        try:
            if verify:
                verify_record(rec)
        except RecordError as e:
            self.report_damaged(key, e)
            return None
        self._note_size(code)
        return rec

    @contextmanager
    def borrow(self, keys: Sequence[bytes], *, touch: bool = True, verify: bool = False) -> Iterator[list[RecordLike | None]]:
        """Yield each key's object bytes (None where absent or unreadable): views into the staging
        region while the batch fits one extent, else copies. Like the host tier's, they are lent
        unchecked unless ``verify``: every caller checks what it borrowed (the prefix cache's
        ``load_page``, the offload store's ``read_header``) and reports a failure through
        :meth:`report_damaged`, so each record is hashed once. Never raises for a failing store."""
        keys = list(keys)
        recs: list[RecordLike | None] = [None] * len(keys)
        idx = [i for i, k in enumerate(keys) if self.is_shared_key(k)]
        held: list[Any] = []
        try:
            if idx and self._serving():
                per_key = self._reserve()
                groups = self._groups(len(idx), per_key)
                lend = len(groups) == 1  # one extent: lend views; else copy each group out
                for g in groups:
                    part = idx[g]
                    ext = self.staging.allocate(per_key * len(part))
                    held.append(ext)
                    got = self._get_group([keys[i] for i in part], ext.view, ext.ptr, per_key, verify)
                    for i, rec in zip(part, got):
                        recs[i] = rec if lend or rec is None else rec.clone()
                    if not lend:
                        self.staging.release(held.pop())
        except StoreUnavailable as e:
            self._fail("batch_get_into", e)
            recs = [None] * len(keys)
        except StagingTimeout as e:
            log.warning("mooncake tier: %s; read as misses", e)
            recs = [None] * len(keys)
        try:
            hits = [k for k, r in zip(keys, recs) if r is not None]
            if touch:
                self._count(hits=len(hits), misses=len(keys) - len(hits),
                            bytes_read=sum(int(r.numel()) for r in recs if r is not None))
                with self.index.lock:
                    for k in hits:
                        self.index.touch(k)
            yield recs
        finally:
            for ext in held:
                self.staging.release(ext)

    def read_into(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> list[int]:
        """Copy each key's verified record into ``outs[i]``; 0 is a miss (absent, damaged, store failing,
        or a record larger than its buffer: another daemon may have put a different size)."""
        self._check_outs(keys, outs)
        sizes = []
        with self.borrow(keys, verify=self.config.verify_reads) as recs:
            for k, rec, o in zip(keys, recs, outs):
                if rec is None:
                    sizes.append(0)
                    continue
                n = int(rec.numel())
                if n > o.numel():
                    log.warning("mooncake tier: the %d-byte object of %s exceeds its %d-byte buffer; a miss", n, k.hex(), o.numel())
                    sizes.append(0)
                    continue
                o[:n].copy_(rec)
                sizes.append(n)
        return sizes

    def report_damaged(self, key: bytes, err: Exception) -> None:
        """Count and log an object that failed its checks, and remove it from the store (forced: a
        reader's lease does not protect bad bytes)."""
        log.warning("mooncake tier: object %s failed its checks (%s); removed, read as a miss", self.store_key(key), err)
        self._count(damaged=1)
        with self.index.lock:
            self.index.remove(key)
        if self._serving():
            try:
                self.client.remove([self.store_key(key)], force=True)
            except StoreUnavailable as e:
                self._fail("batch_remove", e)

    # ----- writes --------------------------------------------------------------------------------
    def write(self, items: Sequence[tuple[bytes, RecordLike]], *, on_evict: EvictHook | None = None,
              replace: bool = False) -> list[bytes]:
        """Put records as objects (a key the store holds is kept: the first writer wins, unless
        ``replace``). ``on_evict`` is never called: the store evicts on its own. Records not put
        because the store fails are counted ``write_failures``.

        Raises:
            ValueError: a key outside the shared namespaces, or a record that is not a 1-D uint8 host tensor.
            TierFullError: a record above ``max_object_bytes``, or the store has no room (records of
                the batch put before it stay).
            TierUnavailableError: the tier is unhealthy, or a store call failed (the tier is marked
                unhealthy first); records of the batch put before the failure stay (``written``).
        """
        for key, rec in items:
            if not self.is_shared_key(key):
                raise ValueError(f"the mooncake tier keeps only keys of namespaces {self.config.namespaces}, "
                                 f"not {self._key_body(key)[:2]!r}")
            if not isinstance(rec, torch.Tensor) or rec.dtype != torch.uint8 or rec.dim() != 1 or rec.device.type != "cpu":
                raise ValueError("mooncake tier records must be 1-D uint8 host tensors")
            if rec.numel() > self.config.max_object_bytes:
                self._count(full_errors=1)
                raise TierFullError(f"a {rec.numel()}-byte record exceeds the mooncake tier's max_object_bytes "
                                    f"({self.config.max_object_bytes})")
        if not items:
            return []
        if not self._serving():
            with self._stats_lock:
                self._extra["write_failures"] += len(items)
            raise TierUnavailableError(self.name, self.health.snapshot().reason or "the store client is not set up")
        written: list[bytes] = []
        full: str = ""
        failed: TierUnavailableError | None = None
        try:
            start = 0
            while start < len(items):
                group = self._write_group(items, start)
                done, full = self._put_group(items[start:start + group], replace)
                written.extend(done)
                if full:
                    break
                start += group
        except StoreUnavailable as e:
            self._fail("batch_put_from", e)
            failed = TierUnavailableError(self.name, self.health.snapshot().reason, written=tuple(written))
        except StagingTimeout as e:
            log.warning("mooncake tier: %s; records dropped", e)
        dropped = len(items) - len(written)
        if dropped and not full:
            with self._stats_lock:
                self._extra["write_failures"] += dropped
        if failed is not None:
            raise failed
        if full:
            self._count(full_errors=1)
            raise TierFullError(f"the mooncake store has no room: {full}")
        return written

    def _write_group(self, items: Sequence[tuple[bytes, RecordLike]], start: int) -> int:
        """How many items from ``start`` one staged put takes (at most half the staging region)."""
        budget = max(self.staging.nbytes // 2, aligned(self.config.max_object_bytes))
        total, n = 0, 0
        for _, rec in items[start:]:
            size = 0 if self.staging.offset_of(rec) is not None else aligned(int(rec.numel()))  # type: ignore[arg-type, union-attr]
            if n and (total + size > budget or n >= self.config.max_batch_keys):
                break
            total += size
            n += 1
        return n

    @contextmanager
    def staged(self, sizes: Sequence[int]) -> Iterator[list[torch.Tensor]]:
        """Lend registered staging memory for records about to be written: yields a ``(sizes[i],)``
        uint8 buffer for as many of ``sizes`` as fit one extent (maybe fewer; none when the first does
        not fit or no room came free). Records built there and passed to :meth:`write` inside the
        ``with`` block are put straight from it (no staging copy)."""
        budget = max(self.staging.nbytes // 2, aligned(self.config.max_object_bytes))
        n, total = 0, 0
        for size in sizes[:self.config.max_batch_keys]:
            if size > self.config.max_object_bytes or total + aligned(size) > budget:
                break
            total += aligned(size)
            n += 1
        if not n:
            yield []
            return
        try:
            ext = self.staging.allocate(total, timeout_s=1.0)
        except StagingTimeout:
            yield []
            return
        try:
            bufs, off = [], 0
            for size in sizes[:n]:
                bufs.append(ext.view[off:off + size])
                off += aligned(size)
            yield bufs
        finally:
            self.staging.release(ext)

    def _put_group(self, group: Sequence[tuple[bytes, RecordLike]], replace: bool) -> tuple[list[bytes], str]:
        inside = [self.staging.offset_of(rec) for _, rec in group]  # type: ignore[arg-type]
        offsets, total = {}, 0
        for i, ((_, rec), off) in enumerate(zip(group, inside)):
            if off is None:
                offsets[i] = total
                total += aligned(int(rec.numel()))  # type: ignore[union-attr]
        ext = self.staging.allocate(total) if total else None
        try:
            ptrs, sizes = [], []
            for i, ((_, rec), off) in enumerate(zip(group, inside)):
                n = int(rec.numel())  # type: ignore[union-attr]
                if off is None:
                    assert ext is not None
                    ext.view[offsets[i]:offsets[i] + n].copy_(rec)  # type: ignore[arg-type]
                    ptrs.append(ext.ptr + offsets[i])
                else:  # already in the registered region (built there, or a shared arena): no copy
                    ptrs.append(self.staging.ptr + off)
                sizes.append(n)
            codes = self.client.put_from([self.store_key(k) for k, _ in group], ptrs, sizes, self._replicate, upsert=replace)
        finally:
            if ext is not None:
                self.staging.release(ext)
        done: list[bytes] = []
        full = ""
        present = 0
        for (key, rec), code in zip(group, codes):
            if code == 0:
                done.append(key)
            elif code == OBJECT_ALREADY_EXISTS:
                present += 1
            elif code in FULL_CODES:
                full = full or code_name(code)
            else:
                raise StoreUnavailable(f"batch_put_from of {self.store_key(key)} failed: {code_name(code)}")
        nbytes = {k: int(r.numel()) for k, r in group}  # type: ignore[union-attr]
        self._count(writes=len(done), bytes_written=sum(nbytes[k] for k in done))
        with self._stats_lock:
            self._extra["already_present"] += present
        self._ledger(done, nbytes)
        for k in done:
            self._note_size(nbytes[k])
        return done, full

    def _ledger(self, keys: Sequence[bytes], nbytes: dict[bytes, int]) -> None:
        """Note objects this daemon put; forget the oldest past ``capacity_bytes`` (they stay in the store)."""
        with self.index.lock:
            for k in keys:
                if k in self.index:
                    self.index.touch(k)
                    continue
                try:
                    victims = self.index.plan_insert(k, nbytes[k])
                except TierFullError:
                    continue  # larger than the ledger, or the ledger is pinned: just not tracked
                self.index.commit_insert(k, nbytes[k], victims)

    def remove(self, keys: Sequence[bytes]) -> int:
        """Remove objects from the store (not forced: an object another reader holds under its lease
        stays until the store evicts it). Returns how many were removed."""
        shared = [k for k in keys if self.is_shared_key(k)]
        with self.index.lock:
            for k in shared:
                self.index.remove(k)
        if not shared or not self._serving():
            return 0
        try:
            codes = self.client.remove([self.store_key(k) for k in shared])
        except StoreUnavailable as e:
            self._fail("batch_remove", e)
            return 0
        bad = [c for c in codes if c not in (0, OBJECT_NOT_FOUND, OBJECT_HAS_LEASE)]
        if bad:
            self._fail("batch_remove", code_name(bad[0]))
        return sum(1 for c in codes if c == 0)

    # ----- housekeeping ----------------------------------------------------------------------------
    def stats(self):  # type: ignore[override]
        s = super().stats()
        with self._stats_lock:
            extra = dict(self._extra)
        s.extra = {**extra, "healthy": int(self.health.healthy), "segment_bytes": self.config.global_segment_bytes,
                   "staging_bytes": self.staging.nbytes, "replicas": self.config.replicas}
        return s

    def close(self) -> None:
        """Close the store client (this daemon's segment leaves the store with its objects)."""
        self.client.close()
