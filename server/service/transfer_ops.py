"""PD transfer on a daemon: the engine and its registrations, layouts, PullKV, ReadPages.

One :class:`TransferState` per daemon (built by the TransferService factory). With
``transfer_engine = "mooncake"`` it starts a Mooncake Transfer Engine on ``transfer_host`` and
registers a pool's buffers (one range per component arena, from its buffer infos) the first time
the pool takes part in a transfer; registrations of deleted pools are dropped on the next call
(the pool's memory stays referenced until then, so a registered range is never reused).

Locking: GetTransferLayout holds the source pool's lock shared; ReadPages copies each page run
under it and streams the copy without it; PullKV holds the destination pool's lock exclusive from
the destination checks until the bytes have moved (or the pages were freed after a failure), so
nothing else reads or writes that pool meanwhile. The engine's one-sided reads of a source pool
take no lock there: the caller must keep the source pages allocated and unchanged until PullKV returns.

Failure contract of PullKV: validation (mapping, destination pages allocated, layouts) happens
before any byte moves and leaves everything as it was. A failure while moving bytes frees the
destination pages -- they are never presented as valid -- and raises :class:`TransferError`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from kvtier.addresses import resolve_address
from kvtier.server.pool import slots_of_pages
from kvtier.server.service.errors import FailedPrecondition, InvalidArgument, NotFound
from kvtier.server.service.pools import PoolEntry, PoolRegistry
from kvtier.server.service.state import DaemonState
from kvtier.server.service.transfer_messages import COMPONENT_TO_PROTO, peer_layout
from kvtier.server.transfer import (
    DEFAULT_BATCH_ITEMS, MooncakeTransferEngine, MooncakeTransport, PageMappingError, PoolLayout,
    TransferEngineConfig, TransferError, TransferPlan, TransferStats, check_page_mapping, fail_batch_from_env,
    pages_from_slots, plan_pull, pool_layout, pull_pages, registration_ranges,
)
from kvtier.server.transfer.engine import check_injected_failure
from kvtier.server.transfer.pages import page_run
from kvtier.v1 import transfer_pb2, transfer_pb2_grpc

log = logging.getLogger("kvtier.transfer")

PEER_LAYOUT_TIMEOUT_S = 30.0
PEER_STREAM_TIMEOUT_S = 600.0


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

    def remaining(self, cap: float) -> float:
        """Seconds a peer call may take: ``cap``, or less when the deadline is nearer.

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
        return min(cap, left)


@dataclass(frozen=True)
class PullResult:
    stats: TransferStats
    transport: str
    seconds: float


def _write_bytes(dst: torch.Tensor, data: bytes) -> None:
    src = np.frombuffer(data, dtype=np.uint8)
    if dst.device.type == "cpu":
        dst.numpy()[:] = src
    else:
        dst.copy_(torch.from_numpy(src.copy()), non_blocking=False)


def _check_allocated(entry: PoolEntry, pages: np.ndarray, what: str) -> None:
    limit = entry.page_allocated.numel()
    if pages.size and int(pages.min()) < 0:
        raise InvalidArgument(f"{what} contains negative page {int(pages.min())}")
    if pages.size and int(pages.max()) >= limit:
        raise InvalidArgument(f"{what} contains page {int(pages.max())} outside pool {entry.pool_id!r} (pages 1..{limit - 1})")
    bad = pages[~entry.page_allocated[torch.from_numpy(pages)].numpy()]
    if bad.size:
        raise InvalidArgument(f"{what} contains page {int(bad[0])}, which is not allocated in pool {entry.pool_id!r}")


class GrpcPageTransport:
    """Fallback :class:`PageTransport`: each batch is one ReadPages stream from the peer daemon,
    written into the destination pool's pages as chunks arrive."""

    name = "grpc"

    def __init__(self, stub: transfer_pb2_grpc.TransferServiceStub, peer: str, peer_pool_id: str,
                 entry: PoolEntry, chunk_bytes: int, fail_batch: int | None, spec: PullSpec) -> None:
        self.stub, self.peer, self.peer_pool_id = stub, peer, peer_pool_id
        self.entry, self.chunk_bytes, self.fail_batch = entry, chunk_bytes, fail_batch
        self.spec = spec

    def pull(self, remote: PoolLayout, plan: TransferPlan) -> None:
        for b, batch in enumerate(plan.batches):
            check_injected_failure(self.fail_batch, b, "grpc")
            targets = [page_run(self.entry.pool, it.component, it.layer_id, it.dst_page, it.num_pages) for it in batch]
            got = [0] * len(batch)
            request = transfer_pb2.ReadPagesRequest(pool_id=self.peer_pool_id, chunk_bytes=self.chunk_bytes, runs=[
                transfer_pb2.PageRun(layer_id=it.layer_id, component=COMPONENT_TO_PROTO[it.component],
                                     first_page=it.src_page, num_pages=it.num_pages) for it in batch])
            try:
                for msg in self.stub.ReadPages(request, timeout=self.spec.remaining(PEER_STREAM_TIMEOUT_S)):
                    r, n = msg.run, len(msg.data)
                    if r >= len(batch) or msg.offset != got[r] or got[r] + n > batch[r].nbytes:
                        raise TransferError(f"grpc: ReadPages from {self.peer} sent an out-of-order chunk (run {r}, offset {msg.offset})", batch=b)
                    _write_bytes(targets[r][got[r]:got[r] + n], msg.data)
                    got[r] += n
            except grpc.RpcError as e:
                raise TransferError(f"grpc: ReadPages from {self.peer} failed in batch {b + 1} of {len(plan.batches)}: "
                                    f"{e.code().name}: {e.details()}", batch=b) from None
            short = [i for i, it in enumerate(batch) if got[i] != it.nbytes]
            if short:
                raise TransferError(f"grpc: ReadPages from {self.peer} ended early in batch {b + 1} "
                                    f"({got[short[0]]} of {batch[short[0]].nbytes} bytes of a run)", batch=b)


