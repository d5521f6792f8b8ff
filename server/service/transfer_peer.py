"""The gRPC side of PullKV: reaching a peer daemon's TransferService (layout, ReadPages streams).

Implements the domain's :class:`~kvtier.server.daemon.transfer.PeerConnector`: the domain decides
what to move; this module only asks the peer over gRPC and writes the bytes a ReadPages stream
brings into the destination pool's pages. Peer errors become the daemon's typed errors (the peer's
NOT_FOUND / INVALID_ARGUMENT stay what they are; anything else is a :class:`TransferError`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import grpc
import numpy as np
import torch

from kvtier.server.daemon.errors import InvalidArgument, NotFound
from kvtier.server.daemon.pools import PoolEntry
from kvtier.server.daemon.transfer import PEER_LAYOUT_TIMEOUT_S, PEER_STREAM_TIMEOUT_S, PullSpec
from kvtier.server.service.transfer_messages import COMPONENT_TO_PROTO, peer_layout
from kvtier.server.transfer import PageTransport, PoolLayout, TransferError, TransferPlan
from kvtier.server.transfer.engine import check_injected_failure
from kvtier.server.transfer.pages import page_run
from kvtier.v1 import transfer_pb2, transfer_pb2_grpc


def _write_bytes(dst: torch.Tensor, data: bytes) -> None:
    src = np.frombuffer(data, dtype=np.uint8)
    if dst.device.type == "cpu":
        dst.numpy()[:] = src
    else:
        dst.copy_(torch.from_numpy(src.copy()), non_blocking=False)


class GrpcPageTransport:
    """Fallback :class:`PageTransport`: each batch is one ReadPages stream from the peer daemon,
    written into the destination pool's pages as chunks arrive."""

    name = "grpc"

    def __init__(self, stub: transfer_pb2_grpc.TransferServiceStub, peer: str, entry: PoolEntry, chunk_bytes: int,
                 fail_batch: int | None, spec: PullSpec, metadata: Sequence[tuple[str, str]] = ()) -> None:
        self.stub, self.peer, self.peer_pool_id = stub, peer, spec.peer_pool_id
        self.entry, self.chunk_bytes, self.fail_batch = entry, chunk_bytes, fail_batch
        self.spec = spec
        self.metadata = tuple(metadata)

    def pull(self, remote: PoolLayout, plan: TransferPlan) -> None:
        for b, batch in enumerate(plan.batches):
            check_injected_failure(self.fail_batch, b, "grpc")
            targets = [page_run(self.entry.pool, it.component, it.layer_id, it.dst_page, it.num_pages) for it in batch]
            got = [0] * len(batch)
            request = transfer_pb2.ReadPagesRequest(pool_id=self.peer_pool_id, chunk_bytes=self.chunk_bytes, runs=[
                transfer_pb2.PageRun(layer_id=it.layer_id, component=COMPONENT_TO_PROTO[it.component],
                                     first_page=it.src_page, num_pages=it.num_pages) for it in batch])
            try:
                for msg in self.stub.ReadPages(request, timeout=self.spec.remaining(PEER_STREAM_TIMEOUT_S),
                                               metadata=self.metadata):
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


class GrpcPeerLink:
    """A :class:`~kvtier.server.daemon.transfer.PeerLink` over one gRPC channel."""

    def __init__(self, channel: grpc.Channel, address: str, metadata: Sequence[tuple[str, str]] = ()) -> None:
        self.stub = transfer_pb2_grpc.TransferServiceStub(channel)
        self.address = address
        self.metadata = tuple(metadata)

    def layout(self, pool_id: str, check_pages: list[int], spec: PullSpec) -> PoolLayout:
        request = transfer_pb2.TransferLayoutRequest(pool_id=pool_id, check_pages=check_pages)
        try:
            msg = self.stub.GetTransferLayout(request, timeout=spec.remaining(PEER_LAYOUT_TIMEOUT_S), metadata=self.metadata)
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
            if code == grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"peer {self.address}: {details}") from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(f"peer {self.address}: {details}") from None
            raise TransferError(f"peer {self.address} GetTransferLayout failed: {code.name}: {details}") from None
        return peer_layout(msg)

    def page_transport(self, entry: PoolEntry, chunk_bytes: int, fail_batch: int | None, spec: PullSpec) -> PageTransport:
        return GrpcPageTransport(self.stub, self.address, entry, chunk_bytes, fail_batch, spec, self.metadata)


class GrpcPeerConnector:
    """Opens plain gRPC channels to peer daemons with the daemon's message limits.

    Args:
        options: channel options (``DaemonConfig.grpc_options()``).
    """

    def __init__(self, options: Sequence[tuple[str, int]]) -> None:
        self.options = list(options)

    @contextmanager
    def connect(self, address: str) -> Iterator[GrpcPeerLink]:
        with grpc.insecure_channel(address, options=self.options) as channel:
            yield GrpcPeerLink(channel, address)
