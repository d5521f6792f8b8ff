"""A call whose caller gave up while it waited for the pool's lock changes nothing (attack pass 4, A4-6).

Before the fix an AllocateSlots and a Restore(drop=True) that passed their deadline while an Offload
held the pool's lock still ran once the lock was free: the pages stayed allocated with no owner
anybody knew of, and the copy was loaded into a page nobody was told about and dropped from every
tier. Each call that changes the pool (AllocateSlots, FreeSlots, MoveKV, Offload, Restore, and
WriteKV as before) now checks, once it holds the lock, that its caller is still there.

The lock is held on purpose, not by timing: an Offload with ``free_slots`` holds the pool's lock
exclusively while a write-through disk tier commits, and the test-only slow-disk hook holds that
commit until the test releases it.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.client import KVTierClient
from kvtier.client.errors import DeadlineExceededError, KVTierError
from kvtier.client.spawn import DaemonProcess

PAGES = 16


def _held_disk_args(tmp_path) -> list[str]:
    """A daemon whose pool's lock an Offload with ``free_slots`` holds while the slow-disk hook holds
    its write-through commit."""
    return ["--device", "cpu", "--pool", f"glm-5.2:{PAGES * 64}", "--pool-layers", "2", "--host-memory", "1MiB",
            "--disk-path", str(tmp_path / "disk"), "--disk-size", "64MiB", "--write-through", "--no-disk-write-behind"]


def _until_the_pool_is_held(late: KVTierClient) -> None:
    """Wait until the Offload holds the pool's lock (a DescribePool waits on it)."""
    for _ in range(200):
        try:
            late.describe_pool("default", timeout=0.2)
        except DeadlineExceededError:
            return
    pytest.fail("the Offload never held the pool's lock")


def test_calls_that_gave_up_waiting_for_the_pool_change_nothing(tmp_path):
    slow = tmp_path / "slow"
    with DaemonProcess(extra_args=_held_disk_args(tmp_path), env={"KVTIER_TEST_DISK_SLOW_FILE": str(slow)}) as d, \
            KVTierClient(d.address, timeout=60) as c:
        keep = c.allocate_slots("default", 64)
        c.offload("default", "precious", keep, free_slots=True)  # the only copy of these bytes
        first = c.restore("default", "precious")  # (restored once to know its bytes)
        want = c.read_kv("default", first)
        c.free_slots("default", first)
        held = c.allocate_slots("default", 64)
        slow.write_text("")  # from now on every disk commit waits until the file holds a number
        holder = threading.Thread(target=lambda: c.offload("default", "blocker", held, free_slots=True))
        holder.start()
        try:
            with KVTierClient(d.address, timeout=60, retries=0) as late:
                _until_the_pool_is_held(late)
                with pytest.raises(DeadlineExceededError):
                    late.allocate_slots("default", 4 * 64, timeout=1.0)
                with pytest.raises(DeadlineExceededError):
                    late.restore("default", "precious", drop=True, timeout=1.0)
        finally:
            slow.unlink()  # commits go on at once
            holder.join(60)
        assert not holder.is_alive()
        info = c.describe_pool("default")
        assert info.free_pages == PAGES  # nothing leaked: every page the test allocated was freed or offloaded
        got = c.restore("default", "precious", drop=True)  # the copy is still there, whole
        back = c.read_kv("default", got)
        assert all(torch.equal(back.latent[l], want.latent[l]) for l in want.latent)


