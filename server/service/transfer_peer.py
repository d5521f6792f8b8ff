"""The gRPC side of PullKV: reaching a peer daemon's TransferService (layout, ReadPages streams).

Implements the domain's :class:`~kvtier.server.daemon.transfer.PeerConnector`: the domain decides
what to move; this module only asks the peer over gRPC and writes the bytes a ReadPages stream
brings into the destination pool's pages. Peer errors become the daemon's typed errors (the peer's
NOT_FOUND / INVALID_ARGUMENT stay what they are, an UNAVAILABLE that changed nothing, such as source
pages a write is landing on or a layout fetch from a peer that is down, is :class:`Busy`; anything
else is a :class:`TransferError`).

Credentials: PullKV presents the *caller's* bearer token to the peer (``authorization: Bearer``), so
the peer serves the pool of the tenant that token names there (run both daemons with the same
tokens file for PD pairs). With ``peer_tls_ca`` set, peers are reached over TLS checked against that
CA, and the daemon's own ``tls_cert``/``tls_key`` are its client certificate (for peers that require
mutual TLS). Without it, peers are reached in plaintext, and a token is sent only to a unix-socket
peer (else FAILED_PRECONDITION: a bearer token never crosses a network in the clear, and a TCP port,
loopback included, has no owner: another local user could take it, or take over the channel's
reconnect, and receive the token; attack pass 6, A6-1).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import grpc
import numpy as np
import torch

from kvtier.addresses import UnsafeSocketError, check_socket_path, is_unix, socket_path
from kvtier.server.daemon.config import DaemonConfig
from kvtier.server.daemon.errors import RETRY_UNCHANGED, Busy, FailedPrecondition, InvalidArgument, NotFound
from kvtier.server.daemon.pools import PoolEntry
from kvtier.server.daemon.private_files import read_tls_files
from kvtier.server.daemon.tenants import Caller
from kvtier.server.daemon.transfer import PEER_LAYOUT_TIMEOUT_S, PEER_STREAM_TIMEOUT_S, PeerLayout, PullSpec
from kvtier.server.service.transfer_messages import COMPONENT_TO_PROTO, peer_layout
from kvtier.server.transfer import PageTransport, PoolLayout, TransferError, TransferPlan
from kvtier.server.transfer.engine import check_injected_failure
from kvtier.server.transfer.pages import page_run
from kvtier.v1 import transfer_pb2, transfer_pb2_grpc


MAX_PEER_CHANNELS = 16
"""Peer channels a daemon keeps open (the least recently used one is closed past it)."""
PEER_RETRY_S = 30.0
"""Without a deadline, how long a pull keeps sending again a ReadPages its peer refused as "changed nothing"
(the default of ``DaemonConfig.peer_retry_seconds``); a pull with a deadline retries until it."""
PEER_RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                          ("grpc.max_reconnect_backoff_ms", 1000)]
"""The kept peer channels' reconnect backoff: at most 1 s (gRPC's default grows to 120 s), so a
peer that restarted is reached again within a second of being back."""
PEER_RETRY_FIRST_PAUSE_S = 0.05
PEER_RETRY_MAX_PAUSE_S = 0.5


def _write_bytes(dst: torch.Tensor, data: bytes) -> None:
    src = np.frombuffer(data, dtype=np.uint8)
    if dst.device.type == "cpu":
        dst.numpy()[:] = src
    else:
        dst.copy_(torch.from_numpy(src.copy()), non_blocking=False)


class GrpcPageTransport:
    """Fallback :class:`PageTransport`: each batch is one ReadPages stream from the peer daemon,
    written into the destination pool's pages as chunks arrive. With ``expect`` (source page ->
    write generation, from the layout answer of daemon ``daemon_id``) each stream names its pages'
    generations, and the peer sends a page only while it still has its generation."""

    name = "grpc"

    def __init__(self, stub: transfer_pb2_grpc.TransferServiceStub, peer: str, entry: PoolEntry, chunk_bytes: int,
                 fail_batch: int | None, spec: PullSpec, metadata: Sequence[tuple[str, str]] = (),
                 retry_s: float = PEER_RETRY_S, expect: Mapping[int, int] | None = None, daemon_id: str = "") -> None:
        self.stub, self.peer, self.peer_pool_id = stub, peer, spec.peer_pool_id
        self.expect, self.daemon_id = dict(expect or {}), daemon_id
        self.retry_s = retry_s
        self.entry, self.chunk_bytes, self.fail_batch = entry, chunk_bytes, fail_batch
        self.spec = spec
        self.metadata = tuple(metadata)

    def pull(self, remote: PoolLayout, plan: TransferPlan) -> None:
        """Stream every batch of ``plan`` into the destination pool. A ReadPages the peer refused
        with "changed nothing" (``kvtier-retry: unchanged``: every stream slot taken, source pages a
        write is landing on) is sent again -- the whole batch, whose pages are overwritten --
        pausing 0.05 s then doubling to at most :data:`PEER_RETRY_MAX_PAUSE_S`, until the pull's
        deadline (without one, for at most ``retry_s`` -- :data:`PEER_RETRY_S` unless the daemon's
        ``peer_retry_seconds`` says otherwise -- after the first refusal).

        Raises:
            TransferError: a batch failed (any other error, a refusal past the retry bound, a short or
                out-of-order stream); the destination pages hold undefined bytes.
        """
        for b, batch in enumerate(plan.batches):
            check_injected_failure(self.fail_batch, b, "grpc")
            refused_since: float | None = None
            pause = PEER_RETRY_FIRST_PAUSE_S
            while True:
                try:
                    got = self._stream_batch(b, batch)
                    break
                except grpc.RpcError as e:
                    retry = _changed_nothing(e)
                    now = time.monotonic()
                    refused_since = now if refused_since is None else refused_since
                    # with a deadline, retry until it; without one, for retry_s after the first refusal
                    if retry and (self.spec.deadline is not None or now - refused_since < self.retry_s):
                        try:
                            left = self.spec.remaining(math.inf)  # the deadline's time left; 0 once cancelled
                        except TransferError:
                            left = 0.0
                        if left > pause:
                            time.sleep(pause)
                            pause = min(pause * 2, PEER_RETRY_MAX_PAUSE_S)
                            continue
                    why = ("" if not retry else " (refused as 'retry' until the pull's deadline)"
                           if self.spec.deadline is not None
                           else f" (refused as 'retry' for {self.retry_s:g} s, the bound of a pull without a deadline)")
                    raise TransferError(f"grpc: ReadPages from {self.peer} failed in batch {b + 1} of {len(plan.batches)}: "
                                        f"{e.code().name}: {e.details()}{why}", batch=b) from None
            short = [i for i, it in enumerate(batch) if got[i] != it.nbytes]
            if short:
                raise TransferError(f"grpc: ReadPages from {self.peer} ended early in batch {b + 1} "
                                    f"({got[short[0]]} of {batch[short[0]].nbytes} bytes of a run)", batch=b)

    def _stream_batch(self, b: int, batch: Sequence[Any]) -> list[int]:
        """One ReadPages stream of ``batch`` written into its destination pages; the bytes got per run.

        Raises:
            grpc.RpcError: the peer's answer. TransferError: an out-of-order chunk, or the deadline passed.
        """
        targets = [page_run(self.entry.pool, it.component, it.layer_id, it.dst_page, it.num_pages) for it in batch]
        got = [0] * len(batch)
        request = transfer_pb2.ReadPagesRequest(pool_id=self.peer_pool_id, chunk_bytes=self.chunk_bytes, runs=[
            transfer_pb2.PageRun(layer_id=it.layer_id, component=COMPONENT_TO_PROTO[it.component],
                                 first_page=it.src_page, num_pages=it.num_pages) for it in batch])
        if self.expect:  # the batch's pages, each once, with the generation the layout answer gave it
            pages = sorted({it.src_page + k for it in batch for k in range(it.num_pages)})
            request.expect_pages.extend(pages)
            request.expect_generations.extend(self.expect[p] for p in pages)
            request.expect_daemon = self.daemon_id
        for msg in self.stub.ReadPages(request, timeout=self.spec.remaining(PEER_STREAM_TIMEOUT_S), metadata=self.metadata):
            r, n = msg.run, len(msg.data)
            if r >= len(batch) or msg.offset != got[r] or got[r] + n > batch[r].nbytes:
                raise TransferError(f"grpc: ReadPages from {self.peer} sent an out-of-order chunk (run {r}, offset {msg.offset})", batch=b)
            _write_bytes(targets[r][got[r]:got[r] + n], msg.data)
            got[r] += n
        return got


def _changed_nothing(e: grpc.RpcError) -> bool:
    """The peer marked its refusal "changed nothing" (:data:`RETRY_UNCHANGED` in the trailing metadata)."""
    try:
        return RETRY_UNCHANGED in tuple(tuple(kv) for kv in (e.trailing_metadata() or ()))
    except Exception:  # noqa: BLE001 - an error raised without a call (no metadata to read)
        return False


class GrpcPeerLink:
    """A :class:`~kvtier.server.daemon.transfer.PeerLink` over one gRPC channel."""

    def __init__(self, channel: grpc.Channel, address: str, metadata: Sequence[tuple[str, str]] = (),
                 retry_s: float = PEER_RETRY_S) -> None:
        self.channel = channel
        self.stub = transfer_pb2_grpc.TransferServiceStub(channel)
        self.retry_s = retry_s
        self.address = address
        self.metadata = tuple(metadata)

    def layout(self, pool_id: str, check_pages: list[int], spec: PullSpec, known_digest: str = "") -> PeerLayout:
        request = transfer_pb2.TransferLayoutRequest(pool_id=pool_id, check_pages=check_pages, known_digest=known_digest)
        try:
            msg = self.stub.GetTransferLayout(request, timeout=spec.remaining(PEER_LAYOUT_TIMEOUT_S), metadata=self.metadata)
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
            if code == grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"peer {self.address}: {details}") from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(f"peer {self.address}: {details}") from None
            if code == grpc.StatusCode.UNAVAILABLE and _changed_nothing(e):
                raise Busy(f"peer {self.address}: {details}") from None  # e.g. source pages a write is landing on
            if code == grpc.StatusCode.UNAVAILABLE:  # unreachable (down, restarting): nothing moved yet, so retryable
                raise Busy(f"peer {self.address} unreachable (GetTransferLayout: UNAVAILABLE: {details}); "
                           f"nothing moved") from None
            raise TransferError(f"peer {self.address} GetTransferLayout failed: {code.name}: {details}") from None
        return PeerLayout(msg.layout_digest, None if msg.unchanged else peer_layout(msg), msg.daemon_id,
                          list(msg.page_generations))

    def page_transport(self, entry: PoolEntry, chunk_bytes: int, fail_batch: int | None, spec: PullSpec,
                       expect: Mapping[int, int], daemon_id: str) -> PageTransport:
        return GrpcPageTransport(self.stub, self.address, entry, chunk_bytes, fail_batch, spec, self.metadata,
                                 self.retry_s, expect, daemon_id)


class GrpcPeerConnector:
    """Opens gRPC channels to peer daemons with the daemon's message limits (module docstring: credentials).

    Args:
        options: channel options (``DaemonConfig.grpc_options()``).
        tls: channel credentials for TLS peers (None: plaintext).

    Attributes:
        retry_s: without a deadline, how long a pull resends a ReadPages refused as "changed nothing"
            (``DaemonConfig.peer_retry_seconds``).
    """

    retry_s: float = PEER_RETRY_S

    def __init__(self, options: Sequence[tuple[str, int]], tls: grpc.ChannelCredentials | None = None,
                 max_channels: int = MAX_PEER_CHANNELS) -> None:
        self.options = list(options)
        self.tls = tls
        self.max_channels = max_channels
        # address -> [channel, pulls using it], least recently used first; an evicted channel still in
        # use is closed when its last pull ends (never under a running pull)
        self._channels: OrderedDict[str, list[Any]] = OrderedDict()
        self._lock = threading.Lock()  # a dict lock only (level 1 of the daemon's lock order)

    def _acquire(self, address: str) -> list[Any]:
        """The kept channel to ``address`` (opened on first use), marked in use: a new connection per
        pull cost more than the layout call (BENCHMARKS.md); gRPC reconnects by itself when the peer
        restarts, and the caller's token travels per call, so callers share it. At most
        ``max_channels`` are kept: the least recently used one goes (closed once no pull uses it), so
        peer addresses callers name cannot pile up channels."""
        evicted: list[grpc.Channel] = []
        with self._lock:
            held = self._channels.get(address)
            if held is None:
                ch = (grpc.secure_channel(address, self.tls, options=self.options) if self.tls is not None
                      else grpc.insecure_channel(address, options=self.options))
                held = self._channels[address] = [ch, 0]
                while len(self._channels) > self.max_channels:
                    _, old = self._channels.popitem(last=False)
                    if old[1] == 0:
                        evicted.append(old[0])
                    else:
                        old[1] = -old[1]  # negative: evicted, closed by its last user
            else:
                self._channels.move_to_end(address)
            held[1] += 1
        for ch in evicted:
            ch.close()
        return held

    def _release(self, held: list[Any]) -> None:
        with self._lock:
            if held[1] > 0:
                held[1] -= 1
                return
            held[1] += 1  # evicted meanwhile: counts up towards 0
            close = held[1] == 0
        if close:
            held[0].close()

    def open_channels(self) -> int:
        """How many peer channels are kept (tests)."""
        with self._lock:
            return len(self._channels)

    def close(self) -> None:
        """Close every kept channel (at shutdown)."""
        with self._lock:
            channels, self._channels = [h[0] for h in self._channels.values()], OrderedDict()
        for ch in channels:
            ch.close()

    @classmethod
    def for_config(cls, config: DaemonConfig) -> GrpcPeerConnector:
        """The connector a daemon of ``config`` uses (TLS with ``peer_tls_ca``)."""
        tls = None
        if config.peer_tls_ca:
            files = read_tls_files(config)  # checked (owner, mode, the way to them) as at start
            own = (files["tls_key"], files["tls_cert"]) if config.tls_cert else (None, None)
            tls = grpc.ssl_channel_credentials(root_certificates=files["peer_tls_ca"],
                                               private_key=own[0], certificate_chain=own[1])
        connector = cls([*config.grpc_options(), *PEER_RECONNECT_OPTIONS], tls)
        connector.retry_s = config.peer_retry_seconds
        return connector

    @contextmanager
    def connect(self, address: str, caller: Caller) -> Iterator[GrpcPeerLink]:
        if is_unix(address):  # the client's own check, before anything is sent (attack pass 4, A4-14):
            try:              # another uid that took a listed peer's path got the caller's token
                check_socket_path(socket_path(address))
            except UnsafeSocketError as e:
                raise FailedPrecondition(f"{e}; nothing was sent to the peer") from None
        metadata: list[tuple[str, str]] = []
        if caller.token:
            if self.tls is None and not is_unix(address):
                raise FailedPrecondition(f"refusing to send the caller's token to peer {address} in plaintext (another "
                                         f"local user could take a TCP port, loopback included): give the daemon "
                                         f"--peer-tls-ca (peers over TLS), or use a unix-socket peer (--pd-peers)")
            metadata.append(("authorization", f"Bearer {caller.token}"))
        held = self._acquire(address)
        try:
            yield GrpcPeerLink(held[0], address, metadata, self.retry_s)
        finally:
            self._release(held)
