"""The pull a decode daemon runs: check layouts, plan from buffer infos, move, report.

Transports implement :class:`PageTransport`: the Mooncake engine (one-sided reads of registered
memory) or the gRPC fallback (a stream of page runs). Both take the same :class:`TransferPlan`, so
bytes moved, requests and per-layer figures are the plan's whatever the transport.
"""

from __future__ import annotations

from typing import Protocol

from kvtier.server.transfer.engine import MooncakeTransferEngine
from kvtier.server.transfer.errors import TransferEngineUnavailable
from kvtier.server.transfer.layout import PoolLayout
from kvtier.server.transfer.plan import TransferPlan, TransferStats


class PageTransport(Protocol):
    """Moves a plan's ranges from a peer into local memory."""

    name: str

    def pull(self, remote: PoolLayout, plan: TransferPlan) -> None:
        """Run every batch of ``plan``; raise :class:`TransferError` on the first failure."""


class MooncakeTransport:
    """:class:`PageTransport` over a :class:`MooncakeTransferEngine` (the peer's published endpoint)."""

    name = "mooncake"

    def __init__(self, engine: MooncakeTransferEngine) -> None:
        self.engine = engine

    def pull(self, remote: PoolLayout, plan: TransferPlan) -> None:
        if not remote.endpoint:
            raise TransferEngineUnavailable("the peer publishes no transfer engine endpoint (started with --transfer-engine none?); use transport 'grpc'")
        self.engine.read(remote.endpoint, plan)


def pull_pages(transport: PageTransport, remote: PoolLayout, plan: TransferPlan) -> TransferStats:
    """Run ``plan`` through ``transport`` and return what moved (the plan's figures).

    Raises:
        TransferError: from the transport; the destination pages hold undefined bytes and the
            caller must not present them as valid.
    """
    transport.pull(remote, plan)
    return plan.stats()
