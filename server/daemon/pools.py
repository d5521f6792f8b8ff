"""The daemon's pools: a registry of named pools per tenant, each with its slot allocator and lock.

Pool ids are per tenant: two tenants may both have a pool ``default``; a tenant never sees, creates
over or deletes another tenant's pool (it is NOT_FOUND, with the message of an absent one).

Locking (README "Concurrency"): the registry has one short lock for its dict, held for a lookup or
an update only (nothing is taken or called under it). Each pool has a readers-writer lock
(:class:`~kvtier.server.daemon.locks.RWLock`): reads of pool bytes (ReadKV, Offload without freeing,
buffer infos, describe) hold it shared and run in parallel; anything that changes pool bytes or the
allocator (WriteKV commit, MoveKV, Restore, AllocateSlots, FreeSlots, Offload with free, DeletePool)
holds it exclusive, so per pool those run one at a time.

Ownership (README "Local attach"): pages allocated in an attach session belong to it
(:attr:`PoolEntry.page_owner`); only that session frees, overwrites or moves onto them. Every call
that writes pool bytes into existing pages checks :meth:`PoolEntry.check_writable` (also: cached
prefix pages are never written, a lease's fresh pages only by its holder).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtier.server.hostmem import HostArena
from kvtier.server.model_config import DEFAULT_PAGE_SIZE, DSAModelConfig, load_hf_config_text
from kvtier.server.pool import DSATokenToKVPool, PagedTokenAllocator, create_pool, resolve_device
from kvtier.server.pool.factory import POOL_ROLES, skip_mask_for_role
from kvtier.server.pool.memory import device_memory, shortfall_message
from kvtier.server.pool.validation import as_slots
from kvtier.server.pool_configurator import PoolPlan, exact_pool_bytes, plan_pool
from kvtier.server.daemon.errors import (
    AlreadyExists, Busy, Cancelled, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable, always,
    still_wanted,
)
from kvtier.server.daemon.locks import LockBusy, RWLock
from kvtier.server.daemon.quotas import Quotas
from kvtier.server.daemon.tenants import Caller
from kvtier.server.tiers import TierFullError

_STAMPS = itertools.count(1)
"""Stamps of page changes and claims (:attr:`PoolEntry.page_gen`, :attr:`PoolEntry.claim_gen`): one
stamp per change, increasing and never repeated in the process (whatever pool): ``next`` of a C
iterator is atomic, so changes of two pools at once get distinct stamps."""

MAX_POOL_TOKENS = 1 << 40  # size_tokens above this cannot be a real pool; refused before any planning
MAX_POOL_ID_CHARS = 128
RECORD_WORD_BYTES = 8
"""A daemon pool's latent rows must be whole int64 words: host copies and tier records put the
components back to back (``server/tiers/record.py``), each read as words."""


@dataclass(frozen=True)
class PoolRequest:
    """What a new pool should be (domain form of CreatePoolRequest / a configured pool).

    Exactly one of ``preset`` and ``hf_config`` names the model; exactly one of ``size_tokens`` and
    ``memory_budget_bytes`` its capacity.
    """

    pool_id: str = ""
    preset: str = ""
    hf_config: dict[str, Any] | None = None
    model_name: str = ""
    num_layers: int = 0
    start_layer: int = 0
    end_layer: int = 0
    kv_cache_dtype: str = "fp8"
    page_size: int = DEFAULT_PAGE_SIZE
    role: str = "target"
    device: str = ""
    size_tokens: int = 0
    memory_budget_bytes: int = 0


def build_model(req: PoolRequest) -> DSAModelConfig:
    """The model geometry ``req`` names. Raises InvalidArgument naming the bad field."""
    try:
        kwargs: dict[str, Any] = {"kv_cache_dtype": req.kv_cache_dtype or "fp8", "page_size": req.page_size or DEFAULT_PAGE_SIZE,
                                  "num_layers": req.num_layers or None, "start_layer": req.start_layer,
                                  "end_layer": req.end_layer or None}
        if bool(req.preset) == (req.hf_config is not None):
            raise InvalidArgument("give exactly one of a model preset and an HF config")
        if req.preset:
            return DSAModelConfig.from_preset(req.preset, **kwargs)
        check_model_name(req.model_name, "model name")
        model = DSAModelConfig.from_hf_config(req.hf_config or {}, name=req.model_name or None, **kwargs)
    except (ValueError, TypeError, OverflowError) as e:
        raise InvalidArgument(f"model: {e}") from None
    check_model_name(model.name, "model name (the HF config's model_type)")
    return model


def check_model_name(name: str, what: str) -> None:
    """Refuse a model name longer than 256 characters or holding a control character: it is shown by
    ``kvtier status`` and ``kvtier pools``, where escapes reached the operator's terminal raw (attack
    pass 7, A7-9; the rule A6-10 gave pool ids).

    Raises:
        InvalidArgument: naming ``what``.
    """
    if len(name) > 256:
        raise InvalidArgument(f"{what} must be at most 256 characters")
    if not name.isprintable():
        raise InvalidArgument(f"{what} must be printable characters (no control characters), got {name[:64]!r}")


def layout_model(model: DSAModelConfig, role: str) -> DSAModelConfig:
    """``model`` with the skip mask a pool of ``role`` really uses (draft/hisparse: no skip)."""
    return dataclasses.replace(model, skip_topk_layers=skip_mask_for_role(model, role))


@dataclass(eq=False)
class PoolEntry:
    """One pool the daemon owns.

    Attributes:
        pool_id: its name (unique within its tenant).
        model: geometry with the pool's own skip mask (its layout; ``model.fingerprint()``).
        role: ``target``, ``draft`` or ``hisparse``.
        pool: the device pool.
        allocator: hands out its pages.
        plan: the capacity plan when created from a memory budget.
        lock: shared for reads, exclusive for changes (module docstring).
        page_allocated: ``(num_pages + 1,)`` bool, True on pages handed out (page 0 never).
        cache_owned: ``(num_pages + 1,)`` bool, True on pages the prefix cache holds (cached pages
            and the fresh pages of its leases). Clients read and write them through a lease, but
            ``FreeSlots`` and ``Offload(free_slots)`` never free them: only the cache does (a failed
            ``PullKV`` into a lease's fresh pages has the cache take them out of the lease).
        page_owner: ``(num_pages + 1,)`` int64, the number of the attach session that allocated each
            page (0: none). Changed under the exclusive lock only.
        lease_owner: lease id -> number of the attach session that took it (LoadPrefix in a
            session); only that session may store or release it. Under the exclusive lock only.
        page_claimed: ``(num_pages + 1,)`` bool, True on pages a WriteKV into named slots is writing
            in place while its stream arrives (:meth:`claim`); every call that names them is refused
            UNAVAILABLE until the write commits or gives them back. Under the exclusive lock only.
        page_gen: ``(num_pages + 1,)`` int64, each page's content stamp, renewed by every change
            of its bytes or allocation through the daemon (:meth:`changed`): allocated or freed (also
            by the prefix cache), written (a WriteKV commit, MoveKV, Restore, PullKV's destination).
            A page whose stamp is the same at two times held the same bytes of the same allocation
            whenever it was unclaimed in between. Writes an attached worker makes into the memory it
            maps are not seen. Under the exclusive lock only.
        alloc_gen: ``(num_pages + 1,)`` int64, the content stamp each page got when it was last
            allocated (-1: never); equal to ``page_gen`` while nothing wrote it since (:meth:`unwritten`).
        claim_gen: ``(num_pages + 1,)`` int64, the stamp of each page's latest :meth:`claim` (its
            rows change in place, unlocked, until the write commits or puts them back). A claim that
            is given back leaves ``page_gen`` as it was: the rows are the old ones again.
            :meth:`generations` folds both into the generation a PullKV checks (module
            ``server/daemon/transfer.py``, "Whole pages").
    """

    pool_id: str
    model: DSAModelConfig
    role: str
    pool: DSATokenToKVPool
    allocator: PagedTokenAllocator
    plan: PoolPlan | None = None
    tenant: str = "default"
    """The tenant that owns the pool."""
    prefix_cache: Any = None
    """The pool's :class:`~kvtier.server.tiers.PrefixCache` once a prefix call made one (set by the
    tier runtime); :meth:`alloc` evicts its unpinned pages when the pool is short of free pages."""
    lock: RWLock = field(default_factory=RWLock)
    page_allocated: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    cache_owned: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    page_owner: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    lease_owner: dict[str, int] = field(default_factory=dict, repr=False)
    page_claimed: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    page_gen: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    claim_gen: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    alloc_gen: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    claimed_pages: int = 0
    """How many pages :attr:`page_claimed` marks (0: no check needed)."""
    deleted: bool = False

    def __post_init__(self) -> None:
        self.page_allocated = torch.zeros(self.allocator.num_pages + 1, dtype=torch.bool)
        self.page_claimed = torch.zeros(self.allocator.num_pages + 1, dtype=torch.bool)
        self.cache_owned = torch.zeros(self.allocator.num_pages + 1, dtype=torch.bool)
        self.page_owner = torch.zeros(self.allocator.num_pages + 1, dtype=torch.int64)
        self.page_gen = torch.zeros(self.allocator.num_pages + 1, dtype=torch.int64)
        self.claim_gen = torch.zeros(self.allocator.num_pages + 1, dtype=torch.int64)
        self.alloc_gen = torch.full((self.allocator.num_pages + 1,), -1, dtype=torch.int64)

    def changed(self, pages: Any, *, allocated: bool = False) -> None:
        """Give ``pages`` (page ids: a tensor, array or list) a new content stamp (:attr:`page_gen`);
        ``allocated``: they were just handed out, so the stamp is their allocation's too
        (:attr:`alloc_gen`, :meth:`unwritten`). Caller holds the lock exclusive, before or with the
        change, in the same exclusive section."""
        ids = torch.as_tensor(pages, dtype=torch.int64).reshape(-1).numpy()
        if ids.size:
            stamp = next(_STAMPS)
            self.page_gen.numpy()[ids] = stamp  # a numpy view: ~1 us, not ~10
            if allocated:
                self.alloc_gen.numpy()[ids] = stamp

    def unwritten(self, pages: Any) -> bool:
        """Whether none of ``pages`` has been written through the daemon since it was allocated (its
        content stamp is still its allocation's, no claim since): their bytes are whatever the
        allocator left, which no call may rely on, so a call that fails part way through writing them
        has nothing to put back (a PullKV's destination, a Restore's named slots). Writes an attached
        worker makes through its own mapping are not seen. Caller holds the lock."""
        ids = torch.as_tensor(pages, dtype=torch.int64).reshape(-1).numpy()
        gen = self.page_gen.numpy()[ids]
        return bool(((gen == self.alloc_gen.numpy()[ids]) & (self.claim_gen.numpy()[ids] <= gen)).all())

    def generations(self, pages: Any) -> list[int]:
        """The write generation of each of ``pages`` (in range: checked by the caller), as a pull
        reads it with the layout: the later of its content stamp and its latest claim's stamp.
        Stamps only grow, so afterwards, for a generation ``g`` read here:

        * ``page_gen <= g`` still: the page holds the bytes it held then whenever it is unclaimed
          (a claim given back since restored them; a commit, free or allocation stamps it above ``g``);
        * ``generations == g`` still: besides, no claim began since (nothing wrote its rows unlocked).

        Caller holds the lock (shared is enough)."""
        ids = torch.as_tensor(pages, dtype=torch.int64).reshape(-1).numpy()
        return np.maximum(self.page_gen.numpy()[ids], self.claim_gen.numpy()[ids]).tolist()

    def owner_of(self, caller: Caller) -> int:
        """The page owner ``caller``'s calls act as in this pool: the number of its attach session if
        it is attached to this pool, else 0 (no session). Caller holds the lock.

        Raises:
            NotFound: the caller's session has ended (its slots and leases were given back).
        """
        session = caller.session
        if session is None or session.entry is not self:
            return 0
        if session.ended:
            raise NotFound("the attach session has ended (its slots and leases were given back); attach again")
        return session.number

    def check_owner(self, pages: Any, owner: int, what: str = "slots") -> None:
        """Raise FailedPrecondition if any of ``pages`` belongs to an attach session other than ``owner``."""
        t = torch.as_tensor(pages, dtype=torch.int64).reshape(-1)
        if t.numel():
            o = self.page_owner[t]
            bad = (o != 0) & (o != owner)
            if bool(bad.any()):
                raise FailedPrecondition(
                    f"{what}: page {int(t[bad][0])} of pool {self.pool_id!r} belongs to another worker's attach "
                    f"session; only that worker may free, overwrite or move onto it")

    def session_pages(self, owner: int) -> torch.Tensor:
        """``(p,)`` int64 pages the attach session numbered ``owner`` (> 0) holds."""
        return torch.nonzero(self.page_owner == owner).reshape(-1)

    def check_client_owned(self, pages: Any, what: str = "slots") -> None:
        """Raise FailedPrecondition if any of ``pages`` belongs to the prefix cache (its own pages,
        or fresh pages of a lease): such pages are freed by ``ReleasePrefix`` or eviction only."""
        t = torch.as_tensor(pages, dtype=torch.int64).reshape(-1)
        if t.numel():
            owned = self.cache_owned[t]
            if bool(owned.any()):
                page = int(t[owned][0])
                raise FailedPrecondition(
                    f"{what}: page {page} of pool {self.pool_id!r} is held by the prefix cache (a cached page or a "
                    f"lease's fresh page); release the lease instead of freeing its pages")

    def check_writable(self, pages: Any, owner: int, what: str = "slots") -> None:
        """The one ownership check of every call that writes bytes into existing pages of the pool
        (WriteKV into named slots, MoveKV's targets, Restore into named slots, PullKV's destination),
        as ``owner`` (:meth:`owner_of`); caller holds the lock exclusive. A page may be written when:

        * it belongs to no attach session, or to ``owner``'s (:meth:`check_owner`); and
        * the prefix cache does not hold it (:attr:`cache_owned`), or it is a fresh page of an open
          lease taken by ``owner`` (its session's lease; 0: a lease taken outside any session), which
          that lease's holder fills before StorePrefix.

        A cached page (after StorePrefix, also one a lease pins as a hit) is never written: LoadPrefix
        serves its bytes under its key to every lease.

        Raises:
            FailedPrecondition: naming the first page refused and why (nothing is written then).
        """
        t = torch.unique(torch.as_tensor(pages, dtype=torch.int64).reshape(-1))
        self.check_owner(t, owner, what)
        held = t[self.cache_owned[t]].tolist() if t.numel() else []
        if not held:
            return
        leases = self.prefix_cache.fresh_leases(held) if self.prefix_cache is not None else [None] * len(held)
        for page, lease in zip(held, leases):
            if lease is None:
                raise FailedPrecondition(
                    f"{what}: page {page} of pool {self.pool_id!r} is a cached prefix page (LoadPrefix serves its "
                    f"bytes under its key); it is never overwritten: write new KV into a lease's fresh slots")
            if self.lease_owner.get(lease, 0) != owner:
                raise FailedPrecondition(
                    f"{what}: page {page} of pool {self.pool_id!r} is a fresh page of another client's prefix lease; "
                    f"only the client that took the lease writes it")

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def slot_limit(self) -> int:
        """Exclusive upper bound of slots on allocatable pages."""
        return (self.allocator.num_pages + 1) * self.page_size

    def slots(self, loc: Any, what: str = "slots", *, unique: bool = False, allocated: bool = True,
              claimed_ok: bool = False) -> torch.Tensor:
        """``loc`` as ``(n,)`` int64 CPU slots, checked: in range, on allocated pages, optionally unique;
        with ``allocated``, also on no page a write in flight claims (:meth:`claim`) unless
        ``claimed_ok`` (that write's own commit).

        Raises:
            InvalidArgument: naming the first bad slot.
            Busy: a slot on a page a WriteKV still arriving is writing (UNAVAILABLE; retry once it ends).
        """
        try:
            t = as_slots(loc, limit=self.slot_limit, what=what)
        except (ValueError, TypeError) as e:
            raise InvalidArgument(str(e)) from None
        if unique and t.numel() > 1 and torch.unique(t).numel() != t.numel():
            raise InvalidArgument(f"{what} contains duplicate slots; each target slot may be written once per call")
        if allocated and t.numel():
            pages = t // self.page_size
            bad = ~self.page_allocated[pages]
            if bool(bad.any()):
                first = int(t[bad][0])
                raise InvalidArgument(f"{what} contains slot {first} on page {first // self.page_size}, which is not allocated")
            if not claimed_ok:
                self.check_unclaimed(pages, what)
        return t

    def check_unclaimed(self, pages: Any, what: str = "slots") -> None:
        """Raise Busy (UNAVAILABLE, safe to retry) if any of ``pages`` is claimed by a WriteKV still
        arriving (:meth:`claim`)."""
        if not self.claimed_pages:
            return
        t = torch.as_tensor(pages, dtype=torch.int64).reshape(-1)
        busy = self.page_claimed[t]
        if bool(busy.any()):
            raise Busy(f"{what}: page {int(t[busy][0])} of pool {self.pool_id!r} is being written by a WriteKV "
                       f"whose stream is still arriving; retry once that write ends")

    def claim(self, pages: torch.Tensor) -> None:
        """Claim ``pages`` (allocated, unclaimed: checked by the caller) for a WriteKV that writes them in
        place as its stream arrives; caller holds the lock exclusive. Until :meth:`unclaim` every
        :meth:`slots` and :meth:`check_unclaimed` check refuses them, so nothing reads, writes, frees or
        moves them, and an attach session that ends leaves them allocated to it: the write frees them
        when it ends (:func:`~kvtier.server.daemon.kv_write.abort_claimed`)."""
        self.page_claimed[pages] = True
        self.claimed_pages = int(self.page_claimed.sum())
        ids = torch.as_tensor(pages, dtype=torch.int64).reshape(-1).numpy()
        self.claim_gen.numpy()[ids] = next(_STAMPS)  # rows change unlocked from now on: an engine read must see it

    def unclaim(self, pages: torch.Tensor) -> None:
        """End the claim of :meth:`claim` on ``pages``; caller holds the lock exclusive."""
        self.page_claimed[pages] = False
        self.claimed_pages = int(self.page_claimed.sum())

    def end_claim(self, pages: torch.Tensor, caller: Caller) -> None:
        """End the claim of :meth:`claim` on ``pages`` made for ``caller`` (a write or a Restore into
        its named slots, done or given up), and free those of them its attach session held if the
        session ended meanwhile (its end left claimed pages to the claim); caller holds the lock exclusive."""
        self.unclaim(pages)
        session = caller.session
        if session is not None and session.entry is self and session.ended:
            mine = pages[self.page_owner[pages] == session.number]
            if mine.numel():
                self.free(mine * self.page_size, session.number)

    def alloc(self, n_tokens: int, owner: int = 0) -> torch.Tensor:
        """Allocate whole pages for ``n_tokens``; caller holds the lock exclusive. Returns ``(n,)`` slots.
        ``owner``: the attach session the pages belong to (:meth:`owner_of`; 0: none).

        When too few pages are free, unpinned prefix-cache pages are evicted first (LRU, down the
        stack, as LoadPrefix does).

        Raises:
            InvalidArgument: ``n_tokens`` negative or not an integer.
            ResourceExhausted: too few free pages even after evicting every unpinned cached page
                (nothing was evicted then).
        """
        slots = self.reserve(n_tokens)
        self.grant(slots, owner)
        return slots

    def reserve(self, n_tokens: int) -> torch.Tensor:
        """Take whole pages for ``n_tokens`` from the free pages without handing them out (a WriteKV
        that allocates: it writes into them while its stream arrives). Until :meth:`grant` they are
        allocated to no one: :meth:`slots` refuses them as unallocated, so no call reads, writes,
        frees or moves them; :meth:`unreserve` gives them back. Caller holds the lock exclusive.
        Returns ``(n,)`` slots. Raises as :meth:`alloc`."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
            raise InvalidArgument(f"num_tokens must be a non-negative integer, got {n_tokens!r}")
        need = self.allocator.pages_for(n_tokens)
        if need > self.allocator.free_pages and need <= self.allocator.num_pages and self.prefix_cache is not None:
            try:
                self.prefix_cache.ensure_free_pages(need)
            except TierFullError:
                pass  # too much is pinned: refused below with the pool's own message
        slots = self.allocator.alloc(n_tokens)
        if slots is None:
            need = self.allocator.pages_for(n_tokens)
            raise ResourceExhausted(
                f"pool {self.pool_id!r}: {n_tokens} tokens need {need} pages, {self.allocator.free_pages} are free")
        return slots

    def grant(self, slots: torch.Tensor, owner: int = 0) -> None:
        """Hand out the pages of ``slots`` taken by :meth:`reserve` to ``owner``; caller holds the lock exclusive."""
        pages = torch.unique(slots // self.page_size)
        self.page_allocated[pages] = True
        self.page_owner[pages] = owner
        self.changed(pages, allocated=True)

    def unreserve(self, slots: torch.Tensor) -> int:
        """Give back the pages of ``slots`` taken by :meth:`reserve` and never granted; returns the
        pages freed. Caller holds the lock exclusive."""
        pages = sorted(set((slots // self.page_size).tolist()))
        if bool(self.page_allocated[pages].any()):
            raise RuntimeError(f"pages {pages[:8]} of pool {self.pool_id!r} were granted; free them instead")
        return self.allocator.free_pages_by_id(pages)

    def free(self, slots: torch.Tensor, owner: int = 0) -> int:
        """Free every page ``slots`` (already checked by :meth:`slots`) touch, as ``owner``
        (:meth:`owner_of`); caller holds the lock exclusive.

        Raises:
            FailedPrecondition: a page belongs to the prefix cache or to another attach session
                (nothing is freed then).
        """
        pages = sorted(set((slots // self.page_size).tolist()))
        self.check_client_owned(pages)
        self.check_owner(pages, owner)
        freed = self.allocator.free_pages_by_id(pages)
        self.page_allocated[pages] = False
        self.page_owner[pages] = 0
        self.changed(pages)
        return freed


class PoolRegistry:
    """Named pools of each tenant. Thread-safe; lookups take only a short dict lock.

    Args:
        default_device: device for requests that name none (``auto``, ``cpu``, ``cuda``).
        pool_memory_bytes: cap on all pools' bytes together (0: none).
        quotas: per-tenant caps (``pool_bytes``: a tenant's pools together).
    """

    def __init__(self, default_device: str = "auto", pool_memory_bytes: int = 0, quotas: Quotas | None = None) -> None:
        self.default_device = default_device
        self.pool_memory_bytes = pool_memory_bytes
        self.quotas = quotas or Quotas()
        self.host_arena: HostArena | None = None
        """Where pools' ``get_cpu_copy`` results live (the tier runtime sets the host tier's arena, so
        the daemon has one host arena); None: each pool makes its own."""
        self._pools: dict[tuple[str, str], PoolEntry] = {}
        self._reserved: dict[tuple[str, str], int] = {}  # (tenant, id) being created -> their bytes
        self._lock = threading.Lock()

    def _check_room(self, caller: Caller, pool_id: str, nbytes: int) -> None:
        """Under ``_lock``: the daemon-wide cap and the tenant's pool quota."""
        used = sum(e.pool.get_kv_size_bytes() for e in self._pools.values()) + sum(self._reserved.values())
        if self.pool_memory_bytes and used + nbytes > self.pool_memory_bytes:
            raise ResourceExhausted(
                f"pool {pool_id!r} needs {nbytes} bytes; {self.pool_memory_bytes - used} of the "
                f"daemon's {self.pool_memory_bytes}-byte pool memory are free")
        quota = self.quotas.of(caller.tenant).pool_bytes
        if quota is not None:
            mine = sum(e.pool.get_kv_size_bytes() for (t, _), e in self._pools.items() if t == caller.tenant)
            mine += sum(n for (t, _), n in self._reserved.items() if t == caller.tenant)
            if mine + nbytes > quota:
                raise ResourceExhausted(
                    f"pool quota of tenant {caller.tenant!r}: pool {pool_id!r} needs {nbytes} bytes, "
                    f"{max(quota - mine, 0)} of the tenant's {quota}-byte pool_bytes quota are free")

    def create(self, caller: Caller, req: PoolRequest, wanted: Callable[[], bool] = always) -> PoolEntry:
        """Create and register a pool of ``caller``'s tenant. Everything is checked (sizes first)
        before memory is allocated; the allocation itself runs outside every lock. ``wanted()`` is
        checked under the registry's lock before the reservation and again right before the pool
        becomes visible: a caller that gave up (cancelled, past its deadline) while the pool was
        allocated gets Cancelled and no pool exists (attack pass 7, A7-5).

        Raises:
            InvalidArgument: bad pool id, model, role, device or capacity.
            AlreadyExists: the tenant already has a pool of that id.
            ResourceExhausted: the memory budget holds no page, the daemon's pool cap or the
                tenant's pool quota would be exceeded, or the device could not allocate the buffers.
            Cancelled: ``wanted()`` is false (nothing is created; memory allocated is given back).
        """
        if len(req.pool_id) > MAX_POOL_ID_CHARS:
            raise InvalidArgument(f"pool_id must be at most {MAX_POOL_ID_CHARS} characters")
        if not req.pool_id.isprintable():  # escapes reached `kvtier status` and /metrics raw (attack pass 6, A6-10)
            raise InvalidArgument(f"pool_id must be printable characters (no control characters), got {req.pool_id[:64]!r}")
        if req.size_tokens < 0 or req.size_tokens > MAX_POOL_TOKENS:
            raise InvalidArgument(f"size_tokens must be at most {MAX_POOL_TOKENS}, got {req.size_tokens}")
        model = build_model(req)
        if model.latent_row_bytes % RECORD_WORD_BYTES:
            raise InvalidArgument(
                f"{model.name}'s latent rows are {model.latent_row_bytes} bytes, not whole {RECORD_WORD_BYTES}-byte words: "
                f"the daemon's host copies, tier records and transfers lay out components back to back in int64 "
                f"words (DSA rows are 656 bytes in fp8, 1,152 in bf16); check kv_lora_rank and qk_rope_head_dim")
        if req.role not in POOL_ROLES:
            raise InvalidArgument(f"role must be one of {POOL_ROLES}, got {req.role!r}")
        try:
            device = resolve_device(req.device or self.default_device)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        if (req.size_tokens > 0) == (req.memory_budget_bytes > 0):
            raise InvalidArgument("give exactly one of size_tokens and memory_budget_bytes (> 0)")
        plan = None
        size = req.size_tokens
        if req.memory_budget_bytes:
            plan = plan_pool(model, req.memory_budget_bytes, accounting="exact", role=req.role)
            size = plan.skip_aware_tokens
            if size <= 0:
                raise ResourceExhausted(f"a memory budget of {req.memory_budget_bytes} bytes holds no page of {model.name}")
            if size > MAX_POOL_TOKENS:
                raise InvalidArgument(f"a memory budget of {req.memory_budget_bytes} bytes plans {size} tokens, more "
                                      f"than the {MAX_POOL_TOKENS} a pool may hold")
        elif size % model.page_size:
            raise InvalidArgument(f"size_tokens must be a multiple of page_size={model.page_size}, got {size}")
        nbytes = exact_pool_bytes(model, size, role=req.role)
        pool_id = req.pool_id or f"pool-{uuid.uuid4().hex[:8]}"
        short = shortfall_message(nbytes, device_memory(device), f"pool {pool_id!r}")
        if short:
            raise ResourceExhausted(short)
        key = (caller.tenant, pool_id)
        with self._lock:
            if key in self._pools or key in self._reserved:
                raise AlreadyExists(f"pool {pool_id!r} already exists")
            still_wanted(wanted, "CreatePool")
            self._check_room(caller, pool_id, nbytes)
            self._reserved[key] = nbytes
        try:
            try:
                # CPU pools live in anonymous shared memory, so a local worker can attach them
                pool = create_pool(model, size, role=req.role, device=device, host_arena=self.host_arena,
                                   shared=device.type == "cpu")
            except (RuntimeError, MemoryError, OSError):
                mem = device_memory(device)  # the allocator's own text is long and names its C++ source
                raise ResourceExhausted(
                    shortfall_message(nbytes, mem, f"pool {pool_id!r}")
                    or f"could not allocate {nbytes:,} bytes for pool {pool_id!r} on {mem.device} ({mem.available:,} bytes "
                       f"available); plan a smaller pool with `kvtier plan --available-bytes {mem.available}`") from None
            entry = PoolEntry(pool_id, layout_model(model, req.role), req.role, pool,
                              PagedTokenAllocator(size, model.page_size), plan, tenant=caller.tenant)
            with self._lock:
                if wanted():  # checked under the lock, right before the pool becomes visible
                    self._pools[key] = entry
                    return entry
            for shm in pool.shared_memory.values():
                shm.close_fd()  # never visible, so never attached: dropping the pool frees its memory
            raise Cancelled("the CreatePool was cancelled or ran past its deadline while the pool was "
                            "allocated; no pool was created")
        finally:
            with self._lock:
                self._reserved.pop(key, None)

    def get(self, caller: Caller, pool_id: str) -> PoolEntry:
        """``caller``'s pool named ``pool_id``. Raises NotFound (also for another tenant's pool: the
        same message as an absent one)."""
        with self._lock:
            entry = self._pools.get((caller.tenant, pool_id))
        if entry is None:
            raise NotFound(f"no pool {pool_id!r}")
        return entry

    @contextmanager
    def locked(self, caller: Caller, pool_id: str, *, exclusive: bool,
               timeout: float | None = None) -> Iterator[PoolEntry]:
        """Hold pool ``pool_id``'s lock (shared or exclusive) and yield it. Raises NotFound,
        also when the pool was deleted while waiting for the lock. ``timeout`` (shared only) bounds
        the wait: past it Unavailable (the pool is busy; retry)."""
        entry = self.get(caller, pool_id)
        try:
            with entry.lock.exclusive() if exclusive else entry.lock.shared(timeout):
                if entry.deleted:
                    raise NotFound(f"no pool {pool_id!r}")
                yield entry
        except LockBusy:
            raise Unavailable(f"pool {pool_id!r} is busy (a call holds it exclusive, e.g. a transfer); "
                              f"retry") from None

    def list(self, caller: Caller | None = None) -> list[PoolEntry]:
        """``caller``'s pools by id (None: every tenant's, by tenant and id: for shutdown and the operator)."""
        with self._lock:
            items = sorted(self._pools.items())
        return [e for (t, _), e in items if caller is None or t == caller.tenant]

    def tenant_bytes(self, tenant: str) -> int:
        """Bytes of ``tenant``'s pools together (plain reads)."""
        return sum(e.pool.get_kv_size_bytes() for e in self.list() if e.tenant == tenant)

    def delete(self, caller: Caller, pool_id: str, *, force: bool = False,
               wanted: Callable[[], bool] = always) -> int:
        """Delete ``caller``'s pool; returns the bytes freed.

        The pool is marked deleted under its exclusive lock and leaves the registry after that lock
        is released (the registry's lock is never taken while a pool lock is held).

        Raises:
            NotFound: unknown pool.
            FailedPrecondition: slots are still allocated and ``force`` is false.
            Cancelled: ``wanted()`` is false once the pool's lock is held (the caller gave up while
                the call waited: nothing is deleted; attack pass 5, A5-7).
        """
        with self.locked(caller, pool_id, exclusive=True) as entry:
            still_wanted(wanted, "DeletePool")
            if entry.allocator.used_pages and not force:
                writing = entry.allocator.used_pages - int(entry.page_allocated.sum())
                held = f" ({writing} of them taken by writes still arriving)" if writing else ""
                if entry.claimed_pages:  # FreeSlots refuses these until the write ends
                    held += (f" ({entry.claimed_pages} of them being written in place by a WriteKV still arriving: "
                             f"wait for it to end)")
                raise FailedPrecondition(
                    f"pool {pool_id!r} still has {entry.allocator.used_pages} pages allocated{held}; free them or force")
            entry.deleted = True
            if entry.prefix_cache is not None:
                entry.prefix_cache.detach()  # else the tier stack kept the cache, and so the pool, alive
        for shm in entry.pool.shared_memory.values():
            shm.close_fd()  # no new attach; mappings (the daemon's, attached workers') keep the memory until gone
        with self._lock:
            if self._pools.get((caller.tenant, pool_id)) is entry:
                del self._pools[(caller.tenant, pool_id)]
        return entry.pool.get_kv_size_bytes()


def parse_hf_config(text: str) -> dict[str, Any]:
    """Parse the text of an HF config.json. Raises InvalidArgument (not JSON, NaN or Infinity, a
    number of more than 4300 digits, nested too deeply, not an object)."""
    try:
        return load_hf_config_text(text, "hf_config_json")
    except ValueError as e:
        raise InvalidArgument(str(e)) from None
