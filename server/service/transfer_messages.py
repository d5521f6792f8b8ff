"""Transfer domain objects <-> ``kvtier.v1`` transfer messages (layouts, stats, page runs)."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.server.service.messages import pool_layout as pool_layout_message
from kvtier.server.daemon.pools import PoolEntry
from kvtier.server.transfer import LayoutMismatchError, PoolLayout, TransferStats
from kvtier.v1 import pool_pb2, transfer_pb2

COMPONENT_TO_PROTO = {"latent": transfer_pb2.PAGE_COMPONENT_LATENT, "index_k": transfer_pb2.PAGE_COMPONENT_INDEX}
COMPONENT_FROM_PROTO = {v: k for k, v in COMPONENT_TO_PROTO.items()}
TRANSPORTS = {transfer_pb2.TRANSPORT_UNSPECIFIED: "mooncake", transfer_pb2.TRANSPORT_MOONCAKE: "mooncake",
              transfer_pb2.TRANSPORT_GRPC: "grpc"}


def _infos(entries: Sequence[pool_pb2.BufferInfo], what: str, start_layer: int) -> tuple[list[int], list[int], list[int]]:
    ids = [e.layer_id for e in entries]
    if ids != list(range(start_layer, start_layer + len(entries))):
        raise LayoutMismatchError(f"peer {what} buffer infos are not one entry a layer in layer order from layer "
                                  f"{start_layer}: layer ids {ids[:12]}")
    return [e.data_ptr for e in entries], [e.data_len for e in entries], [e.item_len for e in entries]


def _buffer_infos(infos: tuple[Sequence[int], Sequence[int], Sequence[int]], start_layer: int) -> list[pool_pb2.BufferInfo]:
    return [pool_pb2.BufferInfo(layer_id=start_layer + i, data_ptr=p, data_len=n, item_len=it)
            for i, (p, n, it) in enumerate(zip(*infos))]


def transfer_layout(entry: PoolEntry, layout: PoolLayout) -> transfer_pb2.TransferLayout:
    """The TransferLayout message of a daemon pool (its model layout, buffer infos with model layer ids, engine)."""
    start = entry.model.start_layer
    return transfer_pb2.TransferLayout(
        layout=pool_layout_message(entry.model), latent=_buffer_infos(layout.latent, start),
        index=_buffer_infos(layout.index, start),
        engine_endpoint=layout.endpoint,
        registered=[transfer_pb2.RegisteredRange(ptr=p, nbytes=n) for p, n in layout.registered],
    )


def peer_layout(msg: transfer_pb2.TransferLayout) -> PoolLayout:
    """A peer's TransferLayout as a :class:`PoolLayout`. Fingerprint empty when it names no model.

    Raises:
        LayoutMismatchError: a malformed layout (infos not one a layer, bad skip mask).
    """
    lay = msg.layout
    if set(lay.skip_mask) - {"S", "F"}:
        raise LayoutMismatchError(f"peer skip mask {lay.skip_mask!r} has characters other than 'S'/'F'")
    fingerprint = {}
    if lay.model_name:
        fingerprint = {
            "name": lay.model_name, "num_layers": lay.num_layers, "kv_lora_rank": lay.kv_lora_rank,
            "qk_rope_head_dim": lay.qk_rope_head_dim, "index_head_dim": lay.index_head_dim,
            "kv_cache_dtype": lay.kv_cache_dtype, "page_size": lay.page_size,
            "latent_row_bytes": lay.latent_row_bytes, "skip_mask": lay.skip_mask, "start_layer": lay.start_layer,
        }
    try:
        return PoolLayout(
            page_size=lay.page_size, latent_row_bytes=lay.latent_row_bytes, index_page_bytes=lay.index_page_bytes,
            skip_mask=[c == "S" for c in lay.skip_mask], latent=_infos(msg.latent, "latent", lay.start_layer),
            index=_infos(msg.index, "indexer", lay.start_layer), fingerprint=fingerprint, endpoint=msg.engine_endpoint,
            registered=[(r.ptr, r.nbytes) for r in msg.registered],
        )
    except ValueError as e:
        raise LayoutMismatchError(f"peer layout is malformed: {e}") from None


def pull_response(stats: TransferStats, transport: str, seconds: float) -> transfer_pb2.PullKVResponse:
    """What a pull moved, per component and per layer."""
    return transfer_pb2.PullKVResponse(
        num_pages=stats.num_pages, latent_bytes=stats.latent_bytes, index_bytes=stats.index_bytes,
        total_bytes=stats.total_bytes, latent_requests=stats.latent_requests, index_requests=stats.index_requests,
        batches=stats.batches, transport=transport, seconds=seconds,
        layers=[transfer_pb2.LayerTransfer(layer_id=s.layer_id, latent_bytes=s.latent_bytes, index_bytes=s.index_bytes,
                                           latent_requests=s.latent_requests, index_requests=s.index_requests)
                for s in stats.layers],
    )
