"""``kvtier.v1.PoolService``: translates messages to domain calls and back, nothing more.

Errors are raised as domain exceptions and mapped to status codes in one place
(:mod:`kvtier.server.service.errors`).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from kvtier.server.service import kv_ops, kv_wire, messages
from kvtier.server.service.errors import InvalidArgument
from kvtier.server.service.kv_ops import KVSelection
from kvtier.server.service.pools import PoolRequest, parse_hf_config
from kvtier.server.service.state import DaemonState
from kvtier.v1 import pool_pb2, pool_pb2_grpc


def _selection(h: pool_pb2.KVHeader) -> KVSelection:
    return KVSelection(h.pool_id, list(h.slots), tuple(h.latent_layers), tuple(h.index_layers), h.layout_digest)


class PoolServicer(pool_pb2_grpc.PoolServiceServicer):
    """Serves :class:`DaemonState`'s pools; see ``pool.proto`` for each RPC's contract."""

    def __init__(self, state: DaemonState) -> None:
        self.state = state
        self.pools = state.pools

    # ----- pools --------------------------------------------------------------------------------
    def CreatePool(self, request: pool_pb2.CreatePoolRequest, context: grpc.ServicerContext) -> pool_pb2.PoolInfo:
        m = request.model
        source = m.WhichOneof("source")
        entry = self.pools.create(PoolRequest(
            pool_id=request.pool_id, preset=m.preset if source == "preset" else "",
            hf_config=parse_hf_config(m.hf_config_json) if source == "hf_config_json" else None,
            model_name=m.name, num_layers=m.num_layers, kv_cache_dtype=m.kv_cache_dtype or "fp8",
            page_size=m.page_size, role=request.role or "target", device=request.device,
            size_tokens=request.size_tokens, memory_budget_bytes=request.memory_budget_bytes))
        self.state.counters.add("pools_created")
        return messages.pool_info(entry)

    def DescribePool(self, request: pool_pb2.DescribePoolRequest, context: grpc.ServicerContext) -> pool_pb2.PoolInfo:
        with self.pools.locked(request.pool_id, exclusive=False) as entry:
            return messages.pool_info(entry)

    def ListPools(self, request: pool_pb2.ListPoolsRequest, context: grpc.ServicerContext) -> pool_pb2.ListPoolsResponse:
        return pool_pb2.ListPoolsResponse(pools=[messages.pool_info(e) for e in self.pools.list()])

    def DeletePool(self, request: pool_pb2.DeletePoolRequest, context: grpc.ServicerContext) -> pool_pb2.DeletePoolResponse:
        freed = self.pools.delete(request.pool_id, force=request.force)
        self.state.counters.add("pools_deleted")
        return pool_pb2.DeletePoolResponse(freed_bytes=freed)

    # ----- slots --------------------------------------------------------------------------------
    def AllocateSlots(self, request: pool_pb2.AllocateSlotsRequest, context: grpc.ServicerContext) -> pool_pb2.AllocateSlotsResponse:
        with self.pools.locked(request.pool_id, exclusive=True) as entry:
            slots = entry.alloc(request.num_tokens)
            ps = entry.page_size
        self.state.counters.add("slots_allocated", request.num_tokens)
        return pool_pb2.AllocateSlotsResponse(pages=slots[::ps].div(ps, rounding_mode="floor").tolist(),
                                              num_tokens=request.num_tokens, page_size=ps)

    def FreeSlots(self, request: pool_pb2.FreeSlotsRequest, context: grpc.ServicerContext) -> pool_pb2.FreeSlotsResponse:
        with self.pools.locked(request.pool_id, exclusive=True) as entry:
            freed = entry.free(entry.slots(list(request.slots)))
        self.state.counters.add("pages_freed", freed)
        return pool_pb2.FreeSlotsResponse(freed_pages=freed)

    # ----- KV data ------------------------------------------------------------------------------
    def WriteKV(self, request_iterator: Iterator[pool_pb2.WriteKVRequest], context: grpc.ServicerContext) -> pool_pb2.WriteKVResponse:
        first = next(request_iterator, None)
        if first is None or not first.HasField("header"):
            raise InvalidArgument("WriteKV must start with a message carrying the header")
        sel = _selection(first.header)
        buf = kv_ops.KVWriteBuffer(self.pools.get(sel.pool_id), sel)
        msg = first
        while msg is not None:
            if msg is not first and msg.HasField("header"):
                raise InvalidArgument("WriteKV takes one header, in its first message")
            if msg.data:
                buf.add(msg.layer_id, messages.component_name(msg.component), msg.offset, msg.data)
            msg = next(request_iterator, None)
        nbytes = kv_ops.write_kv(self.pools, buf)
        self.state.counters.add("kv_writes")
        self.state.counters.add("kv_bytes_written", nbytes)
        return pool_pb2.WriteKVResponse(bytes_written=nbytes, num_slots=buf.slots.numel())

    def ReadKV(self, request: pool_pb2.ReadKVRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        cfg = self.state.config
        chunk = request.chunk_bytes or cfg.chunk_bytes
        if chunk > cfg.max_chunk_bytes:
            raise InvalidArgument(f"chunk_bytes {chunk} exceeds {cfg.max_chunk_bytes} (max_message_bytes "
                                  f"{cfg.max_message_bytes} less room for the other fields)")
        segments = kv_ops.read_kv(self.pools, _selection(request.header))
        self.state.counters.add("kv_reads")
        for seg, data in segments:  # ReadKVResponse wire bytes (registered with a raw serializer: kv_wire)
            view = memoryview(data)
            comp = messages.COMPONENT_TO_PROTO[seg.component]
            for off in range(0, seg.nbytes, chunk):
                yield kv_wire.encode_read_chunk(seg.layer_id, comp, off, view[off:off + chunk])
            self.state.counters.add("kv_bytes_read", seg.nbytes)

    def MoveKV(self, request: pool_pb2.MoveKVRequest, context: grpc.ServicerContext) -> pool_pb2.MoveKVResponse:
        n = kv_ops.move_kv(self.pools, request.pool_id, list(request.tgt_slots), list(request.src_slots))
        self.state.counters.add("kv_moves")
        return pool_pb2.MoveKVResponse(num_slots=n)

    # ----- offload / restore --------------------------------------------------------------------
    def Offload(self, request: pool_pb2.OffloadRequest, context: grpc.ServicerContext) -> pool_pb2.OffloadResponse:
        r = kv_ops.offload(self.pools, self.state.copy_store, request.pool_id, request.key, list(request.slots),
                           free_slots=request.free_slots)
        self.state.counters.add("offloads")
        self.state.counters.add("offload_bytes", r.nbytes)
        return pool_pb2.OffloadResponse(key=request.key, nbytes=r.nbytes, num_tokens=r.num_tokens, freed_pages=r.freed_pages)

    def Restore(self, request: pool_pb2.RestoreRequest, context: grpc.ServicerContext) -> pool_pb2.RestoreResponse:
        slots, nbytes = kv_ops.restore(self.pools, self.state.copy_store, request.pool_id, request.key,
                                       list(request.slots), drop=request.drop)
        self.state.counters.add("restores")
        self.state.counters.add("restore_bytes", nbytes)
        return pool_pb2.RestoreResponse(slots=slots.tolist(), nbytes=nbytes)

    def Drop(self, request: pool_pb2.DropRequest, context: grpc.ServicerContext) -> pool_pb2.DropResponse:
        copy = self.state.copy_store.drop(request.key)
        self.state.counters.add("drops")
        return pool_pb2.DropResponse(dropped=copy is not None, nbytes=copy.nbytes if copy else 0)

    # ----- metadata -----------------------------------------------------------------------------
    def GetBufferInfos(self, request: pool_pb2.BufferInfosRequest, context: grpc.ServicerContext) -> pool_pb2.BufferInfosResponse:
        return messages.buffer_infos(*kv_ops.buffer_infos(self.pools, request.pool_id))

    def GetStats(self, request: pool_pb2.StatsRequest, context: grpc.ServicerContext) -> pool_pb2.StatsResponse:
        return messages.stats(self.state)
