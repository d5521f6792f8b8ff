"""The one offload store, in process: copies are records in the tier stack; a daemon with no tier
keeps none (RESOURCE_EXHAUSTED, nothing stored)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvtier.server.daemon import Daemon, DaemonConfig, ResourceExhausted
from kvtier.server.daemon import kv_ops
from kvtier.server.daemon.errors import AlreadyExists, Cancelled, InvalidArgument, NotFound
from kvtier.server.daemon.pools import PoolRequest
from kvtier.server.daemon.tenants import Caller

PS = 64
ME = Caller.default()


def _daemon(**config) -> Daemon:
    return Daemon(DaemonConfig(device="cpu", **config))


def _slow_disk_daemon(tmp_path, monkeypatch, host_memory_bytes: int = 4 << 20, **tiers) -> tuple[Daemon, Any]:
    """A daemon with a disk tier under ``tmp_path/disk`` (64 MiB unless ``disk_bytes``) whose commits the
    test holds with the slow-disk file (returned: write "" to hold, unlink to let go)."""
    from kvtier.server.daemon.tier_settings import TierSettings
    from kvtier.server.tiers.disk_faults import SLOW_FILE_ENV

    slow = tmp_path / "slow"
    monkeypatch.setenv(SLOW_FILE_ENV, str(slow))
    tiers.setdefault("disk_bytes", 64 << 20)
    return _daemon(host_memory_bytes=host_memory_bytes, tiers=TierSettings(disk_path=str(tmp_path / "disk"), **tiers)), slow


def _pool(d: Daemon, pool_id: str = "p", tokens: int = 512):
    return d.pools.create(ME, PoolRequest(pool_id=pool_id, preset="glm-5.2", num_layers=4, size_tokens=tokens))


def _fill(d: Daemon, pool_id: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    with d.pools.locked(ME, pool_id, exclusive=True) as e:
        slots = e.alloc(n)
        rows = torch.randint(0, 256, (n, e.pool.row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        for layer in range(e.pool.layer_num):
            e.pool.set_kv_buffer(layer, slots, rows)
    return slots, rows


def test_a_daemon_without_any_tier_refuses_every_copy_and_stores_nothing():
    """host_memory_bytes=0 and no disk: the stack is empty; Offload is RESOURCE_EXHAUSTED and the pool keeps its slots."""
    d = _daemon(host_memory_bytes=0)
    try:
        assert d.tiers.stack.tiers == []
        _pool(d)
        slots, _ = _fill(d, "p", PS, seed=1)
        with pytest.raises(ResourceExhausted, match="no tier to keep copies in"):
            kv_ops.offload(d.pools, d.offload_store, ME, "p", "k", slots, free_slots=True)
        assert not d.offload_store.contains(ME, "k")
        assert d.pools.get(ME, "p").allocator.used_pages == 1  # not freed
    finally:
        d.close()


def test_copies_round_trip_keys_are_checked_and_drop_frees_the_key():
    d = _daemon(host_memory_bytes=4 << 20)
    try:
        _pool(d)
        slots, rows = _fill(d, "p", 100, seed=2)
        r = kv_ops.offload(d.pools, d.offload_store, ME, "p", "req", slots, free_slots=True)
        assert (r.num_tokens, r.freed_pages) == (100, 2)
        with pytest.raises(AlreadyExists):
            kv_ops.offload(d.pools, d.offload_store, ME, "p", "req", _fill(d, "p", 10, seed=3)[0], free_slots=False)
        with pytest.raises(InvalidArgument):
            d.offload_store.check_room(ME, "", 1)
        back, nbytes = kv_ops.restore(d.pools, d.offload_store, ME, "p", "req", None, drop=False)
        assert nbytes == r.nbytes
        with d.pools.locked(ME, "p", exclusive=False) as e:
            for layer in range(4):
                assert torch.equal(e.pool.get_kv_buffer_rows(layer, back).reshape(100, -1), rows)
        assert d.offload_store.drop(ME, "req") == r.nbytes and d.offload_store.drop(ME, "req") is None
        with pytest.raises(NotFound):
            d.offload_store.get(ME, "req")
    finally:
        d.close()


def test_a_copy_a_restore_with_drop_is_taking_is_not_taken_twice():
    """Attack pass 4, A4-12: Restore(drop=True) was get, load, drop with nothing held between, so
    concurrent takers each got the copy (449 of 600 copies restored twice). While one Restore with
    drop has the copy, another is NOT_FOUND; a plain Restore (a read) still reads it; once the first
    is done the copy is gone; a taker that fails leaves the copy for the next."""
    d = _daemon(host_memory_bytes=4 << 20)
    try:
        _pool(d)
        slots, rows = _fill(d, "p", PS, seed=5)
        kv_ops.offload(d.pools, d.offload_store, ME, "p", "k", slots, free_slots=True)
        with d.offload_store.taking(ME, "k") as hc:  # a first Restore(drop=True), mid-way
            assert hc.num_tokens == PS
            with pytest.raises(NotFound, match="another Restore with drop is taking it"):
                kv_ops.restore(d.pools, d.offload_store, ME, "p", "k", None, drop=True)
            read, _ = kv_ops.restore(d.pools, d.offload_store, ME, "p", "k", None, drop=False)
        with pytest.raises(InvalidArgument):  # a taker that fails (wrong slot count) leaves the copy
            kv_ops.restore(d.pools, d.offload_store, ME, "p", "k", [0, 1, 2], drop=True)
        back, _ = kv_ops.restore(d.pools, d.offload_store, ME, "p", "k", None, drop=True)
        with d.pools.locked(ME, "p", exclusive=False) as e:
            for t in (read, back):
                assert torch.equal(e.pool.get_kv_buffer_rows(0, t).reshape(PS, -1), rows)
        with pytest.raises(NotFound):
            kv_ops.restore(d.pools, d.offload_store, ME, "p", "k", None, drop=True)
    finally:
        d.close()


def test_a_restore_with_drop_never_drops_a_newer_copy_of_its_key():
    """Attack pass 5, A5-6: while a Restore(drop=True) loaded copy v1, another client dropped the key
    and offloaded v2 under it (acknowledged); the Restore's final drop then removed v2. It now drops
    only the copy it took."""
    d = _daemon(host_memory_bytes=4 << 20)
    try:
        _pool(d)
        kv_ops.offload(d.pools, d.offload_store, ME, "p", "k", _fill(d, "p", PS, seed=6)[0], free_slots=True)
        new_slots, new_rows = _fill(d, "p", PS, seed=7)
        with d.offload_store.taking(ME, "k") as hc:  # the Restore(drop=True) has taken v1 and is loading it
            assert d.offload_store.drop(ME, "k") is not None  # meanwhile: v1 dropped, v2 offloaded
            kv_ops.offload(d.pools, d.offload_store, ME, "p", "k", new_slots, free_slots=True)
            assert d.offload_store.drop_taken(ME, "k", hc.nbytes) is False
        back, _ = kv_ops.restore(d.pools, d.offload_store, ME, "p", "k", None, drop=True)  # v2 is there, whole
        with d.pools.locked(ME, "p", exclusive=False) as e:
            assert torch.equal(e.pool.get_kv_buffer_rows(0, back).reshape(PS, -1), new_rows)
        assert not d.offload_store.contains(ME, "k")
    finally:
        d.close()


def test_a_restore_or_offload_whose_caller_is_gone_at_the_end_changes_nothing():
    """Attack pass 7, A7-2 and A7-3, in process: a Restore(drop=True) whose caller is gone by the time
    it holds the tiers (the last check, before the load) keeps the copy and frees the fresh pages it had allocated; an Offload
    whose caller is gone once its copy is committed takes the copy back and frees no slot. The same
    calls with their caller there restore (and drop) and offload as usual."""
    d = _daemon(host_memory_bytes=4 << 20)
    try:
        _pool(d)
        slots, rows = _fill(d, "p", PS, seed=8)
        kv_ops.offload(d.pools, d.offload_store, ME, "p", "k", slots, free_slots=True)
        with d.pools.locked(ME, "p", exclusive=False) as e:
            free = e.allocator.free_pages
        answers = iter([True, False])  # wanted(): once holding the pool, then holding the tiers, before the load
        with pytest.raises(Cancelled):
            kv_ops.restore(d.pools, d.offload_store, ME, "p", "k", None, drop=True, wanted=lambda: next(answers))
        with d.pools.locked(ME, "p", exclusive=False) as e:
            assert e.allocator.free_pages == free  # the fresh page went back
        assert d.offload_store.contains(ME, "k")
        back, _ = kv_ops.restore(d.pools, d.offload_store, ME, "p", "k", None, drop=True)
        with d.pools.locked(ME, "p", exclusive=False) as e:
            assert torch.equal(e.pool.get_kv_buffer_rows(0, back).reshape(PS, -1), rows)
        assert not d.offload_store.contains(ME, "k")

        answers = iter([True, True, False])  # once holding the pool, before the copy is placed, once committed
        with pytest.raises(Cancelled):
            kv_ops.offload(d.pools, d.offload_store, ME, "p", "k2", back, free_slots=True, wanted=lambda: next(answers))
        assert not d.offload_store.contains(ME, "k2")
        with d.pools.locked(ME, "p", exclusive=False) as e:
            assert e.allocator.free_pages == free - 1  # its slots still allocated
            assert torch.equal(e.pool.get_kv_buffer_rows(0, back).reshape(PS, -1), rows)
        kv_ops.offload(d.pools, d.offload_store, ME, "p", "k2", back, free_slots=True)
        assert d.offload_store.contains(ME, "k2")
    finally:
        d.close()


def test_a_copy_whose_disk_commit_is_slow_holds_up_no_offload_or_restore_of_another_key(tmp_path, monkeypatch):
    """Attack pass 8, A8-7: without write-behind, an Offload whose copy goes to the disk (larger than
    the host tier) committed under the offload store's one lock, so another tenant's Offload that
    needed the host tier only waited for that disk (4.55 s in the attack). Now each key has its own
    lock: while tenant A's copy waits in its disk commit (held by the test's slow-disk file), tenant
    B's Offload and Restore of other keys, host tier only, complete; A's Offload completes once the
    disk goes on. (A Drop or a Restore(drop) takes every tier's index lock to remove a copy wherever
    it is, so without write-behind it waits for the disk's commit: that is the tier's own lock.)"""
    import threading

    d, slow = _slow_disk_daemon(tmp_path, monkeypatch, disk_bytes=256 << 20, disk_write_behind=False)
    a, b = Caller(tenant="team-a"), Caller(tenant="team-b")
    try:
        for caller, tokens in ((a, 4096), (b, 512)):
            d.pools.create(caller, PoolRequest(pool_id="p", preset="glm-5.2", num_layers=4, size_tokens=tokens))
        with d.pools.locked(a, "p", exclusive=True) as e:
            big = e.alloc(4096)  # about 11 MB: more than the 4 MiB host tier, so the copy goes to disk
        slots, rows = _fill_as(d, b, PS, seed=11)
        kv_ops.offload(d.pools, d.offload_store, b, "p", "old", slots, free_slots=False)
        slow.write_text("")  # every disk commit now waits until the file holds a number
        done: list[object] = []
        holder = threading.Thread(target=lambda: done.append(
            kv_ops.offload(d.pools, d.offload_store, a, "p", "big", big, free_slots=False)))
        holder.start()
        try:
            threading.Event().wait(1.0)  # A's 11 MB copy is encoded and its disk commit waits on the file
            assert not done
            finished: list[str] = []

            def b_calls() -> None:
                kv_ops.offload(d.pools, d.offload_store, b, "p", "new", slots, free_slots=False)
                finished.append("offload")
                back, _ = kv_ops.restore(d.pools, d.offload_store, b, "p", "old", None, drop=False)
                with d.pools.locked(b, "p", exclusive=False) as e:
                    assert torch.equal(e.pool.get_kv_buffer_rows(0, back).reshape(PS, -1), rows)
                finished.append("restore")

            other = threading.Thread(target=b_calls)
            other.start()
            other.join(5)
            assert finished == ["offload", "restore"] and not done  # B done while A's commit still waits
        finally:
            slow.unlink()
            holder.join(30)
        assert len(done) == 1 and d.offload_store.contains(a, "big")
        assert d.offload_store.drop(b, "old") is not None and d.offload_store.drop(b, "new") is not None
    finally:
        d.close()


def _fill_as(d: Daemon, caller: Caller, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    with d.pools.locked(caller, "p", exclusive=True) as e:
        slots = e.alloc(n)
        rows = torch.randint(0, 256, (n, e.pool.row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        for layer in range(e.pool.layer_num):
            e.pool.set_kv_buffer(layer, slots, rows)
    return slots, rows


def test_a_restore_with_drop_during_its_copys_offload_waits_for_it_and_takes_it_once(tmp_path, monkeypatch):
    """Attack pass 9, A9-3: with the per-key locks of A8-7 a Restore(drop=True) that found the copy
    while its Offload was still committing (to a slow disk without write-behind; the host tier held
    the record already) recorded "no put yet", answered OK and dropped nothing, and a second
    Restore(drop=True) restored the same copy again. Taking a copy now waits for a put of its key in
    progress: the first Restore(drop) gets the copy once the Offload ends and drops it, the second is
    NOT_FOUND."""
    import threading

    d, slow = _slow_disk_daemon(tmp_path, monkeypatch, disk_bytes=64 << 20, disk_write_behind=False, write_through=True)
    try:
        _pool(d)
        slots, rows = _fill(d, "p", PS, seed=13)
        slow.write_text("")  # every disk commit waits until the file holds a number
        offloaded: list[object] = []
        offload = threading.Thread(target=lambda: offloaded.append(
            kv_ops.offload(d.pools, d.offload_store, ME, "p", "K", slots, free_slots=False)))
        offload.start()
        for _ in range(250):  # until the host tier holds the record (the disk commit is held)
            if d.tiers.stack.cascade[0].contains([d.offload_store._key(ME, "K")])[0]:  # noqa: SLF001
                break
            threading.Event().wait(0.02)
        restored: list[object] = []
        first = threading.Thread(target=lambda: restored.append(
            kv_ops.restore(d.pools, d.offload_store, ME, "p", "K", None, drop=True)))
        first.start()
        threading.Event().wait(0.3)
        assert not restored  # it waits for the Offload of its key
        slow.unlink()
        offload.join(30)
        first.join(30)
        assert len(offloaded) == 1 and len(restored) == 1
        with d.pools.locked(ME, "p", exclusive=False) as e:
            assert torch.equal(e.pool.get_kv_buffer_rows(0, restored[0][0]).reshape(PS, -1), rows)
        with pytest.raises(NotFound):
            kv_ops.restore(d.pools, d.offload_store, ME, "p", "K", None, drop=True)
        assert not d.offload_store.contains(ME, "K")
    finally:
        if slow.exists():
            slow.unlink()
        d.close()


def test_a_copy_on_its_way_down_to_the_disk_is_still_there_for_every_call(tmp_path, monkeypatch):
    """Attack pass 9, A9-7: a copy evicted from the host tier whose disk write waited for the disk (a
    synchronous commit of another copy held it) was in no tier's index: an Offload of its key was
    taken instead of ALREADY_EXISTS (the old copy then landed on the disk under the new one and came
    back after an eviction), a Restore was NOT_FOUND and a Drop dropped nothing (the copy came back).
    A copy in flight is now held: the Offload is ALREADY_EXISTS, and a Drop waits for it to land and
    drops it."""
    import threading

    per_copy = 200 << 10  # one 64-token copy of 4 layers is ~197 KB
    d, slow = _slow_disk_daemon(tmp_path, monkeypatch, host_memory_bytes=2 * per_copy + (16 << 10),
                                disk_write_behind=False, policy="lru")
    try:
        _pool(d)
        slots, rows = _fill(d, "p", PS, seed=21)
        store, stack = d.offload_store, d.tiers.stack
        for k in ("X", "K"):
            kv_ops.offload(d.pools, store, ME, "p", k, slots, free_slots=False)
        assert [len(t.index) for t in stack.cascade] == [2, 0]
        slow.write_text("")  # every disk commit now waits until the file is removed
        xkey, kkey = store._key(ME, "X"), store._key(ME, "K")  # noqa: SLF001
        threads = [threading.Thread(target=kv_ops.offload, args=(d.pools, store, ME, "p", f, slots),
                                    kwargs={"free_slots": False}) for f in ("F1", "F2")]

        def until(cond) -> None:
            for _ in range(300):
                if cond():
                    return
                threading.Event().wait(0.02)
            pytest.fail("the copy never set off down")

        threads[0].start()  # evicts X: its disk commit is held, holding the disk
        until(lambda: stack.in_flight(xkey))
        threads[1].start()  # evicts K: its disk write waits for the disk, so K is in flight
        until(lambda: stack.in_flight(kkey))
        assert store.contains(ME, "K")
        with pytest.raises(AlreadyExists):
            kv_ops.offload(d.pools, store, ME, "p", "K", slots, free_slots=False)
        dropped: list[object] = []
        drop = threading.Thread(target=lambda: dropped.append(store.drop(ME, "K")))
        drop.start()
        threading.Event().wait(0.2)
        assert not dropped  # it waits for K to land
        slow.unlink()
        for t in (*threads, drop):
            t.join(30)
        assert dropped and dropped[0] is not None  # it found the copy and dropped it
        assert not store.contains(ME, "K")
        with pytest.raises(NotFound):
            store.get(ME, "K")
        back, _ = kv_ops.restore(d.pools, store, ME, "p", "X", None, drop=False)
        with d.pools.locked(ME, "p", exclusive=False) as e:
            assert torch.equal(e.pool.get_kv_buffer_rows(0, back).reshape(PS, -1), rows)
    finally:
        if slow.exists():
            slow.unlink()
        d.close()


def test_a_restore_with_drop_never_takes_a_copy_whose_offload_then_fails(tmp_path, monkeypatch):
    """A9-3's other side: a Restore(drop=True) that came while a durable Offload waited for its disk
    commit took the copy, and the Offload, its caller gone by then, was told CANCELLED ("nothing was
    changed") for a copy another call had consumed. The Restore now waits for the put's outcome:
    here the Offload's caller leaves during the held commit, the copy is taken back, and the Restore
    is NOT_FOUND."""
    import threading

    d, slow = _slow_disk_daemon(tmp_path, monkeypatch, disk_bytes=64 << 20, write_through=True)
    try:
        _pool(d)
        slots, _ = _fill(d, "p", PS, seed=31)
        slow.write_text("")  # every disk commit waits until the file is removed
        there = threading.Event()
        there.set()
        offloaded: list[BaseException | object] = []

        def offload() -> None:
            try:
                offloaded.append(kv_ops.offload(d.pools, d.offload_store, ME, "p", "K", slots, free_slots=False,
                                                wanted=there.is_set))
            except BaseException as e:  # noqa: BLE001 - the test looks at it
                offloaded.append(e)

        t = threading.Thread(target=offload)
        t.start()
        tkey = d.offload_store._key(ME, "K")  # noqa: SLF001
        for _ in range(250):  # the copy is in the host tier; its durable commit is held
            if d.tiers.stack.cascade[0].contains([tkey])[0]:
                break
            threading.Event().wait(0.02)
        restored: list[BaseException | object] = []

        def restore() -> None:
            try:
                restored.append(kv_ops.restore(d.pools, d.offload_store, ME, "p", "K", None, drop=True))
            except BaseException as e:  # noqa: BLE001
                restored.append(e)

        r = threading.Thread(target=restore)
        r.start()
        threading.Event().wait(0.3)
        assert not restored  # it waits for the Offload's outcome
        there.clear()  # the Offload's caller leaves
        slow.unlink()
        t.join(30)
        r.join(30)
        assert isinstance(offloaded[0], Cancelled)
        assert isinstance(restored[0], NotFound)
        assert not d.offload_store.contains(ME, "K")
    finally:
        if slow.exists():
            slow.unlink()
        d.close()


def test_a_drop_whose_delete_cannot_commit_before_its_deadline_answers_before_it(tmp_path, monkeypatch):
    """Attack pass 10, A10-1: a Drop removes the copy from the indexes, queues its delete on the
    disk's write-behind and waits for the commit before it answers; with a slow disk the caller's
    deadline passed in that wait, and the caller was told DEADLINE_EXCEEDED for a copy that was gone.
    The wait now ends a margin before the deadline. Here the disk's commits are held right after the
    removal (behind another copy's write); the Drop, 1 s from its deadline, answers within it, the
    copy gone; once the disk goes on, its delete commits."""
    import threading
    import time

    d, slow = _slow_disk_daemon(tmp_path, monkeypatch, disk_bytes=64 << 20, write_through=True)
    try:
        _pool(d)
        slots, _ = _fill(d, "p", PS, seed=41)
        kv_ops.offload(d.pools, d.offload_store, ME, "p", "K", slots, free_slots=False)
        stack = d.tiers.stack
        real_remove = stack.remove
        late: list[threading.Thread] = []

        def remove_then_hold(keys, **kw):
            n = real_remove(keys, **kw)
            slow.write_text("")  # the disk holds every commit from now on
            t = threading.Thread(target=kv_ops.offload, args=(d.pools, d.offload_store, ME, "p", "other", slots),
                                 kwargs={"free_slots": False})
            t.start()  # its write-through commit goes first and waits
            late.append(t)
            time.sleep(0.2)
            return n

        monkeypatch.setattr(stack, "remove", remove_then_hold)
        deadline = time.monotonic() + 1.0

        def wanted() -> bool:
            return time.monotonic() < deadline

        wanted.time_left = lambda: deadline - time.monotonic()  # as a gRPC call's check carries it
        assert d.offload_store.drop(ME, "K", wanted=wanted) is not None
        assert time.monotonic() < deadline  # answered before its caller's deadline
        assert not d.offload_store.contains(ME, "K")
    finally:
        if slow.exists():
            slow.unlink()
        for t in late:
            t.join(30)
        d.close()
