"""Domain objects -> ``kvtier.v1`` messages (and the component enum both ways).

Other servicers (tiers, transfer) reuse :func:`pool_layout` to describe a pool's layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

from kvtier.server.daemon.core import DaemonStats
from kvtier.server.daemon.errors import InvalidArgument
from kvtier.server.daemon.kv_ops import INDEX_K, INDEX_SCALE, LATENT
from kvtier.server.daemon.pools import PoolEntry
from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool.buffer_info import BufInfos
from kvtier.server.pool_configurator import PoolPlan
from kvtier.v1 import pool_pb2

M = TypeVar("M")

COMPONENT_TO_PROTO = {LATENT: pool_pb2.COMPONENT_LATENT, INDEX_K: pool_pb2.COMPONENT_INDEX_K,
                      INDEX_SCALE: pool_pb2.COMPONENT_INDEX_SCALE}
COMPONENT_FROM_PROTO = {v: k for k, v in COMPONENT_TO_PROTO.items()}


def chained(first: M, rest: Iterator[M], touch: Callable[[], None]) -> Iterator[M]:
    """``first`` then every message of ``rest``, calling ``touch()`` as each one arrives (stream liveness)."""
    yield first
    for msg in rest:
        touch()
        yield msg


def component_name(value: int) -> str:
    """Proto enum -> ``latent``/``index_k``/``index_scale``. Raises InvalidArgument on others."""
    try:
        return COMPONENT_FROM_PROTO[value]
    except KeyError:
        raise InvalidArgument(f"unknown KV component {value}") from None


def pool_layout(model: DSAModelConfig) -> pool_pb2.PoolLayout:
    """The layout message of a pool whose geometry (with its own skip mask) is ``model``."""
    fp = model.fingerprint()
    return pool_pb2.PoolLayout(
        model_name=fp["name"], num_layers=fp["num_layers"], kv_lora_rank=fp["kv_lora_rank"],
        qk_rope_head_dim=fp["qk_rope_head_dim"], index_head_dim=fp["index_head_dim"],
        kv_cache_dtype=fp["kv_cache_dtype"], page_size=fp["page_size"], latent_row_bytes=fp["latent_row_bytes"],
        index_page_bytes=model.index_page_bytes, skip_mask=fp["skip_mask"],
        fingerprint_digest=model.fingerprint_digest(), index_token_bytes=model.index_token_bytes,
        kv_cache_dim=model.kv_cache_dim, start_layer=fp["start_layer"],
    )


def pool_plan(plan: PoolPlan) -> pool_pb2.PoolPlan:
    """A capacity plan message."""
    return pool_pb2.PoolPlan(
        accounting=plan.accounting, available_bytes=plan.available_bytes, naive_cell_bytes=plan.naive_cell_bytes,
        skip_aware_cell_bytes=plan.skip_aware_cell_bytes, naive_tokens=plan.naive_tokens,
        skip_aware_tokens=plan.skip_aware_tokens, gain_ratio=plan.gain_ratio, saved_bytes=plan.saved_bytes,
    )


def pool_info(entry: PoolEntry) -> pool_pb2.PoolInfo:
    """Everything DescribePool says about a pool: layout, sizes, per-layer bytes, plan."""
    pool, alloc = entry.pool, entry.allocator
    layers = []
    for i, buf in enumerate(pool.kv_buffer):
        skip = pool.skip_topk_layers[i]
        layers.append(pool_pb2.LayerInfo(
            layer_id=pool.start_layer + i, skips_topk=skip, latent_row_bytes=pool.row_bytes, latent_bytes=int(buf.nbytes),
            index_page_bytes=0 if skip else pool.index_page_bytes,
            index_bytes=int(pool.index_k_with_scale_buffer[i].nbytes)))
    info = pool_pb2.PoolInfo(
        pool_id=entry.pool_id, layout=pool_layout(entry.model), role=entry.role, device=str(pool.device),
        size_tokens=alloc.size, total_pages=alloc.num_pages, free_pages=alloc.free_pages, used_pages=alloc.used_pages,
        kv_size_bytes=pool.get_kv_size_bytes(), latent_size_bytes=pool.get_kv_size_bytes() - pool.get_index_size_bytes(),
        index_size_bytes=pool.get_index_size_bytes(), live_layers=[pool.start_layer + i for i in pool.live_layers],
        layers=layers, packed_writes=True,
    )
    if entry.plan is not None:
        info.plan.CopyFrom(pool_plan(entry.plan))
    return info


def buffer_infos(entry: PoolEntry, state: BufInfos, contiguous: BufInfos) -> pool_pb2.BufferInfosResponse:
    """State (indexer) and contiguous (latent) buffer infos with (model) layer ids, layout and skip mask."""
    start = entry.pool.start_layer

    def infos(triple: BufInfos) -> list[pool_pb2.BufferInfo]:
        ptrs, lens, items = triple
        return [pool_pb2.BufferInfo(layer_id=start + i, data_ptr=p, data_len=n, item_len=it)
                for i, (p, n, it) in enumerate(zip(ptrs, lens, items, strict=True))]
    return pool_pb2.BufferInfosResponse(layout=pool_layout(entry.model), state=infos(state),
                                        contiguous=infos(contiguous), skip_topk_layers=list(entry.pool.skip_topk_layers))


def stats(s: DaemonStats, max_message_bytes: int) -> pool_pb2.StatsResponse:
    """The caller's pools and counters, every tier's usage (daemon-wide and the caller's tenant's) and
    health, the metrics endpoint's URL."""
    pools = []
    for e in s.pools:
        used = e.allocator.used_pages * e.page_size
        cache = e.prefix_cache.device_use() if e.prefix_cache is not None else {"pinned_pages": 0, "open_leases": 0}
        pools.append(pool_pb2.PoolStats(
            pool_id=e.pool_id, model_name=e.model.name, role=e.role, device=str(e.pool.device),
            size_tokens=e.allocator.size, used_tokens=used, free_tokens=e.allocator.free_tokens,
            kv_size_bytes=e.pool.get_kv_size_bytes(), pinned_pages=cache["pinned_pages"],
            open_leases=cache["open_leases"]))
    tiers = [pool_pb2.TierStats(tier=t.tier, used_bytes=t.used_bytes, budget_bytes=t.budget_bytes, entries=t.entries,
                                tenant_used_bytes=t.tenant_used_bytes, tenant_quota_bytes=t.tenant_quota_bytes,
                                unhealthy=not t.healthy, unhealthy_reason=t.reason, next_probe_seconds=t.next_probe_in_s,
                                policy=t.policy)
             for t in s.tiers]
    return pool_pb2.StatsResponse(
        version=s.version, uptime_seconds=s.uptime_seconds, device=s.device, pools=pools, tiers=tiers,
        counters=s.counters, max_message_bytes=max_message_bytes, tenant=s.tenant, metrics_address=s.metrics_address,
        attach_socket=s.attach_socket, attach_sessions=s.attach_sessions)
