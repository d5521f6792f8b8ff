"""``kvtier.v1.StorageService``: the unit store (:mod:`kvtier.server.daemon.unit_store`), translated.

Every call runs as the caller the auth interceptor resolved; errors are the store's typed errors,
mapped to status codes in one place (``errors``). The two KV streams hold a stream slot and report
each message moved (:class:`~kvtier.server.service.streams.StreamGuard`), like WriteKV and ReadKV.
The two staged calls move no page bytes: they name a region of a staging buffer of the caller's
attach session (:meth:`~kvtier.server.daemon.attach.AttachService.staging_region`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import grpc

from kvtier.server.daemon.core import Daemon
from kvtier.server.daemon.errors import InvalidArgument
from kvtier.server.daemon.kv_ops import MIN_CHUNK_BYTES, chunk_size
from kvtier.server.daemon.unit_space import BOTH, INDEX, KV, SpaceRequest, UnitSpace
from kvtier.server.service import messages
from kvtier.server.service.auth import caller_of
from kvtier.server.service.errors import caller_waits
from kvtier.server.service.streams import StreamGuard
from kvtier.v1 import storage_pb2, storage_pb2_grpc

_PARTS = {storage_pb2.UNIT_PART_KV: KV, storage_pb2.UNIT_PART_INDEX: INDEX, storage_pb2.UNIT_PART_BOTH: BOTH}


def _part(value: int) -> str:
    if value not in _PARTS:
        raise InvalidArgument(f"unknown unit part {value}: give UNIT_PART_KV, UNIT_PART_INDEX or UNIT_PART_BOTH")
    return _PARTS[value]


class StorageServicer(storage_pb2_grpc.StorageServiceServicer):
    """Serves :class:`Daemon`'s unit store; see ``storage.proto`` for each RPC's contract."""

    def __init__(self, state: Daemon, streams: StreamGuard) -> None:
        self.state = state
        self.units = state.units
        self.streams = streams

    def _space(self, s: storage_pb2.UnitSpace) -> UnitSpace:
        lay = s.layout
        return self.units.space(SpaceRequest(
            lay.model_name, lay.num_layers, lay.start_layer, lay.kv_lora_rank, lay.qk_rope_head_dim, lay.index_head_dim,
            lay.kv_cache_dtype, lay.page_size, lay.latent_row_bytes, lay.skip_mask, s.with_index, s.scope))

    def ExistUnits(self, request: storage_pb2.ExistUnitsRequest, context: grpc.ServicerContext) -> storage_pb2.ExistUnitsResponse:
        n = self.units.exists(caller_of(context), self._space(request.space), request.keys)
        return storage_pb2.ExistUnitsResponse(prefix_units=n)

    def PutUnits(self, request_iterator: Iterator[storage_pb2.PutUnitsRequest], context: grpc.ServicerContext) -> storage_pb2.PutUnitsResponse:
        caller = caller_of(context)
        with self.streams.stream(context, "PutUnits", tenant=caller.tenant) as touch:
            first = next(request_iterator, None)
            if first is None or not first.HasField("space"):
                raise InvalidArgument("PutUnits must start with a message carrying the unit space, keys and part")
            put = self.units.begin_put(caller, self._space(first.space), first.keys, _part(first.part), "stream",
                                       writer=first.writer)
            for msg in messages.chained(first, request_iterator, touch):
                if msg is not first and (msg.HasField("space") or msg.keys or msg.writer):
                    raise InvalidArgument("PutUnits takes the space and keys once, in its first message")
                if msg.data:
                    put.add(msg.data)
                    if len(msg.data) < MIN_CHUNK_BYTES and not put.ends_a_part():
                        raise InvalidArgument(f"a PutUnits piece must carry at least {MIN_CHUNK_BYTES} bytes unless "
                                              f"it ends a unit's part")
            touch.daemon_working()  # the commit may wait for a ClearUnits: not the client's idleness (A7-7)
            r = put.commit(caller_waits(context))
        return storage_pb2.PutUnitsResponse(accepted=r.accepted, completed=r.completed, pending=r.pending)

    def GetUnits(self, request: storage_pb2.GetUnitsRequest, context: grpc.ServicerContext) -> Iterator[storage_pb2.GetUnitsResponse]:
        caller, cfg = caller_of(context), self.state.config
        chunk = chunk_size(request.chunk_bytes, cfg.chunk_bytes, cfg.max_chunk_bytes)
        with self.streams.stream(context, "GetUnits", tenant=caller.tenant) as touch:
            for i, view in _daemon_turns(self.units.read(caller, self._space(request.space), request.keys,
                                                         _part(request.part), "stream"), touch):
                mv = memoryview(view.numpy())
                for off in range(0, len(mv), chunk):
                    touch()
                    yield storage_pb2.GetUnitsResponse(unit=i, offset=off, data=bytes(mv[off:off + chunk]))

    def ClearUnits(self, request: storage_pb2.ClearUnitsRequest, context: grpc.ServicerContext) -> storage_pb2.ClearUnitsResponse:
        return storage_pb2.ClearUnitsResponse(removed=self.units.clear(caller_of(context), self._space(request.space),
                                                                       caller_waits(context)))

    def GetUnitStats(self, request: storage_pb2.UnitStatsRequest, context: grpc.ServicerContext) -> storage_pb2.UnitStatsResponse:
        return storage_pb2.UnitStatsResponse(counters=self.units.stats(caller_of(context)))

    def PutUnitsStaged(self, request: storage_pb2.PutUnitsStagedRequest, context: grpc.ServicerContext) -> storage_pb2.PutUnitsResponse:
        caller = caller_of(context)
        put = self.units.begin_put(caller, self._space(request.space), request.keys, _part(request.part), "staged",
                                   writer=request.writer)
        put.add(self.state.attach.staging_region(caller, request.staging.buffer, request.staging.offset, put.total))
        r = put.commit(caller_waits(context))
        return storage_pb2.PutUnitsResponse(accepted=r.accepted, completed=r.completed, pending=r.pending)

    def GetUnitsStaged(self, request: storage_pb2.GetUnitsStagedRequest, context: grpc.ServicerContext) -> storage_pb2.GetUnitsStagedResponse:
        caller, space, part = caller_of(context), self._space(request.space), _part(request.part)
        nbytes = space.part_nbytes(space.check_part(part)) * len(request.keys)
        out = self.state.attach.staging_region(caller, request.staging.buffer, request.staging.offset, nbytes)
        return storage_pb2.GetUnitsStagedResponse(found=self.units.read_into(caller, space, request.keys, part, out, "staged"))


def _daemon_turns(items: Iterable[Any], touch: Any) -> Iterator[Any]:
    """``items``, with the stream marked the daemon's turn while each one is produced (a unit read
    from the disk, its promotion waiting for a ClearUnits) and the client's again once it is, so the
    idle bound counts only the client's reading (attack pass 7, A7-7)."""
    items = iter(items)
    while True:
        touch.daemon_working()
        try:
            item = next(items)
        except StopIteration:
            return
        finally:
            touch.client_turn()
        yield item