def test_drop_clear_units_and_prefix_calls_that_gave_up_waiting_change_nothing(tmp_path):
    """Attack pass 5, A5-7: a Drop and a ClearUnits told DEADLINE_EXCEEDED while they waited for a
    disk commit still removed the copy and the units once the disk went on; StorePrefix and
    ReleasePrefix had the same shape (no check once the pool's lock was held). Each now checks its
    caller holding the locks it waited for: after the disk goes on, the copy restores byte-exact,
    the unit reads back whole, nothing was stored under the prefix keys, and both leases are still
    open (a store and a release of them then work)."""
    from kvtier.client.storage import UnitSpaceSpec

    space = UnitSpaceSpec("GLM-5.2", num_layers=2, start_layer=0, kv_lora_rank=512, qk_rope_head_dim=64,
                          index_head_dim=128, kv_cache_dtype="fp8", page_size=64, latent_row_bytes=656,
                          skip_mask="FF")
    unit = torch.randint(0, 256, (space.part_nbytes("both"),), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(7))
    slow = tmp_path / "slow"
    with DaemonProcess(extra_args=_held_disk_args(tmp_path), env={"KVTIER_TEST_DISK_SLOW_FILE": str(slow)}) as d, \
            KVTierClient(d.address, timeout=60) as c:
        keep = c.allocate_slots("default", 64)
        want = c.read_kv("default", keep)
        c.offload("default", "precious", keep, free_slots=True)
        assert c.put_units(space, [b"u1"], "both", unit).completed == 1
        keys = [b"p0", b"p1"]
        store_lease = c.load_prefix("default", keys, 128)
        release_lease = c.load_prefix("default", [b"q0"], 64)
        held = c.allocate_slots("default", 64)
        free_before = c.describe_pool("default").free_pages
        slow.write_text("")  # from now on every disk commit waits until the file holds a number
        holder = threading.Thread(target=lambda: c.offload("default", "blocker", held, free_slots=True))
        holder.start()
        late_answers: dict[str, str] = {}
        try:
            with KVTierClient(d.address, timeout=60, retries=0) as late:
                _until_the_pool_is_held(late)
                for name, call in (("drop", lambda: late.drop("precious", timeout=1.0)),
                                   ("clear_units", lambda: late.clear_units(space, timeout=1.0)),
                                   ("store_prefix", lambda: late.store_prefix(store_lease, keys, store_lease.slots,
                                                                              timeout=1.0)),
                                   ("release_prefix", lambda: late.release_prefix(release_lease, timeout=1.0))):
                    try:
                        late_answers[name] = f"answered {call()!r}"
                    except DeadlineExceededError:
                        late_answers[name] = "deadline"
        finally:
            slow.unlink()  # commits go on at once
            holder.join(60)
        assert not holder.is_alive()
        assert late_answers == dict.fromkeys(("drop", "clear_units", "store_prefix", "release_prefix"), "deadline")
        assert c.describe_pool("default").free_pages == free_before + 1  # the blocker's page freed, nothing else
        out = torch.zeros_like(unit)
        assert c.get_units(space, [b"u1"], "both", out) == [True] and torch.equal(out, unit)
        assert c.lookup_prefix("default", keys).tiers == []  # nothing stored under the keys
        got = c.restore("default", "precious", drop=True)
        back = c.read_kv("default", got)
        assert all(torch.equal(back.latent[l], want.latent[l]) for l in want.latent)
        assert c.store_prefix(store_lease, keys, store_lease.slots, release=True) == 2
        c.release_prefix(release_lease)


