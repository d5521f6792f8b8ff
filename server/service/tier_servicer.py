"""TierService: proto in -> :class:`~kvtier.server.daemon.tier_runtime.TierRuntime` call -> proto out.

Every call runs as the caller the auth interceptor resolved; errors are the runtime's typed errors,
and the daemon's one mapping (``errors``) picks status codes.
"""

from __future__ import annotations

import grpc

from kvtier.server.daemon.core import Daemon
from kvtier.server.service.auth import caller_of
from kvtier.server.service.errors import caller_waits
from kvtier.server.service.streams import StreamGuard
from kvtier.v1 import tier_pb2, tier_pb2_grpc

_COUNTER_FIELDS = ("hits", "misses", "damaged", "writes", "bytes_written", "bytes_read", "evictions",
                   "bytes_evicted", "full_errors", "io_errors")


class TierServicer(tier_pb2_grpc.TierServiceServicer):
    """The prefix cache of each pool over the device, host and disk tiers."""

    def __init__(self, state: Daemon, streams: StreamGuard) -> None:
        self.tiers = state.tiers

    def LookupPrefix(self, request: tier_pb2.LookupPrefixRequest, context: grpc.ServicerContext) -> tier_pb2.LookupPrefixResponse:
        found = self.tiers.lookup(caller_of(context), request.pool_id, request.page_keys)
        return tier_pb2.LookupPrefixResponse(prefix_pages=found.per_tier, page_tiers=found.tiers)

    def LoadPrefix(self, request: tier_pb2.LoadPrefixRequest, context: grpc.ServicerContext) -> tier_pb2.LoadPrefixResponse:
        caller = caller_of(context)
        total = request.total_tokens if request.HasField("total_tokens") else None
        ld = self.tiers.load(caller, request.pool_id, request.page_keys, total, caller_waits(context))
        if not caller_waits(context)():  # the caller is gone (cancelled, deadline): it can never release
            self.tiers.release(caller, request.pool_id, ld.lease)
        return tier_pb2.LoadPrefixResponse(lease_id=ld.lease, slots=ld.slots.tolist(), page_tiers=ld.tiers,
                                           loaded_pages=ld.loaded_pages)

    def StorePrefix(self, request: tier_pb2.StorePrefixRequest, context: grpc.ServicerContext) -> tier_pb2.StorePrefixResponse:
        n = self.tiers.store(caller_of(context), request.pool_id, request.lease_id, request.page_keys, request.slots,
                             release=request.release, wanted=caller_waits(context))
        return tier_pb2.StorePrefixResponse(stored_pages=n)

    def ReleasePrefix(self, request: tier_pb2.ReleasePrefixRequest, context: grpc.ServicerContext) -> tier_pb2.ReleasePrefixResponse:
        self.tiers.release(caller_of(context), request.pool_id, request.lease_id, caller_waits(context))
        return tier_pb2.ReleasePrefixResponse()

    def WhereIs(self, request: tier_pb2.WhereIsRequest, context: grpc.ServicerContext) -> tier_pb2.WhereIsResponse:
        where = self.tiers.where_is(caller_of(context), request.pool_id, request.page_keys)
        return tier_pb2.WhereIsResponse(locations=[tier_pb2.PageLocation(page_key=k, tiers=t)
                                                   for k, t in zip(request.page_keys, where)])

    def GetTierStats(self, request: tier_pb2.TierStatsRequest, context: grpc.ServicerContext) -> tier_pb2.TierStatsResponse:
        s = self.tiers.stats(caller_of(context), request.pool_id or None)
        tiers = [tier_pb2.TierCounters(tier=name, capacity_bytes=t["capacity_bytes"], used_bytes=t["used_bytes"],
                                       entries=t["entries"], pinned=t["pinned"], tenant_used_bytes=t["tenant_used_bytes"],
                                       tenant_quota_bytes=t["tenant_quota_bytes"], **{f: t[f] for f in _COUNTER_FIELDS})
                 for name, t in s["tiers"].items()]
        moves = [tier_pb2.TierMove(source=k.split("->")[0], destination=k.split("->")[1], count=v["count"], bytes=v["bytes"])
                 for k, v in s["moves"].items()]
        device = tier_pb2.DeviceTierUsage(**s["device"]) if "device" in s else None
        return tier_pb2.TierStatsResponse(tiers=tiers, moves=moves, prefix_counters=s.get("counters", {}), device=device)
