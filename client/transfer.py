"""Client methods of ``kvtier.v1.TransferService``: prefill-decode transfer between daemons.

A decode worker asks its daemon to pull a request's pages from the prefill worker's daemon::

    with KVTierClient(decode_address) as c:
        dst = c.allocate_slots("default", n_tokens)          # pages on the decode side
        r = c.pull_kv("default", prefill_address, "default", src_pages=src, dst_pages=dst_pages)
        r.index_bytes                                        # live layers x pages x 8448

On failure the call raises (FAILED_PRECONDITION for a layout mismatch, before any byte moved;
ABORTED when moving failed, after which the destination pages are freed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.client.base import BaseClient
from kvtier.v1 import transfer_pb2, transfer_pb2_grpc

_TRANSPORTS = {"mooncake": transfer_pb2.TRANSPORT_MOONCAKE, "grpc": transfer_pb2.TRANSPORT_GRPC}


def _ids(x: Any) -> list[int]:
    if x is None:
        return []
    if hasattr(x, "reshape") and hasattr(x, "tolist"):
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in x]


@dataclass(frozen=True)
class LayerTransfer:
    """Bytes and requests (engine ranges) one layer cost, per component (indexer: 0 on skip layers)."""

    layer_id: int
    latent_bytes: int
    index_bytes: int
    latent_requests: int
    index_requests: int


@dataclass(frozen=True)
class PullResult:
    """What a PullKV moved.

    Attributes:
        num_pages: pages mapped; latent_bytes / index_bytes / total_bytes: bytes moved;
        latent_requests / index_requests: ranges after coalescing adjacent pages; batches: engine
        batches or stream calls; layers: one :class:`LayerTransfer` a layer; transport: ``mooncake``
        or ``grpc``; seconds: time the daemon spent moving bytes.
    """

    num_pages: int
    latent_bytes: int
    index_bytes: int
    total_bytes: int
    latent_requests: int
    index_requests: int
    batches: int
    transport: str
    seconds: float
    layers: list[LayerTransfer] = field(default_factory=list)


class TransferMixin(BaseClient):
    """TransferService methods. PullKV is retried only on an answer that changed nothing (pages a write
    still arriving is writing, here or on the peer), never after a failure (a failed pull frees the
    destination pages)."""

    @property
    def _transfer(self) -> transfer_pb2_grpc.TransferServiceStub:
        return self.stub(transfer_pb2_grpc.TransferServiceStub)

    def transfer_layout(self, pool_id: str, *, check_pages: Sequence[int] = (), known_digest: str = "",
                        timeout: float | None = None) -> transfer_pb2.TransferLayout:
        """The pool's TransferLayout: layout, latent/indexer buffer infos with layer ids, engine endpoint,
        ``layout_digest``. With ``known_digest`` (the digest of a layout held from an earlier call)
        that still holds, only ``layout_digest`` and ``unchanged=True`` come back."""
        req = transfer_pb2.TransferLayoutRequest(pool_id=pool_id, check_pages=_ids(check_pages), known_digest=known_digest)
        return self.unary(self._transfer.GetTransferLayout, req, idempotent=True, timeout=timeout)

    def pull_kv(
        self,
        pool_id: str,
        peer_address: str,
        peer_pool_id: str,
        *,
        src_pages: Any = None,
        dst_pages: Any = None,
        src_slots: Any = None,
        dst_slots: Any = None,
        transport: str = "mooncake",
        max_batch_items: int = 0,
        timeout: float | None = None,
    ) -> PullResult:
        """Pull pages of ``peer_pool_id`` at ``peer_address`` onto pages of this daemon's ``pool_id``.

        Args:
            src_pages, dst_pages: ``(n,)`` page ids, ``src_pages[i] -> dst_pages[i]``; or
            src_slots, dst_slots: page-aligned token slots (whole pages move).
            transport: ``"mooncake"`` (the transfer engine) or ``"grpc"`` (streaming fallback).
            max_batch_items: ranges per batch (0: the daemon's default).

        Raises:
            InvalidArgumentError: bad mapping, pages not allocated on either side.
            FailedPreconditionError: the layouts differ, or no engine for transport "mooncake".
            KVTierError (code ABORTED): moving failed; the destination pages were freed.
        """
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {sorted(_TRANSPORTS)}, got {transport!r}")
        req = transfer_pb2.PullKVRequest(
            pool_id=pool_id, peer_address=peer_address, peer_pool_id=peer_pool_id, src_pages=_ids(src_pages),
            dst_pages=_ids(dst_pages), src_slots=_ids(src_slots), dst_slots=_ids(dst_slots),
            transport=_TRANSPORTS[transport], max_batch_items=max_batch_items)
        r = self.unary(self._transfer.PullKV, req, idempotent=False, timeout=timeout)
        return PullResult(
            num_pages=r.num_pages, latent_bytes=r.latent_bytes, index_bytes=r.index_bytes, total_bytes=r.total_bytes,
            latent_requests=r.latent_requests, index_requests=r.index_requests, batches=r.batches,
            transport=r.transport, seconds=r.seconds,
            layers=[LayerTransfer(x.layer_id, x.latent_bytes, x.index_bytes, x.latent_requests, x.index_requests)
                    for x in r.layers],
        )