def test_a_clear_waiting_for_a_slow_disk_holds_up_no_other_unit_call(tmp_path):
    """Attack pass 7, A7-7: a ClearUnits (of a space with no unit of the caller's at all) held the unit
    store's clear guard while it waited for every tenant's disk write-behind; every PutUnits and the
    GetUnits promotions of every tenant waited on that guard, and the stream watchdog cancelled them
    as idle after 30 s. The clear now waits for the disk holding nothing, and a unit call's wait for
    the guard is the daemon's turn, not the client's idleness. Here, while a clear waits on a held
    disk, puts and reads of another space answer within a 2 s deadline; the clear then ends and
    removes its own space's units only. (A put that gives up behind the guard stores nothing:
    ``tests/server/daemon/test_unit_store.py``.)"""
    import time

    from kvtier.client.storage import UnitSpaceSpec

    space = UnitSpaceSpec("glm-5.2", num_layers=4, start_layer=0, kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128,
                          kv_cache_dtype="fp8", page_size=64, latent_row_bytes=656, skip_mask="FFFS")
    other = UnitSpaceSpec(**{**space.__dict__, "scope": "other"})
    nb = space.part_nbytes("both")
    slow = tmp_path / "slow"
    args = ["--device", "cpu", "--disk-path", str(tmp_path / "disk"), "--disk-size", "1GiB", "--host-memory", "4MiB",
            "--workers", "16"]
    with DaemonProcess(extra_args=args, env={"KVTIER_TEST_DISK_SLOW_FILE": str(slow)}) as d, \
            KVTierClient(d.address, timeout=120) as c:
        c.put_units(other, [b"mine"], "both", torch.full((nb,), 0x33, dtype=torch.uint8))
        slow.write_text("")  # every disk commit waits until the file holds a number
        for i in range(60):  # more than the host tier holds: units go down to the held disk
            c.put_units(space, [f"fill{i}".encode()], "both", torch.full((nb,), i % 250, dtype=torch.uint8))
        cleared: list[object] = []
        clear = threading.Thread(target=lambda: cleared.append(c.clear_units(space)))
        clear.start()
        time.sleep(1.0)  # the clear waits for the held disk
        try:
            with KVTierClient(d.address, timeout=2, retries=0) as other_client:
                assert other_client.put_units(other, [b"late"], "both", torch.full((nb,), 0x5A, dtype=torch.uint8)).completed == 1
                out = torch.zeros(nb, dtype=torch.uint8)
                assert other_client.get_units(other, [b"late"], "both", out) == [True]
                assert torch.equal(out, torch.full((nb,), 0x5A, dtype=torch.uint8))
                assert not cleared  # the clear was still waiting for the disk all along
        finally:
            slow.unlink()
            clear.join(120)
        assert cleared == [60] and not clear.is_alive()
        out = torch.zeros(nb, dtype=torch.uint8)
        assert c.get_units(other, [b"mine"], "both", out) == [True] and torch.equal(out, torch.full((nb,), 0x33, dtype=torch.uint8))
        assert c.get_units(space, [b"fill0"], "both", out) == [False]


def _wait_for_free_pages(c: KVTierClient, pool: str, want: int, seconds: float = 20.0) -> int:
    """The pool's free pages once they reach ``want`` (a late call's server side may still be
    finishing), or what they are after ``seconds``."""
    import time

    until = time.monotonic() + seconds
    while (free := c.describe_pool(pool).free_pages) != want and time.monotonic() < until:
        time.sleep(0.1)
    return free


def test_an_offload_told_its_deadline_passed_while_its_copy_was_committed_stores_nothing(tmp_path):
    """Attack pass 7, A7-2: an Offload with ``free_slots`` told DEADLINE_EXCEEDED (its durable copy's
    disk commit outlasted the deadline) still stored the copy and freed its slots: a retry was
    ALREADY_EXISTS, and the client's slots could be handed to another client. Its caller is now
    checked after the commit too, and the copy is taken back: after the disk goes on, the slots are
    still allocated with their bytes, no copy is under the key, and the same Offload then works."""
    slow = tmp_path / "slow"
    with DaemonProcess(extra_args=_held_disk_args(tmp_path), env={"KVTIER_TEST_DISK_SLOW_FILE": str(slow)}) as d, \
            KVTierClient(d.address, timeout=60) as c:
        slots = c.allocate_slots("default", 64)
        c.write_kv("default", slots, latent={l: torch.full((64, 656), 0x22, dtype=torch.uint8) for l in range(2)})
        want = c.read_kv("default", slots)
        free_before = c.describe_pool("default").free_pages
        slow.write_text("")  # every disk commit waits until the file holds a number
        try:
            with KVTierClient(d.address, timeout=60, retries=0) as late, pytest.raises(DeadlineExceededError):
                late.offload("default", "kb", slots, free_slots=True, timeout=1.5)
        finally:
            slow.unlink()
        c.describe_pool("default")  # waits for the pool's lock: the late Offload has ended
        assert _wait_for_free_pages(c, "default", free_before) == free_before  # its page was not freed
        back = c.read_kv("default", slots)
        assert all(torch.equal(back.latent[l], want.latent[l]) for l in want.latent)
        with pytest.raises(KVTierError, match="no offloaded copy"):
            c.restore("default", "kb")
        assert c.offload("default", "kb", slots, free_slots=True).durable