class TransferState:
    """The daemon's transfer side: engine, registrations, layouts, pulls and page streams.

    Raises:
        TransferEngineUnavailable: ``transfer_engine = "mooncake"`` but the engine cannot start.
    """

    def __init__(self, state: DaemonState) -> None:
        cfg = state.config
        self.pools: PoolRegistry = state.pools
        self.counters = state.counters
        self.grpc_options = cfg.grpc_options()
        self.chunk_bytes = cfg.chunk_bytes
        self.max_chunk_bytes = cfg.max_chunk_bytes
        self.fail_batch = fail_batch_from_env()
        self.engine: MooncakeTransferEngine | None = None
        if cfg.transfer_engine == "mooncake":
            self.engine = MooncakeTransferEngine(TransferEngineConfig(host=cfg.transfer_host, fail_batch=self.fail_batch))
            log.info("Mooncake Transfer Engine at %s", self.engine.endpoint)
        self._registered: dict[str, tuple[PoolEntry, list[tuple[int, int]]]] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()  # a dict lock only (level 1 of the daemon's order)
        self._lock = threading.Lock()

    # ----- registrations and layouts ------------------------------------------------------------
    def _registration(self, entry: PoolEntry) -> list[tuple[int, int]]:
        """Register ``entry``'s buffers once (dropping those of deleted pools first)."""
        assert self.engine is not None
        with self._lock:
            for pid, (old, ranges) in list(self._registered.items()):
                if old.deleted or (pid == entry.pool_id and old is not entry):
                    del self._registered[pid]
                    try:
                        self.engine.unregister(ranges)
                    except TransferError:
                        log.warning("could not unregister the buffers of deleted pool %r", pid, exc_info=True)
            if entry.pool_id not in self._registered:
                pool = entry.pool
                ranges = registration_ranges(pool.get_contiguous_buf_infos(), pool.get_state_buf_infos())
                self.engine.register(ranges)
                self._registered[entry.pool_id] = (entry, ranges)
            return self._registered[entry.pool_id][1]

    def layout(self, entry: PoolEntry) -> PoolLayout:
        """``entry``'s layout, naming the engine endpoint and registered ranges when there is an engine."""
        layout = pool_layout(entry.pool, entry.model.fingerprint())
        if self.engine is None:
            return layout
        return layout.with_engine(self.engine.endpoint, self._registration(entry))

    def transfer_layout(self, pool_id: str, check_pages: Sequence[int]) -> tuple[PoolEntry, PoolLayout]:
        """GetTransferLayout: the pool's layout; ``check_pages`` must be allocated (InvalidArgument)."""
        with self.pools.locked(pool_id, exclusive=False) as entry:
            if len(check_pages):
                try:
                    pages = np.asarray(list(check_pages), dtype=np.int64)
                except (TypeError, ValueError) as e:
                    raise InvalidArgument(f"check_pages: {e}") from None
                _check_allocated(entry, pages, "check_pages")
            return entry, self.layout(entry)

    # ----- pull (decode side) -------------------------------------------------------------------
    def _mapping(self, spec: PullSpec, page_size: int) -> tuple[np.ndarray, np.ndarray]:
        by_pages, by_slots = bool(len(spec.src_pages) or len(spec.dst_pages)), bool(len(spec.src_slots) or len(spec.dst_slots))
        if by_pages == by_slots:
            raise InvalidArgument("give the mapping either as src_pages/dst_pages or as src_slots/dst_slots")
        if by_pages:
            return check_page_mapping(list(spec.src_pages), list(spec.dst_pages))
        return pages_from_slots(list(spec.src_slots), list(spec.dst_slots), page_size)

    def pull(self, spec: PullSpec) -> PullResult:
        """PullKV: move pages of the peer's pool onto this daemon's pool (module docstring).

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
        page_size = self.pools.get(spec.pool_id).page_size
        src, dst = self._mapping(spec, page_size)
        try:
            address = resolve_address(spec.peer_address)
        except ValueError as e:
            raise InvalidArgument(f"peer_address: {e}") from None
        # one channel per peer, kept (a new connection per pull cost more than the layout call)
        stub = transfer_pb2_grpc.TransferServiceStub(self._channel(address))
        remote = self._peer_layout(stub, address, spec.peer_pool_id, src, spec)
        if spec.transport == "mooncake" and not remote.endpoint:
            raise FailedPrecondition(f"peer {address} runs without a transfer engine; use transport 'grpc'")
        with self.pools.locked(spec.pool_id, exclusive=True) as entry:
            _check_allocated(entry, dst, "destination pages")
            # a failed pull frees its destination pages: they must be the caller's to free
            entry.check_client_owned(dst, "destination pages")
            local = self.layout(entry)
            if local.latent[0] == remote.latent[0]:
                raise InvalidArgument(f"pool {spec.pool_id!r} would pull from itself; use MoveKV to copy pages within a pool")
            plan = plan_pull(local, remote, src, dst, max_batch_items=batch_items)
            transport = (MooncakeTransport(self.engine) if spec.transport == "mooncake" and self.engine
                         else GrpcPageTransport(stub, address, spec.peer_pool_id, entry, self.chunk_bytes,
                                                self.fail_batch, spec))
            start = time.perf_counter()
            try:
                stats = pull_pages(transport, remote, plan)
            except Exception as e:
                freed = entry.free(slots_of_pages(torch.from_numpy(dst), entry.page_size))
                self.counters.add("pulls_failed")
                raise TransferError(f"pull from {address} pool {spec.peer_pool_id!r} failed; the {freed} destination "
                                    f"pages {dst.tolist()[:16]} were freed: {e}") from e
            seconds = time.perf_counter() - start
        self.counters.add("pulls")
        self.counters.add("pull_bytes", stats.total_bytes)
        return PullResult(stats, spec.transport, seconds)

    def _channel(self, address: str) -> grpc.Channel:
        """The channel to peer ``address``, opened on first use and kept (gRPC reconnects by itself
        when the peer restarts); closed by :meth:`close`."""
        with self._channels_lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = grpc.insecure_channel(address, options=self.grpc_options)
            return ch

    def _peer_layout(self, stub: transfer_pb2_grpc.TransferServiceStub, address: str, pool_id: str,
                     src: np.ndarray, spec: PullSpec) -> PoolLayout:
        request = transfer_pb2.TransferLayoutRequest(pool_id=pool_id, check_pages=src.tolist())
        try:
            msg = stub.GetTransferLayout(request, timeout=spec.remaining(PEER_LAYOUT_TIMEOUT_S))
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
            if code == grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"peer {address}: {details}") from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(f"peer {address}: {details}") from None
            raise TransferError(f"peer {address} GetTransferLayout failed: {code.name}: {details}") from None
        return peer_layout(msg)

    # ----- page streams (source side of the gRPC fallback) --------------------------------------
    def read_pages(self, pool_id: str, runs: Sequence[tuple[int, str, int, int]], chunk_bytes: int) -> Iterator[tuple[int, int, bytes]]:
        """ReadPages: ``(run index, offset, data)`` chunks of each ``(layer, component, first_page, num_pages)`` run.

        Every run is checked (layer, component, page range, pages allocated) before the first chunk.

        Raises:
            InvalidArgument/PageMappingError: a bad run or chunk size.
        """
        chunk = chunk_bytes or self.chunk_bytes
        if chunk > self.max_chunk_bytes:
            raise InvalidArgument(f"chunk_bytes {chunk} exceeds {self.max_chunk_bytes} (max_message_bytes less chunk overhead)")
        if not runs:
            raise PageMappingError("ReadPages needs at least one page run")
        with self.pools.locked(pool_id, exclusive=False) as entry:
            for layer, comp, first, n in runs:
                page_run(entry.pool, comp, layer, first, n)
                _check_allocated(entry, np.arange(first, first + n, dtype=np.int64), f"run of layer {layer} {comp}")
        for i, (layer, comp, first, n) in enumerate(runs):
            with self.pools.locked(pool_id, exclusive=False) as entry:  # a consistent copy of the run...
                view = page_run(entry.pool, comp, layer, first, n)
                pieces = [view[off:off + chunk].cpu().numpy().tobytes() for off in range(0, view.numel(), chunk)]
            for k, data in enumerate(pieces):  # ...streamed without holding the lock
                yield i, k * chunk, data

    def close(self) -> None:
        """Close the peer channels and drop every registration (at shutdown)."""
        with self._channels_lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()
        if self.engine is None:
            return
        with self._lock:
            for pid, (_, ranges) in self._registered.items():
                try:
                    self.engine.unregister(ranges)
                except TransferError:
                    log.warning("could not unregister the buffers of pool %r at shutdown", pid, exc_info=True)
            self._registered.clear()
