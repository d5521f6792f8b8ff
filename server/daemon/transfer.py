"""PD transfer on a daemon, the domain half: the engine and its registrations, layouts, PullKV, ReadPages.

One :class:`TransferState` per daemon (``Daemon.transfer``). With an engine, the daemon's host arena is
registered once as one range (:attr:`TransferState.host_range`: host-tier records and pools' host
copies live there), so a peer's engine can read a record held in the host tier by its address. The
peer daemon is reached through a
:class:`PeerConnector` the caller passes in (the gRPC one lives in ``kvtier.server.service.transfer_peer``),
so nothing here imports grpc. With
``transfer_engine = "mooncake"`` it starts a Mooncake Transfer Engine on ``transfer_host`` and
registers a pool's buffers (one range per component arena, from its buffer infos) the first time
the pool takes part in a transfer; registrations of deleted pools are dropped on the next call
(the pool's memory stays referenced until then, so a registered range is never reused).

Locking: GetTransferLayout holds the source pool's lock shared; ReadPages copies each page run
under it and streams the copy without it; PullKV holds the destination pool's lock exclusive from
the destination checks until the bytes have moved (or the pages were freed after a failure), so
nothing else reads or writes that pool meanwhile. The engine's one-sided reads of a source pool
take no lock there.

Whole pages (attack pass F4): a pull delivers every page as it was at one moment, all its layers
from one write, or fails. The source side does not hold its pages for the pull (a prefill daemon's
writes and frees never wait for a decode daemon); it proves afterwards that they did not change.
Every page has a write generation (:attr:`PoolEntry.page_gen`, renewed by each write, free and
allocation through the daemon). The layout answer carries the source pages' generations; a
ReadPages stream names them (and the daemon id they come from) and copies each run only if its
pages still have them, under the lock of the copy; a Mooncake pull asks for them again once the
engine has read the bytes. A page whose generation changed fails the pull ABORTED
(:class:`~kvtier.server.transfer.PageChanged`) with its destination pages freed; it is not retried,
since a page freed and allocated again holds another request's KV. A pull whose peer is this daemon
copies every page under one shared lock (:meth:`TransferState._snapshot`), whole by construction.
A peer that predates generations sends none and gets no check.

A pull whose peer is this daemon (its bound address, :attr:`TransferState.own_addresses`, or any
address whose layout answer carries this daemon's :attr:`TransferState.daemon_id`) copies in process
(``server/transfer/local.py``): the source pages are copied out under the source pool's shared lock
alone, then written under the destination pool's exclusive lock alone, so it never waits for a
ReadPages thread of its own and never holds two pool locks; its result's transport is ``local``.

Which peers a pull may name: the daemon connects to a peer with its own privileges, on behalf of a
caller who may not be able to reach that peer itself (a confused deputy). A unix-socket peer is
refused (FailedPrecondition) unless it is this daemon's own bound address or one the operator listed
(``pd_peers``, ``--pd-peers``: same-machine PD pairs on unix sockets): a unix socket is reached
through file permissions (a 0700 directory, a 0600 socket) that this daemon, often another user or
root, would bypass for the caller, and a daemon behind such a socket may serve without tokens because
those permissions are its access control. A TCP peer is allowed: its access control is who can reach
its port, and it is asked with the caller's own token (a peer with tokens serves that token's tenant
only). A TCP peer without tokens serves whoever reaches its port, this daemon included, so a caller
of this daemon reaches it through a pull even from a host that cannot reach it directly: give
networked peers tokens (docs/operations/security.md, "PD peers").

Failure contract of PullKV: validation (mapping, destination pages allocated, layouts) happens
before any byte moves and leaves everything as it was. A failure while moving bytes frees the
destination pages -- they are never presented as valid -- and raises :class:`TransferError`.
Never because the caller left (cancelled, past its deadline: told it failed, it still holds its
pages; attack pass 8, A8-10): the caller is checked once the destination lock is held, before
anything changes (Cancelled). The gRPC transport asks the caller between batches and may stop part
way when it is gone: the rows it replaces are copied first and written back then (Cancelled, the
pages as they were), unless the pages were not written since their allocation (nothing to put
back). The engine's read (Mooncake) and its final page check, bounded by :data:`FINAL_CHECK_S` of
its own, do not stop for the caller; no rows are copied (that copy halved a pull against the raw
engine read). If that read or check fails after the caller left, the pages stay allocated to it
and the answer (Cancelled) says they hold partly pulled rows: the one failed PullKV that leaves its
destination changed, a source page having changed during the read as well.
Destination pages pass :meth:`PoolEntry.check_writable` like every write: the caller's own pages or
fresh pages of its own prefix lease (a decode side receiving the pages its LoadPrefix did not
find); after a failure the latter leave the lease, freed, and the lease stays open.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import torch

from kvtier.addresses import is_unix, resolve_address, socket_path
from kvtier.server.daemon.errors import Cancelled, FailedPrecondition, InvalidArgument, KVTierError, still_wanted
from kvtier.server.daemon.kv_ops import chunk_size
from kvtier.server.daemon.pools import PoolEntry, PoolRegistry
from kvtier.server.daemon.tenants import Caller
from kvtier.server.pool import slots_of_pages
from kvtier.server.transfer import (
    DEFAULT_BATCH_ITEMS, MooncakeTransferEngine, MooncakeTransport, PageChanged, PageTransport, PoolLayout,
    TransferEngineConfig, TransferError, TransferStats, check_page_mapping, fail_batch_from_env,
    pages_from_slots, plan_pull, pool_layout, pull_pages, registration_ranges,
)
from kvtier.server.daemon.transfer_source import Expected, check_allocated, read_pages
from kvtier.server.transfer.local import LocalTransport, PageSnapshot

if TYPE_CHECKING:
    from kvtier.server.daemon.core import Daemon

log = logging.getLogger("kvtier.transfer")

PEER_LAYOUT_TIMEOUT_S = 30.0
PEER_STREAM_TIMEOUT_S = 600.0
MAX_PEER_LAYOUTS = 1024  # peers' pool layouts kept (the oldest goes first)


#: Seconds the peer has to answer a Mooncake pull's final page check (its own bound, not the caller's).
FINAL_CHECK_S = 5.0

@dataclass(frozen=True)
class PullSpec:
    """A PullKV request in domain form (exactly one of the page and the slot mapping)."""

    pool_id: str
    peer_address: str
    peer_pool_id: str
    src_pages: Sequence[int] = ()
    dst_pages: Sequence[int] = ()
    src_slots: Sequence[int] = ()
    dst_slots: Sequence[int] = ()
    transport: str = "mooncake"
    max_batch_items: int = 0
    deadline: float | None = None
    """``time.monotonic()`` by which the caller gives up (its gRPC deadline); None: no deadline.
    Peer calls are bounded by it and no batch starts after it, so a stalled peer cannot hold the
    destination pool past the caller's deadline."""
    is_active: Callable[[], bool] = lambda: True
    """False once the caller has cancelled (checked before every batch)."""

    def wanted(self) -> bool:
        """Whether the caller is still there: not cancelled, its deadline not passed (the
        ``still_wanted`` check of a pull)."""
        return self.is_active() and (self.deadline is None or time.monotonic() < self.deadline)

    def remaining(self, cap: float) -> float:
        """Seconds a peer call may take: ``cap``, or less when the deadline is nearer (less a margin
        of a tenth of the time left, at most 0.25 s, so the pull can answer before its caller's deadline).

        Raises:
            TransferError: the deadline has passed or the caller cancelled.
        """
        if not self.is_active():
            raise TransferError("the PullKV call was cancelled by its caller")
        if self.deadline is None:
            return cap
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TransferError("the PullKV call's deadline passed")
        # keep a margin (a tenth, at most 0.25 s) so a peer that does not answer is named to the caller
        # before the caller's own deadline turns the answer into a bare DEADLINE_EXCEEDED
        return min(cap, left - min(0.25, left / 10))