def test_a_restore_with_drop_told_its_deadline_passed_keeps_the_copy_and_frees_its_pages(tmp_path):
    """Attack pass 7, A7-3: a Restore(drop=True) whose drop waited (for the offload store's lock, held
    by another Offload through its disk commit) past the caller's deadline still took the copy, and
    the fresh pages it had allocated were held by no one. The drop now waits for the tiers first and
    checks its caller just before the copy goes: after the disk goes on, the copy is still there,
    byte-exact, and the pool's pages are all free again. With the disk's write-behind on, the blocker's
    Offload holds no lock while its commit waits, so the Restore gets as far as its drop (the same
    check in process, where it failed before the fix: ``tests/server/daemon/test_offload_store.py``)."""
    slow = tmp_path / "slow"
    args = [a for a in _held_disk_args(tmp_path) if a != "--no-disk-write-behind"]
    with DaemonProcess(extra_args=args, env={"KVTIER_TEST_DISK_SLOW_FILE": str(slow)}) as d, \
            KVTierClient(d.address, timeout=60) as c:
        c.create_pool("glm-5.2", num_layers=2, size_tokens=PAGES * 64, pool_id="b")
        keep = c.allocate_slots("default", 64)
        c.write_kv("default", keep, latent={l: torch.full((64, 656), 0x44, dtype=torch.uint8) for l in range(2)})
        want = c.read_kv("default", keep)
        c.offload("default", "kr", keep, free_slots=True)
        held = c.allocate_slots("b", 64)
        slow.write_text("")  # every disk commit waits until the file holds a number
        holder = threading.Thread(target=lambda: c.offload("b", "blocker", held))  # a commit in the disk's queue
        holder.start()
        try:
            with KVTierClient(d.address, timeout=60, retries=0) as late:
                import time

                time.sleep(0.5)
                with pytest.raises(DeadlineExceededError):
                    late.restore("default", "kr", drop=True, timeout=1.5)
        finally:
            slow.unlink()
            holder.join(60)
        assert not holder.is_alive()
        assert _wait_for_free_pages(c, "default", PAGES) == PAGES  # its fresh page went back
        got = c.restore("default", "kr", drop=True)  # the copy is still there, whole
        back = c.read_kv("default", got)
        assert all(torch.equal(back.latent[l], want.latent[l]) for l in want.latent)


def test_an_allocation_told_its_deadline_passed_while_it_made_room_leaks_no_page(tmp_path):
    """Attack pass 7, A7-4: an AllocateSlots that had to evict cached prefix pages down to a slow
    disk, told DEADLINE_EXCEEDED, kept its pages allocated to no one (never to be freed; DeletePool
    refused the pool from then on). It now checks its caller after making room and frees them:
    after the disk goes on, every page of the pool can be allocated again."""
    slow = tmp_path / "slow"
    with DaemonProcess(extra_args=_held_disk_args(tmp_path), env={"KVTIER_TEST_DISK_SLOW_FILE": str(slow)}) as d, \
            KVTierClient(d.address, timeout=60) as c:
        keys = [f"page{i}".encode() for i in range(PAGES)]
        lease = c.load_prefix("default", keys, PAGES * 64)  # every page of the pool ...
        assert c.store_prefix(lease, keys, lease.slots, release=True) == PAGES  # ... now a cached prefix page
        assert c.describe_pool("default").free_pages == 0
        slow.write_text("")  # every disk commit waits until the file holds a number
        try:
            with KVTierClient(d.address, timeout=60, retries=0) as late, pytest.raises(DeadlineExceededError):
                late.allocate_slots("default", 4 * 64, timeout=1.5)  # evicts 4 cached pages: write-through to disk
        finally:
            slow.unlink()
        c.describe_pool("default")  # waits for the pool's lock: the late allocation has ended
        assert c.allocate_slots("default", PAGES * 64).numel() == PAGES * 64  # nothing leaked


