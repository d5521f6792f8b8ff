"""The daemon's host arena is registered once with its transfer engine: another daemon's engine reads
a host-tier record's bytes straight out of it (one-sided, by address), and memory outside the
registered ranges cannot be read that way."""

from __future__ import annotations

import pytest
import torch

from kvtier.server.daemon import Daemon, DaemonConfig
from kvtier.server.transfer import TransferError


@pytest.fixture
def pair():
    made = []
    try:
        for _ in range(2):
            made.append(Daemon(DaemonConfig(device="cpu", host_memory_bytes=32 << 20, transfer_engine="mooncake",
                                            transfer_host="127.0.0.1")))
        yield made
    finally:
        for d in made:
            d.close()


def test_another_daemons_engine_reads_a_host_tier_record_by_its_address(pair):
    a, b = pair
    arena = a.pools.host_arena
    assert a.transfer.host_range == arena.registration_range()
    assert a.transfer.host_range in a.transfer.engine.registered
    host = a.tiers.stack.tier("host")
    n = 300_000
    rec = host.record_buffer(n)
    assert arena.owns(rec)
    want = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    rec.copy_(want)
    assert host.write([(b"record", rec)]) == [b"record"]
    held = host.record(b"record")
    assert held.data_ptr() == rec.data_ptr()  # stored in place, in the registered arena
    into = b.pools.host_arena.alloc_tensor(n)  # the reader's registered memory
    into.zero_()
    b.transfer.engine.read_raw(a.transfer.engine.endpoint, into.data_ptr(), held.data_ptr(), n)
    assert torch.equal(into, want)


def test_memory_outside_the_registered_ranges_is_not_readable(pair):
    a, b = pair
    private = torch.randint(0, 256, (4096,), dtype=torch.uint8)  # ordinary memory of daemon a's process
    into = b.pools.host_arena.alloc_tensor(4096)
    with pytest.raises(TransferError):
        b.transfer.engine.read_raw(a.transfer.engine.endpoint, into.data_ptr(), private.data_ptr(), 4096)


def test_starting_the_engine_warns_that_its_ports_are_open_to_all(caplog):
    """The engine's ports listen on every interface without authentication (README, Security): the
    daemon says so at WARNING when the engine starts, and not when it runs without one."""
    with caplog.at_level("WARNING", logger="kvtier.transfer"):
        Daemon(DaemonConfig(device="cpu", host_memory_bytes=32 << 20)).close()
        assert not [r for r in caplog.records if "every interface" in r.getMessage()]
        Daemon(DaemonConfig(device="cpu", host_memory_bytes=32 << 20, transfer_engine="mooncake",
                            transfer_host="127.0.0.1")).close()
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "every interface" in r.getMessage()]
    assert len(warned) == 1 and "without authentication" in warned[0].getMessage()
