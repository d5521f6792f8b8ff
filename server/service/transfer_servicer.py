"""``kvtier.v1.TransferService``: translates messages to ``Daemon.transfer`` calls and back.

Every call runs as the caller the auth interceptor resolved (a pool's layout and raw addresses go
only to its own tenant); PullKV reaches the peer with that caller's credentials. Errors are domain
exceptions mapped to status codes in one place (:mod:`kvtier.server.service.errors`): a layout
mismatch is FAILED_PRECONDITION and is raised before any byte moves.

A PullKV that asks a peer (any address but this daemon's bound one) holds a KV stream slot of its
tenant from before it connects until it returns (:class:`SlotHoldingConnector`): a peer that never
answers holds that slot and its worker, within the tenant's share of ``--max-streams``; one more is
refused RESOURCE_EXHAUSTED, marked "changed nothing", before anything is asked or moved.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from kvtier.server.daemon.core import Daemon
from kvtier.server.daemon.errors import InvalidArgument
from kvtier.server.daemon.tenants import Caller
from kvtier.server.daemon.transfer import PeerConnector, PeerLink, PullSpec
from kvtier.server.service.auth import caller_of
from kvtier.server.service.errors import caller_waits
from kvtier.server.service.streams import StreamGuard
from kvtier.server.service.transfer_messages import COMPONENT_FROM_PROTO, TRANSPORTS, pull_response, transfer_layout
from kvtier.server.service.transfer_peer import GrpcPeerConnector
from kvtier.v1 import transfer_pb2, transfer_pb2_grpc


NO_DEADLINE_S = 1e8
"""A call's time left beyond this (about 3 years) is no deadline: gRPC reports a call sent without one
as due in the far future, which would make a pull without a deadline wait as if it had one."""


class SlotHoldingConnector:
    """The :class:`PeerConnector` of one PullKV call: ``peers``, but a KV stream slot of the caller's
    tenant is taken first (``StreamsFull`` when none is left to it) and held while the link is open.
    The domain connects only to a peer it must ask, so a pull from this daemon's bound address takes none."""

    def __init__(self, peers: PeerConnector, streams: StreamGuard, context: grpc.ServicerContext) -> None:
        self.peers, self.streams, self.context = peers, streams, context

    @contextmanager
    def connect(self, address: str, caller: Caller) -> Iterator[PeerLink]:
        with self.streams.stream(self.context, "PullKV", tenant=caller.tenant, idle_bound=False), \
                self.peers.connect(address, caller) as link:
            yield link


class TransferServicer(transfer_pb2_grpc.TransferServiceServicer):
    """Serves PD transfer for :class:`Daemon`'s pools; see ``transfer.proto``."""

    def __init__(self, state: Daemon, streams: StreamGuard) -> None:
        self.transfer = state.transfer
        self.peers = GrpcPeerConnector.for_config(state.config)
        state.add_shutdown_hook(self.peers.close)  # the channels it keeps to peers
        self.streams = streams

    def GetTransferLayout(self, request: transfer_pb2.TransferLayoutRequest, context: grpc.ServicerContext) -> transfer_pb2.TransferLayout:
        entry, layout, digest, generations = self.transfer.transfer_layout(
            caller_of(context), request.pool_id, list(request.check_pages), request.known_digest)
        if layout is None:  # the caller holds it already
            return transfer_pb2.TransferLayout(layout_digest=digest, unchanged=True, daemon_id=self.transfer.daemon_id,
                                               page_generations=generations)
        msg = transfer_layout(entry, layout)
        msg.layout_digest = digest
        msg.daemon_id = self.transfer.daemon_id  # a puller that meets its own id copies in process
        msg.page_generations.extend(generations)
        return msg

    def PullKV(self, request: transfer_pb2.PullKVRequest, context: grpc.ServicerContext) -> transfer_pb2.PullKVResponse:
        if request.transport not in TRANSPORTS:
            raise InvalidArgument(f"unknown transport {request.transport}")
        remaining = context.time_remaining()
        if remaining is not None and remaining > NO_DEADLINE_S:  # gRPC's "no deadline" is a time centuries away
            remaining = None
        result = self.transfer.pull(caller_of(context), PullSpec(
            pool_id=request.pool_id, peer_address=request.peer_address, peer_pool_id=request.peer_pool_id,
            src_pages=list(request.src_pages), dst_pages=list(request.dst_pages), src_slots=list(request.src_slots),
            dst_slots=list(request.dst_slots), transport=TRANSPORTS[request.transport],
            max_batch_items=request.max_batch_items,
            deadline=None if remaining is None else time.monotonic() + remaining, is_active=caller_waits(context)),
            SlotHoldingConnector(self.peers, self.streams, context))
        return pull_response(result.stats, result.transport, result.seconds)

    def ReadPages(self, request: transfer_pb2.ReadPagesRequest, context: grpc.ServicerContext) -> Iterator[transfer_pb2.ReadPagesResponse]:
        runs = []
        for r in request.runs:
            if r.component not in COMPONENT_FROM_PROTO:
                raise InvalidArgument(f"unknown page component {r.component}")
            runs.append((r.layer_id, COMPONENT_FROM_PROTO[r.component], r.first_page, r.num_pages))
        caller = caller_of(context)
        with self.streams.stream(context, "ReadPages", tenant=caller.tenant) as touch:
            for run, offset, data in self.transfer.read_pages(
                    caller, request.pool_id, runs, request.chunk_bytes, list(request.expect_pages),
                    list(request.expect_generations), request.expect_daemon):
                touch()
                yield transfer_pb2.ReadPagesResponse(run=run, offset=offset, data=data)
