"""``kvtier.v1.PoolService``: translates messages to domain calls and back, nothing more.

Every call runs as the caller the auth interceptor resolved (:func:`~kvtier.server.service.auth.caller_of`);
errors are raised as domain exceptions and mapped to status codes in one place
(:mod:`kvtier.server.service.errors`). KV streams hold a stream slot and report each message moved
(:class:`~kvtier.server.service.streams.StreamGuard`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc

from kvtier.server.daemon import kv_ops, kv_stream, kv_write
from kvtier.server.daemon.core import Daemon
from kvtier.server.daemon.errors import InvalidArgument
from kvtier.server.daemon.kv_ops import KVSelection
from kvtier.server.daemon.pools import PoolRequest, parse_hf_config
from kvtier.server.service import kv_wire, messages
from kvtier.server.service.auth import caller_of
from kvtier.server.service.errors import caller_waits
from kvtier.server.service.streams import StreamGuard
from kvtier.v1 import pool_pb2, pool_pb2_grpc


def _encode_read_piece(p: kv_stream.Piece, data: list[memoryview]) -> bytes:
    comp = messages.COMPONENT_TO_PROTO[p.component] if p.component else pool_pb2.COMPONENT_UNSPECIFIED
    return kv_wire.encode_read_chunk(p.layer_id, comp, p.offset, data)


def _selection(h: pool_pb2.KVHeader) -> KVSelection:
    return KVSelection(h.pool_id, list(h.slots), tuple(h.latent_layers), tuple(h.index_layers), h.layout_digest)


class PoolServicer(pool_pb2_grpc.PoolServiceServicer):
    """Serves :class:`Daemon`'s pools; see ``pool.proto`` for each RPC's contract."""

    def __init__(self, state: Daemon, streams: StreamGuard) -> None:
        self.state = state
        self.pools = state.pools
        self.streams = streams

    # ----- pools --------------------------------------------------------------------------------
    def CreatePool(self, request: pool_pb2.CreatePoolRequest, context: grpc.ServicerContext) -> pool_pb2.PoolInfo:
        caller, m = caller_of(context), request.model
        source = m.WhichOneof("source")
        entry = self.pools.create(caller, PoolRequest(
            pool_id=request.pool_id, preset=m.preset if source == "preset" else "",
            hf_config=parse_hf_config(m.hf_config_json) if source == "hf_config_json" else None,
            model_name=m.name, num_layers=m.num_layers, start_layer=m.start_layer, end_layer=m.end_layer,
            kv_cache_dtype=m.kv_cache_dtype or "fp8",
            page_size=m.page_size, role=request.role or "target", device=request.device,
            size_tokens=request.size_tokens, memory_budget_bytes=request.memory_budget_bytes), caller_waits(context))
        self.state.counters.add(caller, "pools_created")
        return messages.pool_info(entry)

    def DescribePool(self, request: pool_pb2.DescribePoolRequest, context: grpc.ServicerContext) -> pool_pb2.PoolInfo:
        with self.pools.locked(caller_of(context), request.pool_id, exclusive=False) as entry:
            return messages.pool_info(entry)

    def ListPools(self, request: pool_pb2.ListPoolsRequest, context: grpc.ServicerContext) -> pool_pb2.ListPoolsResponse:
        return pool_pb2.ListPoolsResponse(pools=[messages.pool_info(e) for e in self.pools.list(caller_of(context))])

    def DeletePool(self, request: pool_pb2.DeletePoolRequest, context: grpc.ServicerContext) -> pool_pb2.DeletePoolResponse:
        caller = caller_of(context)
        freed = self.state.delete_pool(caller, request.pool_id, force=request.force, wanted=caller_waits(context))
        self.state.counters.add(caller, "pools_deleted")
        return pool_pb2.DeletePoolResponse(freed_bytes=freed)

    # ----- slots --------------------------------------------------------------------------------
    def AllocateSlots(self, request: pool_pb2.AllocateSlotsRequest, context: grpc.ServicerContext) -> pool_pb2.AllocateSlotsResponse:
        caller = caller_of(context)
        slots, ps = kv_ops.allocate_slots(self.pools, caller, request.pool_id, request.num_tokens, caller_waits(context))
        self.state.counters.add(caller, "slots_allocated", request.num_tokens)
        return pool_pb2.AllocateSlotsResponse(pages=slots[::ps].div(ps, rounding_mode="floor").tolist(),
                                              num_tokens=request.num_tokens, page_size=ps)

    def FreeSlots(self, request: pool_pb2.FreeSlotsRequest, context: grpc.ServicerContext) -> pool_pb2.FreeSlotsResponse:
        caller = caller_of(context)
        freed = kv_ops.free_slots(self.pools, caller, request.pool_id, list(request.slots), caller_waits(context))
        self.state.counters.add(caller, "pages_freed", freed)
        return pool_pb2.FreeSlotsResponse(freed_pages=freed)

    # ----- KV data ------------------------------------------------------------------------------
    def WriteKV(self, request_iterator: Iterator[kv_wire.WriteChunk], context: grpc.ServicerContext) -> pool_pb2.WriteKVResponse:
        caller = caller_of(context)
        with self.streams.stream(context, "WriteKV", tenant=caller.tenant) as touch:
            first = next(request_iterator, None)
            if first is None or first.header is None:
                raise InvalidArgument("WriteKV must start with a message carrying the header")
            sel = _selection(first.header)
            touch.daemon_working()  # the claim may wait for the pool (attack pass 5, A5-3)
            buf = (kv_write.reserve_write(self.pools, caller, sel, first.allocate_tokens) if first.allocate_tokens
                   else kv_write.begin_write(self.pools, caller, sel))
            touch.client_turn()
            try:
                self._receive(buf, first, request_iterator, touch)
                touch.daemon_working()  # the commit may wait for the pool: not the client's idleness
                if buf.reserved:
                    slots, nbytes = kv_write.write_new_kv(self.pools, caller, buf, caller_waits(context))
                else:
                    slots, nbytes = None, kv_write.write_kv(self.pools, caller, buf, caller_waits(context),
                                                              context.time_remaining)
            except BaseException:
                kv_write.abort_write(self.pools, caller, buf)
                raise
        self.state.counters.add(caller, "kv_writes")
        self.state.counters.add(caller, "kv_bytes_written", nbytes)
        if slots is None:
            return pool_pb2.WriteKVResponse(bytes_written=nbytes, num_slots=buf.slots.numel())
        ps = buf.entry.page_size
        return pool_pb2.WriteKVResponse(bytes_written=nbytes, num_slots=slots.numel(), page_size=ps,
                                        pages=slots[::ps].div(ps, rounding_mode="floor").tolist())

    @staticmethod
    def _receive(buf: kv_write.KVWriteBuffer, first: kv_wire.WriteChunk, request_iterator: Iterator[kv_wire.WriteChunk],
                 touch: Callable[[], None]) -> None:
        """Land every data message of the stream in ``buf`` (checked as it comes)."""
        for msg in messages.chained(first, request_iterator, touch):  # kv_wire.WriteChunk: data is a view
            if msg is not first and (msg.header is not None or msg.packed or msg.allocate_tokens):
                raise InvalidArgument("WriteKV takes one header (and packed, allocate_tokens), in its first message")
            if not msg.data:
                if msg is first:
                    continue
                raise InvalidArgument("a WriteKV message after the first must carry data (an empty one moves nothing "
                                      "yet would keep the stream alive past --stream-idle-seconds)")
            if first.packed:
                if msg.layer_id or msg.component:
                    raise InvalidArgument("a packed WriteKV stream's messages name no layer or component")
                buf.add_packed(msg.offset, msg.data)
            else:
                buf.add(msg.layer_id, messages.component_name(msg.component), msg.offset, msg.data)

    def ReadKV(self, request: pool_pb2.ReadKVRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        caller, cfg = caller_of(context), self.state.config
        chunk = kv_ops.chunk_size(request.chunk_bytes, cfg.chunk_bytes, cfg.max_chunk_bytes)
        with self.streams.stream(context, "ReadKV", tenant=caller.tenant) as touch:
            read = kv_stream.read_kv_messages(self.pools, caller, _selection(request.header), chunk, packed=request.packed,
                                              encode=_encode_read_piece)
            self.state.counters.add(caller, "kv_reads")
            for msg in read:  # wire bytes: a raw serializer
                touch()
                yield msg
            self.state.counters.add(caller, "kv_bytes_read", read.nbytes)

    def MoveKV(self, request: pool_pb2.MoveKVRequest, context: grpc.ServicerContext) -> pool_pb2.MoveKVResponse:
        caller = caller_of(context)
        n = kv_ops.move_kv(self.pools, caller, request.pool_id, list(request.tgt_slots), list(request.src_slots),
                           caller_waits(context))
        self.state.counters.add(caller, "kv_moves")
        return pool_pb2.MoveKVResponse(num_slots=n)

    # ----- offload / restore --------------------------------------------------------------------
    def Offload(self, request: pool_pb2.OffloadRequest, context: grpc.ServicerContext) -> pool_pb2.OffloadResponse:
        caller = caller_of(context)
        r = kv_ops.offload(self.pools, self.state.offload_store, caller, request.pool_id, request.key,
                           list(request.slots), free_slots=request.free_slots, wanted=caller_waits(context))
        self.state.counters.add(caller, "offloads")
        self.state.counters.add(caller, "offload_bytes", r.nbytes)
        return pool_pb2.OffloadResponse(key=request.key, nbytes=r.nbytes, num_tokens=r.num_tokens, freed_pages=r.freed_pages,
                                        durable=r.durable)

    def Restore(self, request: pool_pb2.RestoreRequest, context: grpc.ServicerContext) -> pool_pb2.RestoreResponse:
        caller = caller_of(context)
        slots, nbytes = kv_ops.restore(self.pools, self.state.offload_store, caller, request.pool_id, request.key,
                                       list(request.slots), drop=request.drop, wanted=caller_waits(context))
        self.state.counters.add(caller, "restores")
        self.state.counters.add(caller, "restore_bytes", nbytes)
        return pool_pb2.RestoreResponse(slots=slots.tolist(), nbytes=nbytes)

    def Drop(self, request: pool_pb2.DropRequest, context: grpc.ServicerContext) -> pool_pb2.DropResponse:
        caller = caller_of(context)
        nbytes = self.state.offload_store.drop(caller, request.key, wanted=caller_waits(context))
        self.state.counters.add(caller, "drops")
        return pool_pb2.DropResponse(dropped=nbytes is not None, nbytes=nbytes or 0)

    # ----- metadata -----------------------------------------------------------------------------
    def GetBufferInfos(self, request: pool_pb2.BufferInfosRequest, context: grpc.ServicerContext) -> pool_pb2.BufferInfosResponse:
        return messages.buffer_infos(*kv_ops.buffer_infos(self.pools, caller_of(context), request.pool_id))

    def GetStats(self, request: pool_pb2.StatsRequest, context: grpc.ServicerContext) -> pool_pb2.StatsResponse:
        return messages.stats(self.state.stats(caller_of(context)), self.state.config.max_message_bytes)