@dataclass(frozen=True)
class PullResult:
    stats: TransferStats
    transport: str
    seconds: float


def _free_destination(entry: PoolEntry, dst: np.ndarray, owner: int) -> int:
    """Free a failed pull's destination pages (pool lock held exclusive; they passed
    :meth:`PoolEntry.check_writable` as ``owner``): the caller's own pages through the pool, fresh
    pages of its prefix leases through the cache, which takes them out of the lease (so StorePrefix
    can never hand their half-moved bytes to the cache). Returns the pages freed."""
    pages = torch.from_numpy(dst)
    leased = entry.cache_owned[pages]
    freed = 0
    if bool((~leased).any()):
        freed += entry.free(slots_of_pages(pages[~leased], entry.page_size), owner)
    if bool(leased.any()) and entry.prefix_cache is not None:
        freed += entry.prefix_cache.drop_fresh(pages[leased].tolist())
    return freed


class PeerLayout(NamedTuple):
    """A peer's layout answer: its digest, the layout (None: ``known_digest`` still holds), the peer
    daemon's id and the write generations of the pages it checked, in their order (``""`` and
    ``[]`` from a peer that predates them)."""

    digest: str
    layout: PoolLayout | None
    daemon_id: str
    generations: list[int]


class PeerLink(Protocol):
    """One open connection to a peer daemon (a PullKV's source)."""

    def layout(self, pool_id: str, check_pages: list[int], spec: PullSpec, known_digest: str = "") -> PeerLayout:
        """The peer pool's layout answer; ``check_pages`` must be allocated there. Bounded by
        ``spec.remaining``. When ``known_digest`` (the digest of a layout the caller holds) still
        holds, the layout is None (the peer did not send it again).

        Raises:
            NotFound / InvalidArgument: the peer's answer (unknown pool, unallocated pages).
            Busy: the peer's pages are being written (a WriteKV still arriving); nothing moved.
            TransferError: the peer could not be asked.
        """

    def page_transport(self, entry: PoolEntry, chunk_bytes: int, fail_batch: int | None, spec: PullSpec,
                       expect: Mapping[int, int], daemon_id: str) -> PageTransport:
        """A transport that streams page runs from the peer into ``entry``'s pool (the fallback
        without an engine); each stream asks the peer (``daemon_id``) to send a page only while it
        has the write generation ``expect`` gives it (empty: no check)."""


