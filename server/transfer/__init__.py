"""Prefill-decode transfer of live KV between pools (no grpc here).

Modules: ``errors`` (typed errors), ``layout`` (pool layout descriptor, compatibility check),
``mapping`` (page mappings, token slots to pages, runs), ``plan`` (transfer plan from buffer infos),
``engine`` (Mooncake Transfer Engine wrapper), ``pull`` (the pull a decode daemon runs).
"""

from kvtier.server.transfer.engine import (
    FAIL_BATCH_ENV, MooncakeTransferEngine, TransferEngineConfig, fail_batch_from_env, registration_ranges,
)
from kvtier.server.transfer.errors import (
    LayoutMismatchError, PageChanged, PageMappingError, TransferEngineUnavailable, TransferError,
)
from kvtier.server.transfer.layout import COMPONENTS, PoolLayout, check_compatible, layout_mismatch, pool_layout
from kvtier.server.transfer.mapping import check_page_mapping, page_runs, pages_from_slots
from kvtier.server.transfer.pull import MooncakeTransport, PageTransport, pull_pages
from kvtier.server.transfer.plan import (
    DEFAULT_BATCH_ITEMS, MAX_BATCH_ITEMS, LayerStats, TransferItem, TransferPlan, TransferStats, plan_pull, plan_transfer,
)

__all__ = [
    "COMPONENTS", "DEFAULT_BATCH_ITEMS", "FAIL_BATCH_ENV", "LayerStats", "LayoutMismatchError", "MAX_BATCH_ITEMS",
    "MooncakeTransferEngine", "MooncakeTransport", "PageChanged", "PageTransport", "pull_pages", "PageMappingError", "PoolLayout", "TransferEngineConfig", "TransferEngineUnavailable",
    "TransferError", "TransferItem", "TransferPlan", "TransferStats", "check_compatible", "check_page_mapping",
    "fail_batch_from_env", "layout_mismatch", "page_runs", "pages_from_slots", "plan_pull", "plan_transfer",
    "pool_layout", "registration_ranges",
]
