"""How much memory a device has for pools, so a pool too large is refused with figures, not with
the allocator's text.

On the CPU the figure is Linux's ``MemAvailable`` (``/proc/meminfo``: free memory plus what the page
cache can give back without swapping), else ``sysconf`` free pages; on CUDA it is
``torch.cuda.mem_get_info`` (free and total bytes of that device).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes of a device: ``available`` for new allocations now, ``total`` in all (0: unknown)."""

    device: str
    available: int
    total: int


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[name] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def device_memory(device: torch.device | str) -> DeviceMemory:
    """Available and total bytes of ``device`` (``cpu`` or a CUDA device)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        return DeviceMemory(str(dev), int(free), int(total))
    info = _meminfo()
    if "MemAvailable" in info:
        return DeviceMemory("cpu", info["MemAvailable"], info.get("MemTotal", 0))
    page = os.sysconf("SC_PAGE_SIZE")
    return DeviceMemory("cpu", os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page)


def shortfall_message(nbytes: int, mem: DeviceMemory, what: str = "the pool") -> str | None:
    """None if ``nbytes`` fit in ``mem.available``; else one line with the figures and what to do."""
    if nbytes <= mem.available:
        return None
    total = f" of {mem.total:,} in all" if mem.total else ""
    return (f"{what} needs {nbytes:,} bytes but {mem.device} has {mem.available:,} bytes available{total}; "
            f"plan a pool that fits with `kvtier plan --available-bytes {mem.available}` "
            f"(or give the pool a byte budget: `--pool MODEL:{max(mem.available // (1 << 30), 1)}GiB` at serve, "
            f"memory_budget_bytes= in create_pool)")
