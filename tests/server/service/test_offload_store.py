"""OffloadStore: budget, keys, drop."""

from __future__ import annotations

import pytest

from kvtier.server.service.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from kvtier.server.service.offload_store import HostCopy, OffloadStore


def _copy(nbytes: int) -> HostCopy:
    return HostCopy(copy={}, nbytes=nbytes, num_tokens=1, layout={}, layout_digest="d", source_pool="p")


def test_budget_keys_and_drop():
    s = OffloadStore(100)
    s.put("a", _copy(60))
    assert (s.usage_bytes(), len(s), s.contains("a")) == (60, 1, True)
    with pytest.raises(ResourceExhausted, match="41 bytes, 40 of 100 are free"):
        s.put("b", _copy(41))
    with pytest.raises(AlreadyExists):
        s.put("a", _copy(1))
    with pytest.raises(InvalidArgument):
        s.check_room("", 1)
    s.put("b", _copy(40))
    assert s.usage_bytes() == 100
    assert s.get("b").nbytes == 40
    assert s.drop("a").nbytes == 60 and s.drop("a") is None
    assert (s.usage_bytes(), len(s)) == (40, 1)
    with pytest.raises(NotFound):
        s.get("a")
