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
from kvtier.client.errors import DeadlineExceededError
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


def test_unit_puts_that_gave_up_waiting_for_a_clear_store_nothing(tmp_path):
    """Attack pass 6, A6-5: a ClearUnits waiting for units on their way to a slow disk holds the unit
    store's clear guard; a PutUnits behind it, told DEADLINE_EXCEEDED, still stored its unit once the
    disk went on (and a lone part stayed waiting). The commit now checks its caller once it holds
    the guard: neither the whole unit nor the part is there afterwards."""
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
        slow.write_text("")  # every disk commit waits until the file holds a number
        for i in range(60):  # more than the host tier holds: units go down to the held disk
            c.put_units(space, [f"fill{i}".encode()], "both", torch.full((nb,), i % 250, dtype=torch.uint8))
        cleared: list[object] = []
        clear = threading.Thread(target=lambda: cleared.append(c.clear_units(space)))
        clear.start()
        time.sleep(1.0)  # the clear holds the guard, waiting for the disk
        answers = {}
        with KVTierClient(d.address, timeout=2, retries=0) as late:
            for name, call in (("both", lambda: late.put_units(other, [b"late1"], "both",
                                                                torch.full((nb,), 0x5A, dtype=torch.uint8))),
                               ("kv", lambda: late.put_units(space, [b"late2"], "kv",
                                                              torch.full((space.part_nbytes("kv"),), 0x5B,
                                                                         dtype=torch.uint8)))):
                try:
                    answers[name] = f"answered {call()}"
                except DeadlineExceededError:
                    answers[name] = "deadline"
        slow.unlink()
        clear.join(120)
        assert answers == {"both": "deadline", "kv": "deadline"} and cleared and not clear.is_alive()
        out = torch.zeros(nb, dtype=torch.uint8)
        assert c.get_units(other, [b"late1"], "both", out) == [False]
        assert c.unit_stats()["parts_pending"] == 0
