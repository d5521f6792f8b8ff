"""Prefix cache: a device-tier index over pool pages on top of the host/disk stack.

Pages are keyed by chained page hashes (:mod:`kvtier.page_keys`). The cache owns the pool pages it
indexes (the device tier); when the pool needs room it evicts unpinned device pages, LRU first, down
the stack (device -> host -> disk -> gone), counting every move.

Protocol of one request (what ``kvtier replay`` does):

1. :meth:`lookup` -- per tier, the longest prefix present there, and the longest prefix present in
   *some* tier with the fastest tier of each page. Pins nothing.
2. :meth:`load` -- under a new lease: pins device hits, brings the rest of that prefix up from the
   host/disk tiers into newly allocated pages, and allocates fresh pages for the remaining tokens.
3. the caller writes its new KV into the fresh slots, then :meth:`store` hands those pages to the cache
   (and publishes their records to the stack's shared tiers, so other daemons find them at once).
4. :meth:`release` -- unpins the lease's pages and frees fresh pages it did not store.

Decisions (what lives where, which victim) are apart from byte moves: with ``pool=None`` the same
code runs as a size-only simulation (records are sizes), which is how ``--simulate`` gets exactly the
hit counts of a real run.

Thread safety: every public method takes the cache's lock (calls on one cache are serialised); the
tiers below have their own locks, taken after it (top tier first). :meth:`snapshot` is the monitoring
read: it takes no lock at all (plain integers and a dict copy).

Leases are named by 128-bit random ids (32 hex characters), never sequential, so a lease cannot be
guessed; they belong to the cache's pool.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.server.pool import DSATokenToKVPool, PagedTokenAllocator, slots_of_pages
from kvtier.server.tiers.base import RecordLike
from kvtier.server.tiers.errors import LeaseError, RecordError, TierFullError
from kvtier.server.tiers.policies import make_policy, resolve_policy
from kvtier.server.tiers.policy import TierIndex
from kvtier.server.tiers.record import RecordCodec
from kvtier.server.tiers.stack import TierStack

log = logging.getLogger(__name__)

DEVICE = "device"

#: Device pages evicted together (their records built, then written down with one
#: :meth:`TierStack.put_many`). A batch's records wait in the host arena next to the full tier, so
#: it stays well inside the arena's 1/16 of headroom (64 pages of GLM-5.2 at the replay scale: 12 MB).
EVICT_BATCH = 64


@dataclass
class PrefixLookup:
    """Answer of :meth:`PrefixCache.lookup` for ``n`` page keys.

    Attributes:
        per_tier: ``{tier name: pages}``, the longest prefix wholly present in that tier.
        tiers: the longest prefix present in *some* tier: for each of its pages the fastest tier
            holding it (``len(tiers)`` pages would be loaded).
    """

    per_tier: dict[str, int]
    tiers: list[str]


@dataclass
class PrefixLoad:
    """Answer of :meth:`PrefixCache.load`.

    Attributes:
        lease: the lease id (32 hex characters, 128 random bits) to :meth:`store` under and :meth:`release`.
        slots: ``(total_tokens,)`` int64 slots: the first ``loaded_pages * page_size`` hold the
            loaded prefix, the rest are fresh pages for the caller to fill.
        tiers: tier each loaded page came from (``device``, ``host``, ``disk``, ``mooncake``).
    """

    lease: str
    slots: torch.Tensor
    tiers: list[str]

    @property
    def loaded_pages(self) -> int:
        """Pages of the prefix that were loaded."""
        return len(self.tiers)


@dataclass
class _Lease:
    pinned: list[bytes] = field(default_factory=list)
    fresh: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    expires: bool = True


def _unknown_lease(lease_id: object) -> str:
    return "the lease is unknown or released"  # its id is not echoed: messages are logged, ids are secrets


class PrefixCache:
    """Device-tier page index plus the lower tiers, for one pool.

    Args:
        stack: the host/disk tiers (may be empty).
        allocator: the pool's page allocator (the cache allocates and frees pages through it).
        codec: record codec of the pool's model and layer mask (record sizes come from it).
        pool: the device pool; None runs the cache as a size-only simulation.
        namespace: prefix for tier keys (e.g. the model fingerprint digest), so pools of different
            models never share records.
        lease_ttl_seconds: a lease not released this long after its load is released by the cache
            (at the next load or lookup), so a client that vanished mid-request cannot pin pages
            forever. None: never.
        policy: eviction policy name of the device tier's index
            (:func:`~kvtier.server.tiers.policies.make_policy`), sized by the pool's pages.
    """

    def __init__(self, stack: TierStack, allocator: PagedTokenAllocator, codec: RecordCodec, *,
                 pool: DSATokenToKVPool | None = None, namespace: bytes = b"",
                 lease_ttl_seconds: float | None = 600.0, policy: str = "lru") -> None:
        if allocator.page_size != codec.page_size:
            raise ValueError("allocator and codec disagree on page_size")
        self.stack = stack
        self.allocator = allocator
        self.codec = codec
        self.pool = pool
        self.simulate = pool is None
        self.namespace = namespace
        self.page_size = codec.page_size
        self.page_record_bytes = codec.page_nbytes()
        self._lock = threading.RLock()
        self._device = TierIndex(capacity=1 << 62, policy=make_policy(policy), policy_capacity=allocator.num_pages)
        self.policy = resolve_policy(policy)
        self.history = stack.reuse_history(allocator.num_pages, self.page_record_bytes)
        self.history.add_namespace(self.namespace)
        self._device.policy.use_history(self.history, self._tier_key, own_pages=allocator.num_pages)
        ns = len(self.namespace)
        self._holds = lambda tk: tk.startswith(self.namespace) and tk[ns:] in self._pages
        stack.add_device(self._holds)
        self._pages: dict[bytes, int] = {}
        self._leases: dict[str, _Lease] = {}
        self.lease_ttl_seconds = lease_ttl_seconds
        self.counters: dict[str, int] = {"lookups": 0, "loads": 0, "stores": 0, "releases": 0,
                                         "hit_pages_device": 0, "hit_pages_host": 0, "hit_pages_disk": 0,
                                         "miss_pages": 0, "fresh_pages": 0, "failed_loads": 0, "expired_leases": 0,
                                         "evicted_pages": 0}
        for name in stack.names:  # every key exists from the start: snapshot() copies a dict of fixed size
            self.counters.setdefault(f"hit_pages_{name}", 0)

    # ----- keys ---------------------------------------------------------------------------------
    def _tier_key(self, key: bytes) -> bytes:
        return self.namespace + key

    @staticmethod
    def _check_keys(keys: Sequence[bytes], *, unique: bool = False) -> list[bytes]:
        keys = list(keys)
        if any(not isinstance(k, bytes) or not 1 <= len(k) <= 64 for k in keys):
            raise ValueError("page keys must be byte strings of 1..64 bytes")
        if unique and len(set(keys)) != len(keys):
            seen: dict[bytes, int] = {}
            for i, k in enumerate(keys):
                if k in seen:
                    raise ValueError(f"page key {k.hex()} repeats (positions {seen[k]} and {i}); chained page keys "
                                     f"of one request never repeat")
                seen[k] = i
        return keys

    # ----- presence -----------------------------------------------------------------------------
    def where_is(self, keys: Sequence[bytes]) -> list[list[str]]:
        """For each key, the tiers holding its page (``device`` first). Pins nothing."""
        keys = self._check_keys(keys)
        with self._lock:
            lower = self.stack.where([self._tier_key(k) for k in keys])
            return [([DEVICE] if k in self._device else []) + held for k, held in zip(keys, lower)]

    def lookup(self, keys: Sequence[bytes]) -> PrefixLookup:
        """Longest prefixes of ``keys`` present, per tier and across tiers. Pins nothing."""
        keys = self._check_keys(keys)
        with self._lock:
            self.counters["lookups"] += 1
            self.expire_leases()
            return self._lookup(keys)

    def expire_leases(self) -> int:
        """Release leases older than ``lease_ttl_seconds`` (logged, counted); returns how many."""
        if self.lease_ttl_seconds is None:
            return 0
        with self._lock:
            now = time.monotonic()
            old = [i for i, lease in self._leases.items() if lease.expires and now - lease.started >= self.lease_ttl_seconds]
            for i in old:
                log.warning("prefix cache: a lease was not released within %.0f s; releasing it", self.lease_ttl_seconds)
                self.release(i)
            self.counters["expired_leases"] += len(old)
            return len(old)

    def _lookup(self, keys: list[bytes]) -> PrefixLookup:
        with self._lock:
            where = self.where_is(keys)
            per_tier = {}
            for name in [DEVICE, *self.stack.names]:
                per_tier[name] = next((i for i, w in enumerate(where) if name not in w), len(where))
            tiers = []
            for w in where:
                if not w:
                    break
                tiers.append(w[0])
            return PrefixLookup(per_tier, tiers)

    # ----- room on the device -------------------------------------------------------------------
    def ensure_free_pages(self, n: int) -> None:
        """Evict unpinned device pages (LRU first, down the stack) until ``n`` pages are free.

        Raises:
            TierFullError: not enough unpinned pages; nothing was evicted.
        """
        with self._lock:
            short = n - self.allocator.free_pages
            if short <= 0:
                return
            victims = self._device.policy.victims(short, lambda k: self._device.pin_count(k) == 0)
            if victims is None:
                raise TierFullError(f"the pool needs {n} free pages but only {self.allocator.free_pages} are free and "
                                    f"{len(self._pages) - self._pinned_pages()} cached pages are unpinned")
            self._evict_device(victims)

    def _pinned_pages(self) -> int:
        return sum(1 for k in self._pages if self._device.pin_count(k))

    def _evict_device(self, keys: list[bytes]) -> None:
        """Evict device pages ``keys`` down the stack, :data:`EVICT_BATCH` at a time: the records of a
        batch are built (in the top tier's arena), then written with one :meth:`TierStack.put_many`
        (the host tier's victims go to LMDB in one transaction pair), then the pages are freed. A key
        whose record the top tier holds already is touched there (no bytes move)."""
        for at in range(0, len(keys), EVICT_BATCH):
            batch = keys[at:at + EVICT_BATCH]
            pages = [self._pages[k] for k in batch]
            if self.stack.cascade:
                top = self.stack.cascade[0]
                tkeys = [self._tier_key(k) for k in batch]
                items: list[tuple[bytes, RecordLike]] = []
                present = 0
                for tkey, page, held in zip(tkeys, pages, top.contains(tkeys)):
                    if held:
                        top.index.touch(tkey)  # same content is already there: no bytes move
                        present += 1
                    else:
                        items.append((tkey, self._page_record(page)))  # may fail: then nothing below changed
                if present:
                    self.stack.count_move(DEVICE, f"{top.name}(present)", 0, records=present)
                self.stack.put_many(items, source=DEVICE)
            else:
                self.stack.count_move(DEVICE, "gone", self.page_record_bytes * len(batch), records=len(batch))
            for key in batch:
                del self._pages[key]
                self._device.evict(key)
            self.allocator.free_pages_by_id(pages)
            self.counters["evicted_pages"] += len(batch)

    def _page_record(self, page: int, out: torch.Tensor | None = None) -> RecordLike:
        """The page's record, built in ``out`` (a shared tier's staging, at publish) or where the top
        cascade tier keeps records (its arena: no copy on entry)."""
        if self.pool is None:
            return self.page_record_bytes
        if out is None and self.stack.cascade:
            out = self.stack.cascade[0].record_buffer(self.page_record_bytes)
        return self.codec.encode_page(self.pool, page, out=out)

    # ----- load / store / release ---------------------------------------------------------------
    def load(self, keys: Sequence[bytes], total_tokens: int | None = None, *, expires: bool = True) -> PrefixLoad:
        """Load the longest present prefix of ``keys`` into device slots and allocate the rest.

        Args:
            keys: the request's page keys.
            total_tokens: slots to hand out in all (default ``len(keys) * page_size``); at least the
                loaded prefix.
            expires: False: the lease never expires by ``lease_ttl_seconds`` (its holder's end is known
                otherwise, e.g. an attach session's connection closing).

        Returns:
            :class:`PrefixLoad`; the device pages of the loaded prefix are pinned under its lease.

        Raises:
            ValueError: bad or repeated keys, or a bad ``total_tokens``.
            TierFullError: the pool cannot make room (too much is pinned); nothing changed.
        """
        keys = self._check_keys(keys, unique=True)
        total = len(keys) * self.page_size if total_tokens is None else total_tokens
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"total_tokens must be a non-negative integer, got {total_tokens!r}")
        with self._lock:
            self.expire_leases()
            found = self._lookup(keys).tiers
            found = found[: total // self.page_size]
            self.history.observe([self._tier_key(k) for k in keys])
            lower = [(i, key) for i, (key, t) in enumerate(zip(keys, found)) if t != DEVICE]
            device_hits = [k for k, t in zip(keys, found) if t == DEVICE]
            lease_id = self._new_lease_id()
            lease = _Lease(expires=expires)
            lease.pinned = self._device.pin(device_hits)
            held = {t.name: t.index.pin([self._tier_key(k) for _, k in lower]) for t in self.stack.tiers}
            unplaced: list[int] = []
            try:
                for k in lease.pinned:
                    self._device.touch(k)
                need = len(lower) + self.allocator.pages_for(total - len(found) * self.page_size)
                try:
                    self.ensure_free_pages(need)
                except TierFullError:
                    self._device.unpin(lease.pinned)
                    raise
                new_pages = self.allocator.alloc_pages(need)
                assert new_pages is not None
                new_pages = new_pages.tolist()
                self._leases[lease_id] = lease
                lease.fresh.extend(new_pages[len(lower):])
                unplaced = list(new_pages[:len(lower)])  # neither a cached page nor a fresh one yet
                page_of = {i: self._pages[k] for i, (k, t) in enumerate(zip(keys, found)) if t == DEVICE}
                loaded = len(found)
                pairs = list(zip(lower, new_pages))
                for run in self._tier_runs(pairs, found):
                    if run[0][0][0] < loaded:
                        got = self._load_pages(found[run[0][0][0]], [(key, page) for (_, key), page in run])
                    else:  # past a failed load: the prefix ended there, nothing more is read
                        got = [0] * len(run)
                    for ((i, key), page), nbytes in zip(run, got):
                        if i < loaded and nbytes:
                            self.stack.count_move(found[i], DEVICE, nbytes)
                            self._pages[key] = page
                            self._device.commit_insert(key, 1)
                            unplaced.remove(page)
                            page_of[i] = page
                            lease.pinned.extend(self._device.pin([key]))
                            continue
                        if i < loaded:  # a damaged or vanished record: the prefix ends here
                            self.counters["failed_loads"] += 1
                            loaded = i
                        unplaced.remove(page)
                        lease.fresh.insert(0, page)
            except BaseException:
                if lease_id in self._leases:
                    if unplaced:  # a page being loaded when the error came: free it with the lease
                        lease.fresh.extend(unplaced)
                    self.release(lease_id)
                raise
            finally:
                for t in self.stack.tiers:
                    t.index.unpin(held[t.name])
            tiers = found[:loaded]
            self.stack.copied_up([self._tier_key(k) for (i, k) in lower if i < loaded])
            fresh_needed = self.allocator.pages_for(total - loaded * self.page_size)
            short = fresh_needed - len(lease.fresh)
            if short > 0:  # only after a failed load, when device hits lay past the failure
                try:
                    self.ensure_free_pages(short)
                except TierFullError:
                    self.release(lease_id)
                    raise
                lease.fresh.extend(self.allocator.alloc_pages(short).tolist())
            fresh_pages = lease.fresh[:fresh_needed]
            prefix_pages = [page_of[i] for i in range(loaded)]
            slots = slots_of_pages(torch.tensor(prefix_pages + fresh_pages, dtype=torch.int64), self.page_size)[:total]
            self.counters["loads"] += 1
            for t in tiers:
                self.counters[f"hit_pages_{t}"] += 1
            self.counters["miss_pages"] += min(len(keys), total // self.page_size) - loaded
            self.counters["fresh_pages"] += len(fresh_pages)
            return PrefixLoad(lease_id, slots, tiers)

    def _tier_runs(self, pairs: list[tuple[tuple[int, bytes], int]], found: list[str]) -> list[list[tuple[tuple[int, bytes], int]]]:
        """Cut ``((i, key), page)`` pairs into runs of one tier, each at most that tier's
        ``borrow_batch`` keys (1 where the tier has none: one record borrowed at a time)."""
        runs: list[list[tuple[tuple[int, bytes], int]]] = []
        for pair in pairs:
            name = found[pair[0][0]]
            if runs and found[runs[-1][0][0][0]] == name:
                tier = self.stack.tier(name)
                if len(runs[-1]) < max(1, int(getattr(tier, "borrow_batch", 1))):
                    runs[-1].append(pair)
                    continue
            runs.append([pair])
        return runs

    def _load_pages(self, tier_name: str, items: list[tuple[bytes, int]]) -> list[int]:
        """Borrow the records of ``items`` ``(key, pool page)`` from one tier in one batch and write
        each onto its page; returns the record bytes per item (0: absent or damaged)."""
        tier = self.stack.tier(tier_name)
        assert tier is not None
        tkeys = [self._tier_key(k) for k, _ in items]
        out = []
        with tier.borrow(tkeys) as recs:
            for tkey, (_, page), rec in zip(tkeys, items, recs):
                if rec is None:
                    out.append(0)
                    continue
                if self.pool is not None:
                    assert isinstance(rec, torch.Tensor)
                    try:
                        self.codec.load_page(self.pool, rec, page, verified=tier.verifies_reads)  # hashed once
                    except RecordError as e:
                        tier.report_damaged(tkey, e)
                        out.append(0)
                        continue
                out.append(rec if isinstance(rec, int) else int(rec.numel()))
        return out

    def _new_lease_id(self) -> str:
        while True:
            lease_id = secrets.token_hex(16)  # 128 random bits
            if lease_id not in self._leases:
                return lease_id

    def store(self, lease_id: str, keys: Sequence[bytes], slots: Any) -> int:
        """Hand the lease's fresh pages holding ``keys`` to the cache (no copy; they become device-tier
        pages, pinned until :meth:`release`).

        Args:
            lease_id: from :meth:`load`.
            keys: ``k`` page keys.
            slots: ``(k * page_size,)`` slots, page by page, each page a fresh page of this lease.

        Returns:
            Pages adopted (a key already cached keeps its page; the lease's page stays fresh).

        Raises:
            LeaseError: unknown lease.
            ValueError: repeated keys, wrong slot count, pages not whole or not this lease's fresh pages;
                nothing stored.
        """
        keys = self._check_keys(keys, unique=True)
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise LeaseError(_unknown_lease(lease_id))
            s = torch.as_tensor(slots, dtype=torch.int64).reshape(-1).cpu()
            if s.numel() != len(keys) * self.page_size:
                raise ValueError(f"{len(keys)} keys need {len(keys) * self.page_size} slots, got {s.numel()}")
            pages = (s.view(-1, self.page_size) // self.page_size) if keys else s.view(0, self.page_size)
            offs = s.view(-1, self.page_size) % self.page_size if keys else pages
            if keys and (bool((pages != pages[:, :1]).any()) or bool((offs != torch.arange(self.page_size)).any())):
                raise ValueError("each key's slots must be one whole page, in order")
            page_ids = pages[:, 0].tolist() if keys else []
            fresh = set(lease.fresh)
            if any(p not in fresh for p in page_ids) or len(set(page_ids)) != len(page_ids):
                raise ValueError("slots must be distinct fresh pages of this lease")
            adopted: list[tuple[bytes, int]] = []
            for key, page in zip(keys, page_ids):
                if key in self._device:
                    continue
                lease.fresh.remove(page)
                self._pages[key] = page
                self._device.commit_insert(key, 1)
                self._device.pin([key])
                lease.pinned.append(key)
                adopted.append((key, page))
            self.counters["stores"] += 1
            if adopted:
                self.stack.copied_up([self._tier_key(k) for k, _ in adopted])
            if adopted and self.stack.shared:  # other daemons see the new pages at once
                self.stack.publish([self._tier_key(k) for k, _ in adopted],
                                   lambda i, out: self._page_record(adopted[i][1], out), source=DEVICE,
                                   record_size=self.page_record_bytes)
            return len(adopted)

    def release(self, lease_id: str) -> None:
        """Unpin the lease's pages and free its fresh pages.

        Raises:
            LeaseError: unknown or already released lease.
        """
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                raise LeaseError(_unknown_lease(lease_id))
            self._device.unpin(lease.pinned)
            if lease.fresh:
                self.allocator.free_pages_by_id(lease.fresh)
            self.counters["releases"] += 1

    def drop_fresh(self, pages: Sequence[int]) -> int:
        """Take ``pages`` out of the open leases whose fresh pages they are and free them (a failed
        PullKV's destination: half-moved bytes are never stored under a key); the leases stay open.
        Pages that are no lease's fresh page are left alone. Returns the pages freed."""
        with self._lock:
            wanted = set(pages)
            dropped: list[int] = []
            for lease in self._leases.values():
                if wanted.intersection(lease.fresh):
                    dropped += [p for p in lease.fresh if p in wanted]
                    lease.fresh = [p for p in lease.fresh if p not in wanted]
            if dropped:
                self.allocator.free_pages_by_id(dropped)
            return len(dropped)

    def detach(self) -> None:
        """The pool is deleted: the stack forgets its device pages (so it keeps neither this cache nor
        the pool alive) and the device policy gives back its referee (attack pass 8, A8-1, A8-2)."""
        self.stack.remove_device(self._holds)
        self._device.policy.close()

    def fresh_leases(self, pages: Sequence[int]) -> list[str | None]:
        """For each of ``pages``, the open lease whose fresh page it is (the caller fills it before
        :meth:`store`), or None: a cached page (served under its key), or no page of this cache."""
        with self._lock:
            wanted = set(pages)
            of = {p: lease_id for lease_id, lease in self._leases.items() for p in lease.fresh if p in wanted}
        return [of.get(p) for p in pages]

    def drop_all(self) -> int:
        """Evict every unpinned device page down the stack (e.g. before shutdown); returns how many."""
        with self._lock:
            keys = [k for k in self._device.keys() if self._device.pin_count(k) == 0]
            self._evict_device(keys)
            return len(keys)

    # ----- stats --------------------------------------------------------------------------------
    @property
    def device_pages(self) -> int:
        """Pages the device tier holds."""
        return len(self._pages)

    @property
    def pinned_pages(self) -> int:
        """Device pages pinned by open leases."""
        with self._lock:
            return self._pinned_pages()

    @property
    def open_leases(self) -> int:
        """Leases not yet released."""
        return len(self._leases)

    def device_order(self) -> list[bytes]:
        """Device-tier keys, next victim first."""
        return self._device.keys()

    def stats(self) -> dict[str, Any]:
        """Counters, device usage and the stack's stats and moves (the same as :meth:`snapshot`)."""
        return self.snapshot()

    def snapshot(self) -> dict[str, Any]:
        """Counters, device usage and the stack's stats and moves, for monitoring: takes no lock of
        the cache, the pool or a tier index (plain integers, dict lengths and a copy of a dict whose
        keys never change), so it never waits for a load, store or eviction in progress."""
        out = self.stack.stats()
        out["device"] = self.device_use()
        out["counters"] = dict(self.counters)
        return out

    def device_use(self) -> dict[str, int]:
        """The pool pages the cache holds (``pages``), those pinned by open leases (``pinned_pages``),
        the pool's ``free_pages`` and the ``open_leases``: plain reads, no lock (monitoring: GetStats,
        ``kvtier status``)."""
        return {"pages": len(self._pages), "pinned_pages": self._device.pinned_keys,
                "free_pages": self.allocator.free_pages, "open_leases": len(self._leases)}