def test_after_an_attached_prefix_call_timed_out_the_next_call_waits_for_it_within_its_own_timeout(tmp_path):
    """Attack pass 9, A9-6: after a prefix call on the attach connection timed out (the pool was held),
    the session's next call was refused RESOURCE_EXHAUSTED at once ("one prefix call at a time"), the
    code that means "the pool is full", though the old call ended seconds later. The next call now
    first reads the old call's reply within its own timeout, then runs: here it succeeds once the disk
    goes on, and the timed-out load left no lease (every page is free again at the end)."""
    import time

    slow = tmp_path / "slow"
    with DaemonProcess(extra_args=_held_disk_args(tmp_path), env={"KVTIER_TEST_DISK_SLOW_FILE": str(slow)}) as d, \
            KVTierClient(d.address, timeout=60) as c:
        held = c.allocate_slots("default", 64)
        ap = c.attach("default")
        try:
            slow.write_text("")  # every disk commit waits until the file is removed
            holder = threading.Thread(target=lambda: c.offload("default", "blocker", held, free_slots=True))
            holder.start()
            time.sleep(1.0)  # the Offload holds the pool's lock in its commit
            keys = [bytes([i]) * 16 for i in range(2)]
            with pytest.raises(DeadlineExceededError):
                ap.load_prefix(keys, timeout=0.5)
            threading.Timer(1.0, slow.unlink).start()  # the disk goes on a second later
            lease = ap.load_prefix([bytes([9]) * 16], timeout=30)
            assert len(lease.slots) == 64
            ap.release_prefix(lease)
            holder.join(60)
        finally:
            ap.detach()
        assert c.describe_pool("default").free_pages == PAGES  # the blocker's pages went with its offload; no lease is left


def test_handshakes_waiting_on_a_busy_pool_never_delay_another_sessions_calls(tmp_path):
    """Attack pass 9, A9-8: the attach channel's 4 workers read every connection's messages, and an
    attach handshake holds one for up to 0.5 s waiting for its pool's lock; 16 processes attaching to a
    held pool kept them busy, and another tenant's session on an idle pool waited seconds for each
    prefix call. Handshakes now run on workers of their own: while 16 threads keep attaching to the
    held pool, 10 calls of a session on another pool each answer within a 1 s deadline."""
    import time

    from kvtier.client.errors import UnavailableError

    slow = tmp_path / "slow"
    # with write-behind, so that the held commit holds the pool only, not the disk index a lookup reads
    args = [a for a in _held_disk_args(tmp_path) if a != "--no-disk-write-behind"]
    with DaemonProcess(extra_args=args, env={"KVTIER_TEST_DISK_SLOW_FILE": str(slow)}) as d, \
            KVTierClient(d.address, timeout=60) as c:
        c.create_pool("glm-5.2", num_layers=2, size_tokens=512, pool_id="idle")
        ap = c.attach("idle")
        held = c.allocate_slots("default", 64)
        stop = threading.Event()
        try:
            slow.write_text("")  # every disk commit waits until the file is removed
            holder = threading.Thread(target=lambda: c.offload("default", "blocker", held, free_slots=True))
            holder.start()
            time.sleep(1.0)  # the Offload holds pool "default"

            def keep_attaching() -> None:
                with KVTierClient(d.address, timeout=2, retries=0) as mine:
                    while not stop.is_set():
                        try:
                            mine.attach("default", timeout=2).detach()
                        except (UnavailableError, DeadlineExceededError, KVTierError):
                            pass

            flood = [threading.Thread(target=keep_attaching) for _ in range(16)]
            for t in flood:
                t.start()
            time.sleep(1.0)
            took = []
            for i in range(10):
                t0 = time.monotonic()
                lease = ap.load_prefix([bytes([i]) * 16], timeout=1.0)
                ap.release_prefix(lease, timeout=1.0)
                took.append(time.monotonic() - t0)
            assert max(took) < 2.0  # both calls within their 1 s deadlines, every time
            # attack pass 10, A10-4: new sessions of another pool, and storage sessions, do not queue
            # behind the handshakes either (a handshake holds its worker at most 20 ms for a busy pool)
            for _ in range(3):
                t0 = time.monotonic()
                c.attach("idle", timeout=2.0).detach()
                c.storage_session(timeout=2.0).close()
                assert time.monotonic() - t0 < 2.0
        finally:
            stop.set()
            if slow.exists():
                slow.unlink()
            for t in flood:
                t.join(30)
            holder.join(60)
            ap.detach()

