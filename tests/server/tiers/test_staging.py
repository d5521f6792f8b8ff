"""The registered staging area: extents are aligned, all-or-nothing, coalesced on release, and a
caller that finds no room waits (then times out) instead of sharing bytes with another batch."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.server.tiers.staging import StagingArea, StagingTimeout


def test_extents_are_aligned_disjoint_and_coalesce():
    area = StagingArea(1024)
    a, b = area.allocate(100), area.allocate(64)
    assert (a.offset, a.nbytes, b.offset, b.nbytes) == (0, 128, 128, 64)
    assert a.ptr == area.ptr and b.ptr == area.ptr + 128
    a.view.fill_(1)
    b.view.fill_(2)
    assert int(area.region[:128].sum()) == 128 and int(area.region[128:192].sum()) == 128
    area.release(a)
    area.release(b)
    assert area.free_bytes == 1024
    whole = area.allocate(1024)  # only possible if the free pieces merged again
    area.release(whole)


def test_too_large_is_an_error_and_no_room_times_out():
    area = StagingArea(256)
    with pytest.raises(ValueError, match="does not fit"):
        area.allocate(257)
    held = area.allocate(200)
    with pytest.raises(StagingTimeout):
        area.allocate(128, timeout_s=0.05)
    area.release(held)


def test_a_waiter_gets_room_when_it_is_released():
    area = StagingArea(256)
    held = area.allocate(256)
    got = []
    t = threading.Thread(target=lambda: got.append(area.allocate(256, timeout_s=60)))
    t.start()
    area.release(held)
    t.join(60)
    assert got and got[0].nbytes == 256


def test_offset_of_tells_what_lies_inside_the_region_and_sources_are_swappable():
    arena = torch.zeros(4096, dtype=torch.uint8)
    area = StagingArea(2048, source=lambda n: arena[1024:1024 + n])
    assert area.ptr == arena[1024:].data_ptr()
    assert area.offset_of(arena[1024 + 64:1024 + 128]) == 64
    assert area.offset_of(arena[:100]) is None
    assert area.offset_of(arena[3000:3100]) is None  # past the region's end
    with pytest.raises(ValueError, match="source"):
        StagingArea(256, source=lambda n: torch.zeros(n, dtype=torch.int32))
