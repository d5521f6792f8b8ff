"""Skip-aware DSA KV pools (no grpc here; see the module map in ``kvtier.server``).

Modules: ``arena`` (backing memory), ``validation`` (argument checks), ``mla`` (latent pool),
``dsa`` (latent + indexer pool), ``allocator`` (page allocator), ``factory`` (pool from a model and
role), ``buffer_info`` (ranges for transfer engines).
"""

from kvtier.server.pool.allocator import AllocatorError, PagedTokenAllocator, slots_of_pages
from kvtier.server.pool.arena import resolve_device
from kvtier.server.pool.buffer_info import BufferRange, live_ranges
from kvtier.server.pool.dsa import INDEX_CHUNK_PAGES, DSATokenToKVPool, first_appearance_pages
from kvtier.server.pool.factory import POOL_ROLES, create_pool, skip_mask_for_role
from kvtier.server.pool.mla import KV_CHUNK_SLOTS, MLATokenToKVPool

__all__ = [
    "AllocatorError", "BufferRange", "DSATokenToKVPool", "INDEX_CHUNK_PAGES", "KV_CHUNK_SLOTS",
    "MLATokenToKVPool", "POOL_ROLES", "PagedTokenAllocator", "create_pool", "first_appearance_pages",
    "live_ranges", "resolve_device", "skip_mask_for_role", "slots_of_pages",
]
