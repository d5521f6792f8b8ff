"""A removal is final: a record on its way down between two tiers when it is removed never lands afterwards.

Regression (a sibling of attack pass F8): a write into the host tier evicts a record and writes it to
the disk tier after the host write; in between the record is in neither tier's index. A removal
(``Drop`` of an offloaded copy, ``ClearUnits``) that ran then found it in neither, answered, and the
record landed on disk behind it: a dropped copy or a cleared unit came back. The interleaving is
forced: the disk tier's write of the victim waits on an event until the removal has been started.
"""

from __future__ import annotations

import threading

import pytest

from kvtier.server.tiers import DiskTierConfig, HostTierConfig, TierStack
from tierkit import record_of


@pytest.fixture
def stack(tmp_path, codec):
    size = codec.page_nbytes()
    s = TierStack.from_configs([HostTierConfig(capacity_bytes=size + size // 2),  # one record
                                DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=32 << 20)])
    yield s
    s.close()


class HeldVictim:
    """Holds the disk tier's write of ``key`` (a victim on its way down) until :meth:`release`."""

    def __init__(self, stack: TierStack, key: bytes) -> None:
        self.disk = stack.tier("disk")
        self.key = key
        self.arrived, self.go = threading.Event(), threading.Event()
        self._write = self.disk.write

    def write(self, items, **kw):
        if any(k == self.key for k, _ in items):
            self.arrived.set()
            assert self.go.wait(30)
        return self._write(items, **kw)

    def __enter__(self) -> HeldVictim:
        self.disk.write = self.write
        return self

    def __exit__(self, *exc: object) -> None:
        self.go.set()
        self.disk.write = self._write


def in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


@pytest.mark.parametrize("how", ["remove", "remove_prefix"])
def test_a_record_removed_on_its_way_down_does_not_land_afterwards(stack, pool, codec, how):
    """``o:k0`` is in the host tier; putting ``o:k1`` evicts it, and its write to disk is held. A
    removal of ``o:k0`` (by key, or by prefix as ClearUnits removes) started then must not end with
    the record on disk once the write goes on: it waits for the record to land and removes it there."""
    stack.put(b"o:k0", record_of(codec, pool, 1, seed=1), source="device")
    assert stack.where([b"o:k0"]) == [["host"]]
    with HeldVictim(stack, b"o:k0") as held:
        writer, _ = in_thread(lambda: stack.put(b"o:k1", record_of(codec, pool, 2, seed=2), source="device"))
        assert held.arrived.wait(30)  # o:k0 left the host tier and waits to be written to disk
        remover, removed = in_thread(lambda: stack.remove([b"o:k0"]) if how == "remove"
                                     else stack.remove_prefix(b"o:k0"))
        remover.join(0.5)  # the removal waits for the record in flight (or, before, answered at once)
        held.go.set()
        writer.join(30)
        remover.join(30)
    assert not writer.is_alive() and not remover.is_alive()
    assert stack.where([b"o:k0", b"o:k1"]) == [[], ["host"]], "the removed record landed after its removal"
    assert removed[0] in (1, {b"o:k0"})


def test_a_removal_waits_only_for_its_own_records_in_flight(stack, pool, codec):
    """A removal of another key does not wait for a record in flight."""
    stack.put(b"o:k0", record_of(codec, pool, 1, seed=1), source="device")
    with HeldVictim(stack, b"o:k0") as held:
        writer, _ = in_thread(lambda: stack.put(b"o:k1", record_of(codec, pool, 2, seed=2), source="device"))
        assert held.arrived.wait(30)
        remover, _ = in_thread(lambda: stack.remove([b"o:other"]))
        remover.join(10)
        assert not remover.is_alive(), "a removal of another key waited for o:k0 in flight"
        held.go.set()
        writer.join(30)
    assert stack.where([b"o:k0"]) == [["disk"]]