class PeerConnector(Protocol):
    """Opens :class:`PeerLink` s to peer daemons by address."""

    def connect(self, address: str, caller: Caller) -> AbstractContextManager[PeerLink]:
        """A link to the daemon at ``address`` (``unix:///path`` or ``HOST:PORT``) on behalf of
        ``caller`` (whose credentials the link presents), closed on exit."""


class TransferState:
    """The daemon's transfer side: engine, registrations, layouts, pulls and page streams.

    Raises:
        TransferEngineUnavailable: ``transfer_engine = "mooncake"`` but the engine cannot start.
    """

    def __init__(self, state: Daemon) -> None:
        cfg = state.config
        self.pools: PoolRegistry = state.pools
        self.counters = state.counters
        self.chunk_bytes = cfg.chunk_bytes
        self.max_chunk_bytes = cfg.max_chunk_bytes
        self.fail_batch = fail_batch_from_env()
        self.engine: MooncakeTransferEngine | None = None
        if cfg.transfer_engine == "mooncake":
            self.engine = MooncakeTransferEngine(TransferEngineConfig(host=cfg.transfer_host, fail_batch=self.fail_batch))
            log.info("Mooncake Transfer Engine at %s", self.engine.endpoint)
            log.warning("the Mooncake Transfer Engine's ports listen on every interface and serve reads and "
                        "writes of this process's memory to whoever connects, without authentication: run it "
                        "only where every host and local user that can reach them is trusted (README, Security)")
        self.daemon_id = secrets.token_hex(16)
        """This daemon process's id, sent with every layout: a pull that meets it copies in process."""
        self.pd_peers = frozenset(cfg.pd_peers)
        """Unix-socket peers the operator listed (``--pd-peers``): a pull may name them too."""
        self.own_addresses: set[str] = set()
        """The addresses this daemon is bound to (``create_server`` adds them), which no other process
        can hold while it lives: a pull naming one makes no gRPC call at all. Other spellings of this
        daemon (another host name, a symlink to its socket) are recognised by :attr:`daemon_id` in the
        layout answer, on every pull (never remembered: what an address reaches can change). Plain
        set operations (atomic), nothing held around them."""
        self._registered: dict[tuple[str, str], tuple[PoolEntry, list[tuple[int, int]]]] = {}  # (tenant, pool id)
        self._lock = threading.Lock()
        # Layouts, so a pull does not build (here) or send (by the peer) a layout that has not changed:
        # this daemon's pools by (tenant, pool id), with the entry they describe (a re-created pool is
        # another entry); peers' pools by (peer address, tenant, peer pool id), checked against the
        # peer's digest on every pull. Plain dict operations (atomic), nothing held around them.
        self._layouts: dict[tuple[str, str], tuple[PoolEntry, PoolLayout, str]] = {}
        self._peer_layouts: dict[tuple[str, str, str], tuple[str, PoolLayout]] = {}
        # The daemon's host arena (host-tier records, pools' host copies) as one registered range, so a
        # peer's engine can read pages held in the host tier as it reads pool pages.
        self.host_range: tuple[int, int] | None = None
        arena = state.pools.host_arena
        if self.engine is not None and arena is not None:
            self.host_range = arena.registration_range()
            self.engine.register([self.host_range])

    # ----- registrations and layouts ------------------------------------------------------------
    def _registration(self, entry: PoolEntry) -> list[tuple[int, int]]:
        """Register ``entry``'s buffers once (dropping those of deleted pools first)."""
        assert self.engine is not None
        with self._lock:
            key = (entry.tenant, entry.pool_id)
            for pid, (old, ranges) in list(self._registered.items()):
                if old.deleted or (pid == key and old is not entry):
                    del self._registered[pid]
                    try:
                        self.engine.unregister(ranges)
                    except TransferError:
                        log.warning("could not unregister the buffers of deleted pool %r", pid[1], exc_info=True)
            if key not in self._registered:
                pool = entry.pool
                ranges = registration_ranges(pool.get_contiguous_buf_infos(), pool.get_state_buf_infos())
                self.engine.register(ranges)
                self._registered[key] = (entry, ranges)
            return self._registered[key][1]

    def layout(self, entry: PoolEntry) -> PoolLayout:
        """``entry``'s layout, naming the engine endpoint and registered ranges when there is an engine."""
        return self._layout_of(entry)[0]

    def _layout_of(self, entry: PoolEntry) -> tuple[PoolLayout, str]:
        """``entry``'s layout and its digest, built once per pool (buffers and registrations do not
        change while a pool lives); layouts of deleted pools are dropped on the way."""
        ranges = self._registration(entry) if self.engine is not None else None  # also drops deleted pools' ones
        for k, (old, _, _) in list(self._layouts.items()):
            if old.deleted:
                self._layouts.pop(k, None)
        key = (entry.tenant, entry.pool_id)
        got = self._layouts.get(key)
        if got is not None and got[0] is entry:
            return got[1], got[2]
        layout = pool_layout(entry.pool, entry.model.fingerprint())
        if ranges is not None:
            layout = layout.with_engine(self.engine.endpoint, ranges)  # type: ignore[union-attr]
        digest = layout.digest()
        self._layouts[key] = (entry, layout, digest)
        return layout, digest

    def transfer_layout(self, caller: Caller, pool_id: str, check_pages: Sequence[int],
                        known_digest: str = "") -> tuple[PoolEntry, PoolLayout | None, str, list[int]]:
        """GetTransferLayout: ``caller``'s pool's layout (raw addresses: the owner only; another
        tenant's pool is NOT_FOUND), its digest and the write generations of ``check_pages`` (in
        their order); the layout is None when it is ``known_digest`` (the caller holds it).
        ``check_pages`` must be allocated (InvalidArgument) and not being written (Busy), every call."""
        with self.pools.locked(caller, pool_id, exclusive=False) as entry:
            generations: list[int] = []
            if len(check_pages):
                try:
                    pages = np.asarray(list(check_pages), dtype=np.int64)
                except (TypeError, ValueError) as e:
                    raise InvalidArgument(f"source pages (check_pages): {e}") from None
                check_allocated(entry, pages, "source pages (check_pages)")
                generations = entry.generations(pages)
            layout, digest = self._layout_of(entry)
            return entry, (None if known_digest and known_digest == digest else layout), digest, generations

    def _peer_layout(self, peer: PeerLink, address: str, caller: Caller, spec: PullSpec,
                     src: np.ndarray) -> tuple[PoolLayout, str, dict[int, int]]:
        """The peer pool's layout for a pull, the peer daemon's id and the write generations of the
        ``src`` pages (empty from a peer that predates them): the layout held from an earlier pull
        when the peer's digest says it still holds (the peer checks ``src`` and the caller's token
        either way)."""
        key = (address, caller.tenant, spec.peer_pool_id)
        known = self._peer_layouts.get(key)
        ans = peer.layout(spec.peer_pool_id, src.tolist(), spec, known[0] if known else "")
        if ans.generations and len(ans.generations) != src.size:
            raise TransferError(f"peer {address} answered {len(ans.generations)} page generations for {src.size} pages")
        expect = dict(zip(src.tolist(), ans.generations))
        return self._remember(key, address, ans.digest, ans.layout, known), ans.daemon_id, expect

    def _check_unchanged(self, peer: PeerLink, address: str, caller: Caller, spec: PullSpec, src: np.ndarray,
                         expect: Mapping[int, int], peer_id: str) -> None:
        """After an engine read: raise :class:`PageChanged` unless every ``src`` page of the peer
        still has the generation ``expect`` gives it (same daemon, still allocated, not being
        written), so none changed while the engine read it."""
        known = self._peer_layouts.get((address, caller.tenant, spec.peer_pool_id))
        # bounded by its own time, not the caller's: the bytes are here already, and a check stopped
        # because the caller left would leave the pages neither old nor checked
        bounded = dataclasses.replace(spec, is_active=lambda: True, deadline=time.monotonic() + FINAL_CHECK_S)
        try:
            ans = peer.layout(spec.peer_pool_id, src.tolist(), bounded, known[0] if known else "")
        except KVTierError as e:  # freed (InvalidArgument), being written (Busy), pool gone (NotFound)
            raise PageChanged(f"the source pages changed while the engine read them: {e}") from None
        if ans.daemon_id != peer_id:
            raise PageChanged(f"peer {address} restarted while the engine read the source pages")
        for page, gen in zip(src.tolist(), ans.generations):
            if expect.get(page) != gen:
                raise PageChanged(f"source page {page} of peer pool {spec.peer_pool_id!r} changed (written, freed or "
                                  f"allocated again) while the engine read it; a page is never delivered with layers "
                                  f"of two writes: keep the source pages allocated and unchanged until the pull "
                                  f"returns, then pull again")

    def _remember(self, key: tuple[str, str, str], address: str, digest: str, remote: PoolLayout | None,
                  known: tuple[str, PoolLayout] | None) -> PoolLayout:
        if remote is None:
            if known is None or digest != known[0]:
                raise TransferError(f"peer {address} answered 'unchanged' for a layout this daemon does not hold")
            return known[1]
        if digest:
            if len(self._peer_layouts) >= MAX_PEER_LAYOUTS:
                self._peer_layouts.pop(next(iter(self._peer_layouts)), None)
            self._peer_layouts[key] = (digest, remote)
        return remote

    # ----- pull (decode side) -------------------------------------------------------------------
    def _names_own_socket(self, address: str) -> bool:
        """Whether the unix socket ``address`` names is this daemon's own, by another spelling (a
        symlink, ``..``): the same file as one of :attr:`own_addresses`. Such a pull copies in process
        too; asking itself over gRPC it would wait for a worker thread of its own daemon, and with
        every worker held by pulls it waited out its deadline (attack pass 7, A7-10)."""
        if not is_unix(address):
            return False
        try:
            st = os.stat(socket_path(address))
        except (OSError, ValueError):
            return False
        for own in list(self.own_addresses):
            if not is_unix(own):
                continue
            try:
                mine = os.stat(socket_path(own))
            except (OSError, ValueError):
                continue
            if (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino):
                return True
        return False

    def _mapping(self, spec: PullSpec, page_size: int) -> tuple[np.ndarray, np.ndarray]:
        by_pages, by_slots = bool(len(spec.src_pages) or len(spec.dst_pages)), bool(len(spec.src_slots) or len(spec.dst_slots))
        if by_pages == by_slots:
            raise InvalidArgument("give the mapping either as src_pages/dst_pages or as src_slots/dst_slots")
        if by_pages:
            return check_page_mapping(list(spec.src_pages), list(spec.dst_pages))
        return pages_from_slots(list(spec.src_slots), list(spec.dst_slots), page_size)

    def pull(self, caller: Caller, spec: PullSpec, peers: PeerConnector) -> PullResult:
        """PullKV: move pages of the peer's pool onto ``caller``'s pool (module docstring); the peer
        is reached through ``peers`` with ``caller``'s credentials (its tenant there is the token's).

        Raises:
            InvalidArgument/PageMappingError: bad mapping, unknown transport, destination pages not allocated.
            NotFound: unknown local pool, or the peer does not know ``peer_pool_id``.
            FailedPrecondition: transport "mooncake" without an engine here or on the peer.
            LayoutMismatchError: the layouts differ (nothing moved).
            TransferError: moving failed; the destination pages were freed.
        """
        if spec.transport not in ("mooncake", "grpc"):
            raise InvalidArgument(f"transport must be 'mooncake' or 'grpc', got {spec.transport!r}")
        if spec.transport == "mooncake" and self.engine is None:
            raise FailedPrecondition("this daemon runs without a transfer engine (--transfer-engine none); use transport 'grpc'")
        batch_items = spec.max_batch_items or DEFAULT_BATCH_ITEMS
        page_size = self.pools.get(caller, spec.pool_id).page_size
        src, dst = self._mapping(spec, page_size)
        if not spec.peer_address:
            raise InvalidArgument("peer_address is empty: give the prefill daemon's address (unix:///path or HOST:PORT)")
        try:
            address = resolve_address(spec.peer_address)
        except ValueError as e:
            raise InvalidArgument(f"peer_address: {e}") from None
        from_self = address in self.own_addresses or self._names_own_socket(address)
        if is_unix(address) and not from_self and address not in self.pd_peers:
            raise FailedPrecondition(f"peer {address} is a unix socket and not this daemon's own address: unix-socket "
                                     f"peers are this machine's private daemons, whose file permissions this daemon "
                                     f"would bypass; reach PD peers over TCP (HOST:PORT), or list it in the daemon's --pd-peers")
        with nullcontext(None) if from_self else peers.connect(address, caller) as peer:
            snapshot: PageSnapshot | None = None
            expect: dict[int, int] = {}
            peer_id = ""
            if not from_self:
                remote, peer_id, expect = self._peer_layout(peer, address, caller, spec, src)
                from_self = bool(peer_id) and peer_id == self.daemon_id
            if from_self:  # the peer is this daemon: copy in process, never wait for a thread of its own
                if spec.peer_pool_id == spec.pool_id:  # the same tenant's pool of the same id: the same pool
                    raise InvalidArgument(f"pool {spec.pool_id!r} would pull from itself; use MoveKV to copy pages "
                                          f"within a pool")
                remote, snapshot = self._snapshot(caller, spec.peer_pool_id, src, expect)
            elif spec.transport == "mooncake" and not remote.endpoint:
                raise FailedPrecondition(f"peer {address} runs without a transfer engine; use transport 'grpc'")
            with self.pools.locked(caller, spec.pool_id, exclusive=True) as entry:
                check_allocated(entry, dst, "destination pages")
                owner = entry.owner_of(caller)
                # the caller's own pages, or fresh pages of its own prefix lease (a decode side that
                # leased its prompt's pages and receives the missing ones): freed if the pull fails
                entry.check_writable(dst, owner, "destination pages")
                local = self.layout(entry)
                if local.latent[0] == remote.latent[0]:
                    raise InvalidArgument(f"pool {spec.pool_id!r} would pull from itself; use MoveKV to copy pages within a pool")
                plan = plan_pull(local, remote, src, dst, max_batch_items=batch_items)
                transport: PageTransport
                if snapshot is not None:
                    transport = LocalTransport(entry.pool, snapshot)
                elif spec.transport == "mooncake" and self.engine:
                    transport = MooncakeTransport(self.engine)
                else:
                    assert peer is not None  # not this daemon: a link to the peer is open
                    transport = peer.page_transport(entry, self.chunk_bytes, self.fail_batch, spec, expect, peer_id)
                # a caller that gave up while the pull waited for the destination pool was told it
                # failed: nothing may change then, its pages stay its own as they are (A8-10)
                still_wanted(spec.wanted, "PullKV")
                # the gRPC transport asks the caller between batches and may stop part way because the
                # caller left: the rows it replaces are kept to be written back then. Pages not written
                # since their allocation (a decode side's fresh slots, the usual destination) hold
                # nothing to put back. The engine's read (Mooncake) is one read, and its final check does
                # not stop for the caller: it keeps no rows (a copy of the destination halved the pull
                # against the raw engine read), and a copy in process never stops
                unwritten = entry.unwritten(dst)
                keep = snapshot is None and transport.name != "mooncake" and not unwritten
                dst_slots = slots_of_pages(torch.from_numpy(dst), entry.page_size) if keep else None
                undo = entry.pool.get_cpu_copy(dst_slots) if keep else None
                start = time.perf_counter()
                entry.changed(dst)  # their bytes change from here on (whole, old again, or freed on failure)
                try:
                    stats = pull_pages(transport, remote, plan)
                    if transport.name == "mooncake" and expect:  # the engine read without the peer's lock
                        self._check_unchanged(peer, address, caller, spec, src, expect, peer_id)
                except Exception as e:
                    self.counters.add(caller, "pulls_failed")
                    if not spec.wanted() and snapshot is None:  # the caller left: never free its pages for that
                        if undo is not None:
                            entry.pool.load_cpu_copy(undo, dst_slots)
                            raise Cancelled("the PullKV was cancelled or ran past its deadline while its pages moved; "
                                            "the destination pages hold their old bytes again; nothing was changed") from e
                        if unwritten:
                            raise Cancelled("the PullKV was cancelled or ran past its deadline while its pages moved; "
                                            "the destination pages, never written since they were allocated, stay "
                                            "allocated (their bytes were undefined and still are); nothing was "
                                            "changed") from e
                        raise Cancelled(f"the PullKV's engine read failed after its caller left ({e}); the destination "
                                        f"pages stay allocated to it but hold partly pulled rows: write or pull them "
                                        f"again before reading them") from e
                    freed = _free_destination(entry, dst, owner)
                    raise TransferError(f"pull from {address} pool {spec.peer_pool_id!r} failed; the {freed} destination "
                                        f"pages {dst.tolist()[:16]} were freed (a prefix lease's fresh pages among "
                                        f"them left the lease): {e}") from e
                seconds = time.perf_counter() - start
        self.counters.add(caller, "pulls")
        self.counters.add(caller, "pull_bytes", stats.total_bytes)
        return PullResult(stats, transport.name, seconds)

    def _snapshot(self, caller: Caller, pool_id: str, src: np.ndarray,
                  expect: Mapping[int, int]) -> tuple[PoolLayout, PageSnapshot]:
        """The layout of ``caller``'s pool ``pool_id`` here and a copy of its pages ``src``, taken
        under its shared lock alone (the source side of a pull from this daemon; the checks are a
        layout fetch's: pages allocated, none being written): every page whole, as it was at one
        moment. With ``expect`` (the generations of a layout answer this daemon gave the pull over
        another of its addresses), the pages as they were then, or PageChanged.

        Raises:
            NotFound: no such pool. InvalidArgument: a page not allocated or out of range.
            Busy: a WriteKV is landing on a page (nothing moved; retry).
            PageChanged: a page changed since the layout answer.
            MemoryError: no memory for the copy.
        """
        with self.pools.locked(caller, pool_id, exclusive=False) as entry:
            check_allocated(entry, src, "source pages")  # in range, allocated, not being written
            if expect:
                Expected.from_request(list(expect), list(expect.values())).check(entry, src, "source pages")
            return self.layout(entry), PageSnapshot.take(entry.pool, src)

    # ----- page streams (source side of the gRPC fallback) --------------------------------------
    def read_pages(self, caller: Caller, pool_id: str, runs: Sequence[tuple[int, str, int, int]],
                   chunk_bytes: int, expect_pages: Sequence[int] = (), expect_generations: Sequence[int] = (),
                   expect_daemon: str = "") -> Iterator[tuple[int, int, bytes]]:
        """ReadPages: :func:`~kvtier.server.daemon.transfer_source.read_pages` of this daemon's pools
        (the generations must come from this daemon process, ``expect_daemon``, when given)."""
        chunk = chunk_size(chunk_bytes, self.chunk_bytes, self.max_chunk_bytes)
        expect = Expected.from_request(expect_pages, expect_generations)
        if expect is not None and expect_daemon and expect_daemon != self.daemon_id:
            raise PageChanged("ReadPages: the page generations come from another daemon process (the peer restarted "
                              "since the pull read its layout); pull again")
        return read_pages(self.pools, caller, pool_id, runs, chunk, expect)

    def close(self) -> None:
        """Drop every registration (at shutdown)."""
        if self.engine is None:
            return
        if self.host_range is not None:
            try:
                self.engine.unregister([self.host_range])
            except TransferError:
                log.warning("could not unregister the host arena at shutdown", exc_info=True)
            self.host_range = None
        with self._lock:
            for pid, (_, ranges) in self._registered.items():
                try:
                    self.engine.unregister(ranges)
                except TransferError:
                    log.warning("could not unregister the buffers of pool %r at shutdown", pid[1], exc_info=True)
            self._registered.clear()
