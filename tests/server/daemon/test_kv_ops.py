"""KV operations on a daemon pool (``server/daemon/kv_ops.py``) in process: a Restore into named
slots that fails or whose caller leaves changes nothing (attack pass 8, A8-3)."""

from __future__ import annotations

import pytest
import torch
from daemonkit import A, PS, daemon, fill, pool, read_rows

from kvtier.server.daemon import kv_ops
from kvtier.server.daemon.errors import Busy, Cancelled
from kvtier.server.daemon.kv_ops import KVSelection

LAYERS = 4


@pytest.fixture
def d():
    dm = daemon(host_memory_bytes=8 << 20)
    yield dm
    dm.close()


class _Caller:
    """A caller that is there until :meth:`leave`."""

    def __init__(self) -> None:
        self.there = True

    def leave(self) -> None:
        self.there = False

    def __call__(self) -> bool:
        return self.there


def _copy_and_named_slots(d) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A copy ``kb`` of 2 pages of rows of seed 1 (its slots freed), and the caller's named slots
    (2 other pages) holding rows of seed 2; returns ``(named slots, copy rows, named rows)``."""
    pool(d, A, layers=LAYERS)
    src, copy_rows = fill(d, A, "p", 2 * PS, seed=1)
    kv_ops.offload(d.pools, d.offload_store, A, "p", "kb", src, free_slots=True)
    named, named_rows = fill(d, A, "p", 2 * PS, seed=2)
    assert not torch.equal(copy_rows, named_rows)
    return named, copy_rows, named_rows


def _free_pages(d) -> int:
    with d.pools.locked(A, "p", exclusive=False) as e:
        return e.allocator.free_pages


def test_a_restore_with_drop_into_named_slots_whose_caller_left_puts_their_rows_back(d, monkeypatch):
    """Attack pass 8, A8-3: a Restore(drop=True) into named slots whose caller left while the drop
    waited for the tiers answered CANCELLED "nothing was changed", yet the slots held the copy's rows.
    Now the old rows are back, the copy is kept (it restores again). The drop runs under the pool's
    lock (attack pass 9, A9-2), so no other call, and no attached worker told of the failure, saw
    the copy's rows in the slots: the undo happens before the answer."""
    named, copy_rows, named_rows = _copy_and_named_slots(d)
    caller = _Caller()
    drop_taken = d.offload_store.drop_taken
    held_during_drop: list[bool] = []

    def leave_then_drop(*args, **kw):
        entry = d.pools.get(A, "p")
        held_during_drop.append(entry.lock._writer)  # noqa: SLF001 - the pool is held exclusive here
        caller.leave()
        return drop_taken(*args, **kw)

    monkeypatch.setattr(d.offload_store, "drop_taken", leave_then_drop)
    with pytest.raises(Cancelled, match="nothing was changed"):
        kv_ops.restore(d.pools, d.offload_store, A, "p", "kb", named.tolist(), drop=True, wanted=caller)
    assert held_during_drop == [True]
    for layer in range(LAYERS):
        assert torch.equal(read_rows(d, A, "p", named, layer), named_rows)
    assert _free_pages(d) == 512 // PS - 2  # the named pages only: nothing allocated, nothing freed
    monkeypatch.undo()
    kv_ops.restore(d.pools, d.offload_store, A, "p", "kb", named.tolist(), drop=True)  # the copy was kept
    for layer in range(LAYERS):
        assert torch.equal(read_rows(d, A, "p", named, layer), copy_rows)
    kv_ops.read_kv(d.pools, A, KVSelection("p", named.tolist(), (0,), ()))  # no claim left behind


def test_a_restore_into_named_slots_whose_caller_left_while_it_loaded_puts_their_rows_back(d, monkeypatch):
    """A8-3 without drop: the caller leaves while the copy loads into its named slots; the Restore
    is CANCELLED and the slots hold their old rows (before the fix: the copy's)."""
    named, _, named_rows = _copy_and_named_slots(d)
    caller = _Caller()
    with d.pools.locked(A, "p", exclusive=False) as e:
        p = e.pool
    load = p.load_cpu_copy

    def load_then_leave(copy, slots):
        load(copy, slots)
        caller.leave()

    monkeypatch.setattr(p, "load_cpu_copy", load_then_leave)
    with pytest.raises(Cancelled, match="nothing was changed"):
        kv_ops.restore(d.pools, d.offload_store, A, "p", "kb", named.tolist(), drop=False, wanted=caller)
    monkeypatch.undo()
    for layer in range(LAYERS):
        assert torch.equal(read_rows(d, A, "p", named, layer), named_rows)
    assert _free_pages(d) == 512 // PS - 2


def test_a_restore_with_drop_whose_drop_fails_frees_its_fresh_pages(d, monkeypatch):
    """The fresh-pages side (A7-3, and now any failure of the drop): the 2 pages the Restore took
    are freed again and the copy is kept."""
    named, _, _ = _copy_and_named_slots(d)

    def failing_drop(*args, **kw):
        raise OSError("the disk went away")

    monkeypatch.setattr(d.offload_store, "drop_taken", failing_drop)
    with pytest.raises(OSError):
        kv_ops.restore(d.pools, d.offload_store, A, "p", "kb", None, drop=True)
    assert _free_pages(d) == 512 // PS - 2


def test_a_restore_with_drop_writes_nothing_into_its_slots_before_its_last_check(d, monkeypatch):
    """Attack pass 9, A9-2: A8-3's first fix loaded the copy into named slots, let the pool's lock go
    while the drop waited for the disk, and on a late cancel wrote the old rows back seconds after the
    caller was told DEADLINE_EXCEEDED: over what an attached worker had written since through its
    mapping, and over pages it had stored in the prefix cache (served then as hits with bytes never
    stored under their keys). Now the caller is checked once every wait is over, holding the pool and
    the tiers, and only then is the copy loaded and dropped: a caller gone at that check gets
    CANCELLED with its slots never written (no load, no undo) and the copy kept."""
    named, copy_rows, named_rows = _copy_and_named_slots(d)
    with d.pools.locked(A, "p", exclusive=False) as e:
        p = e.pool
    loads: list[int] = []
    real_load = p.load_cpu_copy
    monkeypatch.setattr(p, "load_cpu_copy", lambda copy, slots: (loads.append(int(slots.numel())), real_load(copy, slots))[1])
    answers = iter([True, False])  # there when it takes the pool; gone once it holds the tiers
    with pytest.raises(Cancelled):
        kv_ops.restore(d.pools, d.offload_store, A, "p", "kb", named.tolist(), drop=True, wanted=lambda: next(answers))
    assert loads == []  # never written: nothing to undo later
    for layer in range(LAYERS):
        assert torch.equal(read_rows(d, A, "p", named, layer), named_rows)
    got, _ = kv_ops.restore(d.pools, d.offload_store, A, "p", "kb", named.tolist(), drop=True)
    assert loads == [2 * PS]
    for layer in range(LAYERS):
        assert torch.equal(read_rows(d, A, "p", got, layer), copy_rows)
