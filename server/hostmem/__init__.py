"""Host memory kvtier copies into: one arena, faulted in (and page-locked on CUDA) once, carved by a
page allocator (no grpc here; see the module map in ``kvtier.server``).

Modules: ``extents`` (the page-run allocator, bookkeeping only), ``arena`` (the memfd mapping and
its blocks), ``cuda`` (``cudaHostRegister`` through torch's cudart).
"""

from kvtier.server.hostmem.arena import PAGE_BYTES, ArenaStats, HostArena, HostBlock
from kvtier.server.hostmem.extents import ExtentAllocator, ExtentStats

__all__ = ["ArenaStats", "ExtentAllocator", "ExtentStats", "HostArena", "HostBlock", "PAGE_BYTES"]
