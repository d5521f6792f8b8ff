"""LMDB disk tier on a real environment in a temp dir: budget, LRU order that survives a restart,
startup scrub, damaged records, map-full writes that leave nothing behind, one env per process, fork,
one process per directory."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys

import lmdb
import pytest
import torch

from kvtier.server.tiers import (
    DiskPathInUseError, DiskTier, DiskTierConfig, EnvironmentInUseError, TierFullError, disk_charge,
)
from kvtier.server.tiers.disk_lock import LOCK_NAME
from kvtier.server.tiers.errors import TierUnavailableError
from kvtier.server.tiers import disk as disk_module
from tierkit import HeldLock, record_of

MiB = 1 << 20


@pytest.fixture
def records(pool, codec):
    return {b"rec-%02d" % i: record_of(codec, pool, 1 + i % 8, seed=i) for i in range(12)}


def disk_at(path, capacity=8 * MiB, **kw) -> DiskTier:
    return DiskTier(DiskTierConfig(path=str(path), capacity_bytes=capacity, **kw))


def read(disk: DiskTier, key: bytes, size: int) -> torch.Tensor | None:
    out = torch.empty(size, dtype=torch.uint8)
    n = disk.read_into([key], [out])[0]
    return out[:n] if n else None


def test_charge_is_whole_lmdb_pages_plus_index_entries(codec):
    size = codec.page_nbytes()  # 194,048 + 16-byte page header -> 48 pages of 4096
    assert disk_charge(size) == -(-(size + 16) // 4096) * 4096 + 256


def test_budget_is_kept_by_lru_eviction(tmp_path, records, codec):
    size = codec.page_nbytes()
    disk = disk_at(tmp_path, capacity=4 * MiB, reserve_fraction=0.5)  # records: 2 MiB = 10 of ~190 KiB
    per = disk_charge(size)
    fits = int(4 * MiB * 0.5) // per
    keys = list(records)
    gone = []
    for k in keys:
        disk.write([(k, records[k])], on_evict=lambda v, _r: gone.append(v))
        assert disk.index.used <= disk.index.capacity
    assert len(disk.index) == fits == 10
    assert gone == keys[: len(keys) - fits]
    assert disk.contains(keys) == [False] * (len(keys) - fits) + [True] * fits
    info = disk.lmdb_info()
    assert info["entries"] == fits and info["file_bytes_used"] <= info["map_size"]
    disk.close()


def test_restart_keeps_records_and_lru_order(tmp_path, records, codec):
    size = codec.page_nbytes()
    keys = list(records)[:5]
    disk = disk_at(tmp_path)
    disk.write([(k, records[k]) for k in keys])
    assert read(disk, keys[1], size) is not None     # touch: order 0 2 3 4 1
    disk.write([(keys[0], records[keys[0]])])         # present: touched, not rewritten: 2 3 4 1 0
    order = disk.index.keys()
    assert order == [keys[2], keys[3], keys[4], keys[1], keys[0]]
    disk.close()

    again = disk_at(tmp_path)
    again.open()
    assert again.index.keys() == order
    for k in keys:
        got = read(again, k, size)
        assert got is not None and torch.equal(got, records[k])
    again.close()


def test_startup_scrub_drops_a_damaged_record(tmp_path, records, codec):
    keys = list(records)[:3]
    disk = disk_at(tmp_path)
    disk.write([(k, records[k]) for k in keys])
    disk.close()
    env = lmdb.open(str(tmp_path), max_dbs=3)  # flip one payload byte behind kvtier's back
    db = env.open_db(b"records")
    with env.begin(write=True, db=db) as txn:
        bad = bytearray(txn.get(keys[1]))
        bad[codec.header_nbytes + 12345] ^= 0x40
        txn.put(keys[1], bytes(bad))
    env.close()

    again = disk_at(tmp_path)
    assert again.contains(keys) == [True, False, True]
    assert again.stats().damaged == 1 and again.stats().extra["scrubbed"] == 1
    assert again.lmdb_info()["entries"] == 2
    again.close()


def test_damaged_record_read_is_a_miss_plus_counter(tmp_path, records, codec, caplog):
    size = codec.page_nbytes()
    k = next(iter(records))
    disk = disk_at(tmp_path)
    disk.write([(k, records[k])])
    disk.close()
    env = lmdb.open(str(tmp_path), max_dbs=3)
    db = env.open_db(b"records")
    with env.begin(write=True, db=db) as txn:
        bad = bytearray(txn.get(k))
        bad[-3] ^= 1
        txn.put(k, bytes(bad))
    env.close()

    again = disk_at(tmp_path, scrub_on_open=False)
    assert again.contains([k]) == [True]
    with caplog.at_level("WARNING"):
        assert read(again, k, size) is None
    assert "damaged" in caplog.text
    assert again.stats().damaged == 1 and again.contains([k]) == [False]
    again.close()


def test_map_full_write_is_rolled_back_and_invisible(tmp_path, records, codec):
    """kvtier's budget is made wrong on purpose (ten times the map), so LMDB itself raises
    MapFullError half way through a batch: the tier evicts what it holds in the policy's order to
    make room (counted, handed to ``on_evict``) and, as the batch still cannot fit, fails it: the whole
    transaction is invisible, the tier stays healthy, and memory agrees with LMDB afterwards."""
    keys = list(records)
    disk = disk_at(tmp_path, capacity=1 * MiB)
    disk.write([(keys[0], records[keys[0]])])
    disk.index.capacity = 10 * MiB
    evicted = []
    with pytest.raises(TierFullError, match="map full"):
        disk.write([(k, records[k]) for k in keys[1:8]], on_evict=lambda v, _n: evicted.append(v))
    assert evicted == [keys[0]] and disk.stats().extra["map_full_evictions"] == 1
    assert disk.health.healthy and disk.index.keys() == [] and disk.index.used == 0
    assert disk.contains(keys[:8]) == [False] * 8
    assert disk.lmdb_info()["entries"] == 0
    assert disk.stats().full_errors == 1
    disk.index.capacity = disk.config.record_budget
    disk.write([(keys[1], records[keys[1]])])  # it serves on
    got = read(disk, keys[1], codec.page_nbytes())
    assert got is not None and torch.equal(got, records[keys[1]])
    disk.close()
    again = disk_at(tmp_path, capacity=1 * MiB)
    again.open()
    assert again.index.keys() == [keys[1]]
    again.close()


def test_a_write_failing_half_way_through_a_batch_is_invisible(tmp_path, records, codec, monkeypatch):
    """The batch's transaction fails after its second record (an injected I/O fault): none of the
    batch is visible, memory agrees with LMDB, the tier turns unhealthy (bypassed: presence says
    absent) and serves again, with the record it held, once a probe succeeds."""
    size = codec.page_nbytes()
    keys = list(records)
    disk = disk_at(tmp_path)
    disk.write([(keys[0], records[keys[0]])])
    views = {"n": 0}
    real_view = disk_module._bytes_view

    def failing_view(rec):  # runs inside the put transaction, before each record's put
        views["n"] += 1
        if views["n"] == 3:
            raise OSError("injected: disk failed half way through the batch")
        return real_view(rec)

    monkeypatch.setattr(disk_module, "_bytes_view", failing_view)
    with pytest.raises(TierUnavailableError, match="injected"):
        disk.write([(k, records[k]) for k in keys[1:5]])
    monkeypatch.undo()
    assert not disk.health.healthy and "injected" in disk.health.snapshot().reason
    assert disk.contains(keys[:5]) == [False] * 5 and disk.held_while_unhealthy(keys[0])
    disk.probe()
    disk.health.mark_healthy()
    assert disk.contains(keys[:5]) == [True, False, False, False, False]
    assert disk.index.keys() == [keys[0]] and disk.lmdb_info()["entries"] == 1
    disk.write([(keys[1], records[keys[1]])])
    got = read(disk, keys[1], size)
    assert got is not None and torch.equal(got, records[keys[1]])
    disk.close()


def test_only_one_environment_per_file_per_process(tmp_path, records):
    disk = disk_at(tmp_path)
    disk.open()
    other = disk_at(tmp_path)
    with pytest.raises(EnvironmentInUseError):
        other.open()
    disk.close()
    other.open()
    other.close()


_HOLD_OPEN = """
import sys, time
from kvtier.server.tiers import DiskTier, DiskTierConfig
DiskTier(DiskTierConfig(path=sys.argv[1], capacity_bytes=8 << 20)).open()
print("open", flush=True)
time.sleep(600)
"""


def test_a_directory_another_process_holds_is_refused_until_it_exits_even_by_kill9(tmp_path):
    """Regression (attack pass F3): two processes on one directory each kept their own index over one
    LMDB environment and served each other's records. A second process is refused naming the holder's
    pid; once the holder is killed with SIGKILL the kernel has released the lock and the tier opens."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_OPEN, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(DiskPathInUseError, match=rf"disk path {tmp_path} is in use by another kvtier daemon "
                                                     rf"\(pid {holder.pid}\); stop it or give another --disk-path"):
            disk_at(tmp_path).open()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(60)
    disk = disk_at(tmp_path)
    disk.open()
    assert os.stat(tmp_path / LOCK_NAME).st_mode & 0o777 == 0o600
    disk.close()


def test_closing_the_tier_releases_the_directory_for_the_next_process(tmp_path, records):
    """The lock lasts as long as the environment: closed, another process opens the directory (and this
    process may open it again)."""
    disk = disk_at(tmp_path)
    disk.open()
    disk.close()
    r = subprocess.run([sys.executable, "-c", _HOLD_OPEN.replace("time.sleep(600)", ""), str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "open", r.stderr
    again = disk_at(tmp_path)
    again.open()
    again.close()


@pytest.mark.parametrize("problem", ["mode-0644", "other-owner", "symlink"])
def test_a_lock_file_another_user_could_touch_is_refused(tmp_path, problem):
    """``kvtier.lock`` is checked like the LMDB files beside it: a regular file of the daemon's uid with
    no group or other bit; a symlink is never followed."""
    from kvtier.server.tiers import DiskPathError

    lock = tmp_path / LOCK_NAME
    if problem == "symlink":
        (tmp_path / "elsewhere").write_text("")
        lock.symlink_to(tmp_path / "elsewhere")
    else:
        lock.write_text("")
        os.chmod(lock, 0o644 if problem == "mode-0644" else 0o600)
        if problem == "other-owner":
            os.chown(lock, 65534, 65534)  # the tests run as root
    with pytest.raises(DiskPathError, match={"mode-0644": "is mode 0644; run chmod 600",
                                             "other-owner": "is owned by uid 65534",
                                             "symlink": "cannot be opened"}[problem]):
        disk_at(tmp_path).open()


def _child_writes(disk: DiskTier, key: bytes, rec: torch.Tensor, q) -> None:
    try:
        disk.write([(key, rec)])
        q.put(("ok", ""))
    except EnvironmentInUseError as e:
        q.put(("in use", str(e)))
    except Exception as e:  # reported to the parent
        q.put(("error", repr(e)))


def _in_child(disk: DiskTier, key: bytes, rec: torch.Tensor) -> tuple[str, str]:
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_writes, args=(disk, key, rec, q))
    p.start()
    status = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    return status


def test_a_tier_built_before_fork_opens_its_environment_in_the_child(tmp_path, records):
    keys = list(records)
    disk = disk_at(tmp_path)  # built, not yet opened: the child opens its own environment
    assert _in_child(disk, keys[0], records[keys[0]]) == ("ok", "")
    disk.open()
    assert disk.contains(keys[:1]) == [True]
    disk.close()


def test_an_environment_never_crosses_fork(tmp_path, records, codec):
    size = codec.page_nbytes()
    keys = list(records)
    disk = disk_at(tmp_path)
    disk.write([(keys[0], records[keys[0]])])
    status, msg = _in_child(disk, keys[1], records[keys[1]])
    assert status == "in use" and "fork" in msg
    got = read(disk, keys[0], size)  # the parent's environment is untouched and still works
    assert got is not None and torch.equal(got, records[keys[0]])
    assert disk.contains(keys[:2]) == [True, False]
    disk.close()


def test_disk_reads_racing_eviction_return_the_whole_record_or_a_miss(tmp_path, records, codec):
    import threading

    size = codec.page_nbytes()
    keys = list(records)
    disk = disk_at(tmp_path, capacity=4 * MiB, reserve_fraction=0.5)  # 10 of the 12 records fit
    stop = threading.Event()
    bad: list[str] = []
    reads = [0, 0]

    def reader(i: int) -> None:
        out = torch.empty(size, dtype=torch.uint8)
        while not stop.is_set():
            for k in keys:
                n = disk.read_into([k], [out])[0]
                reads[i] += 1
                if n and not torch.equal(out[:n], records[k]):
                    bad.append(k.decode())

    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    rounds = 0
    try:
        while rounds < 5 or min(reads) < 200:
            for k in keys:
                disk.remove([k]) if rounds % 2 else disk.write([(k, records[k])])
            rounds += 1
            assert rounds < 100_000
    finally:  # a failing writer must not leave the readers spinning (pytest would never exit)
        stop.set()
        for t in threads:
            t.join()
    assert bad == []
    s = disk.stats()
    assert s.damaged == 0 and s.hits > 0 and s.misses > 0 and s.evictions > 0
    assert disk.index.used <= disk.index.capacity
    disk.close()


def test_borrow_reads_a_batch_in_one_transaction_into_the_read_arena(tmp_path, records):
    """Verified records land in the tier's read arena (faulted in once) and free it when dropped; a
    record larger than the arena comes in fresh memory; misses are None."""
    disk = disk_at(tmp_path, read_buffer_bytes=1 * MiB)  # room for 5 page records
    disk.write(list(records.items()))
    keys = list(records)[:8] + [b"absent"]
    with disk.borrow(keys) as got:
        assert got[-1] is None
        for k, rec in zip(keys, got[:-1]):
            assert torch.equal(rec, records[k])
        arena = disk._read_arena
        in_arena = sum(arena.owns(r) for r in got[:-1])
        assert in_arena == 5  # the arena holds 5, the other 3 are fresh memory
    del got, rec
    assert arena.stats().used_bytes == 0
    assert disk.stats().hits == 8 and disk.stats().misses == 1
    disk.close()


def test_reads_return_each_records_own_bytes_into_larger_buffers(tmp_path, records):
    """Every record read into a buffer larger than it: its own bytes, the rest of the buffer untouched."""
    disk = disk_at(tmp_path)
    disk.write(list(records.items()))
    for k, rec in records.items():
        out = torch.full((rec.numel() + 10,), 7, dtype=torch.uint8)
        assert disk.read_into([k], [out]) == [rec.numel()]
        assert torch.equal(out[:rec.numel()], rec) and bool((out[rec.numel():] == 7).all())
    disk.close()


def _child_spills_then_dies(path: str, items: list[tuple[bytes, torch.Tensor]], read_key: bytes, last: tuple[bytes, torch.Tensor],
                            clean: bool) -> None:
    disk_module.STAMP_BATCH = 3  # this child's tier stamps LRU positions three at a time
    disk = disk_at(path)
    for item in items:
        disk.write([item])  # the third write stamps the three positions
    out = torch.empty(int(items[0][1].numel()), dtype=torch.uint8)
    disk.read_into([read_key], [out])  # a read hit: its new position is pending
    disk.write([last])  # pending: the read hit and this record (two, under the batch of three)
    if clean:
        disk.close()  # flush: the pending positions are written
    os._exit(0)  # no interpreter shutdown: what a killed daemon leaves behind


@pytest.mark.parametrize("clean", [True, False], ids=["closed", "killed"])
def test_lru_positions_are_stamped_in_batches_and_a_crash_loses_only_the_pending_ones(tmp_path, records, clean):
    """Spills stamp their LRU positions in batches (STAMP_BATCH) instead of in each put transaction.
    A daemon killed before the pending positions were written loses only those: every record is
    there, the pending new record loads as the newest, the pending read hit keeps its last stamped
    position. A clean close writes them (order as in memory)."""
    k = list(records)
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_child_spills_then_dies,
                    args=(str(tmp_path), [(key, records[key]) for key in k[:3]], k[0], (k[3], records[k[3]]), clean))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    disk = disk_at(tmp_path)
    disk.open()
    assert disk.index.keys() == ([k[1], k[2], k[0], k[3]] if clean else [k[0], k[1], k[2], k[3]])
    for key in k[:4]:
        got = read(disk, key, int(records[key].numel()))
        assert got is not None and torch.equal(got, records[key])
    disk.close()
    again = disk_at(tmp_path)  # the four reads above, in key order, were stamped at close
    again.open()
    assert again.index.keys() == k[:4]
    again.close()


def _plant_empty_value(path: str, key: bytes) -> None:
    """Another process puts a zero-length value under ``key`` in the records database (a record
    damaged to nothing by something else writing the environment)."""
    import subprocess
    import sys
    code = ("import lmdb, sys; env = lmdb.open(sys.argv[1], max_dbs=4, subdir=True); db = env.open_db(b'records');\n"
            "with env.begin(write=True) as t: t.put(sys.argv[2].encode(), b'', db=db)\nenv.close()")
    subprocess.run([sys.executable, "-c", code, path, key.decode()], check=True)


@pytest.mark.parametrize("write_behind", [False, True])
def test_an_empty_record_is_refused_and_an_empty_value_reads_as_damaged(tmp_path, records, write_behind):
    """A zero-length record is bad input (ValueError, nothing written); a zero-length value that
    another process put into LMDB under a key the tier holds reads as a damaged record (a miss, counted ``damaged``, dropped)
    through read_into and borrow, never a TypeError out of the native copy. A good record read in
    the same batch still comes back byte-exact."""
    tier = DiskTier(DiskTierConfig(path=str(tmp_path), capacity_bytes=8 * MiB, write_behind=write_behind))
    tier.open()
    with pytest.raises(ValueError, match="must not be empty"):
        tier.write([(b"empty", torch.empty(0, dtype=torch.uint8))])
    assert tier.contains([b"empty"]) == [False]
    good_key, good = next(iter(records.items()))
    tier.write([(good_key, good), (b"z1", good), (b"z2", good)])  # z1, z2: held by the index, then emptied
    tier.drain()
    _plant_empty_value(str(tmp_path), b"z1")
    out = [torch.empty(good.numel(), dtype=torch.uint8) for _ in range(2)]
    assert tier.read_into([b"z1", good_key], out) == [0, good.numel()]
    assert bytes(out[1].numpy()) == bytes(good.numpy())
    _plant_empty_value(str(tmp_path), b"z2")
    with tier.borrow([b"z2", good_key]) as got:
        assert got[0] is None and bytes(got[1].numpy()) == bytes(good.numpy())
    assert tier.stats().damaged == 2
    tier.close()


def test_a_spill_of_multi_megabyte_records_reuses_lmdbs_transaction_memory(tmp_path):
    """An offloaded request copy is one record, one LMDB value (13.8 MB for 256 GLM-5.2 tokens),
    which LMDB mallocs for each put and frees at commit. With glibc's mmap threshold below it every
    put faulted the whole block in again (~3,400 minor faults a record); with the tier's malloc
    settings the block is reused, so a second round of the same writes faults almost nothing.
    Counted on this thread (RUSAGE_THREAD), the writes run synchronously on it."""
    import resource

    n, size = 4, 12 << 20
    recs = [torch.full((size,), i + 1, dtype=torch.uint8) for i in range(n)]
    disk = disk_at(tmp_path, capacity=16 * size, verify_reads=False)  # the bytes are not records
    keys = [b"copy-%d" % i for i in range(n)]

    def spill_round() -> int:
        disk.remove(keys)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for k, r in zip(keys, recs):
            disk.write([(k, r)])
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

    spill_round()  # the first round maps LMDB's pages and grows the heap
    faults = spill_round()
    pages = n * size // 4096
    assert faults < pages // 20, f"{faults} minor faults for {pages} pages of records"
    assert torch.equal(read(disk, keys[-1], size), recs[-1])
    disk.close()


def test_a_disk_size_below_what_lmdb_holds_is_refused_and_changes_nothing(tmp_path, records, codec):
    """Attack pass 4, A4-2: a restart with a --disk-size below what the directory already held was
    accepted; LMDB raised its map to exactly the used pages, so no transaction (not even a delete)
    could get a page: Drop ended INTERNAL (MDB_MAP_FULL) and the tier never recovered. Now opening is
    refused with one line naming both sizes, and the records are untouched for a larger size."""
    disk = disk_at(tmp_path)
    disk.write(list(records.items()))
    used = disk.lmdb_info()["file_bytes_used"]
    disk.close()
    small = disk_at(tmp_path, capacity=1 * MiB)
    with pytest.raises(disk_module.DiskPathError) as e:
        small.open()
    msg = str(e.value)
    m = re.search(rf"--disk-size {MiB:,} bytes is too small for the ([0-9,]+) bytes the disk tier already holds "
                  rf".*give --disk-size of at least ([0-9,]+) bytes", msg)
    held = int(m[1].replace(",", ""))
    assert 0 < held <= used, msg  # pages in use; the file's last page counts freed pages too
    needed = int(m[2].replace(",", ""))
    assert needed >= max(used, held + disk_module.MIN_FREE_PAGES * 4096) and needed % 4096 == 0, msg
    assert "\n" not in msg and "move that directory away" in msg
    # attack pass 5, A5-1: the size the message recommends works (at exactly the used size every
    # delete failed MDB_MAP_FULL): a drop and a write go through and the tier stays healthy
    again = disk_at(tmp_path, capacity=needed)  # the lock was released, nothing was dropped
    keys = list(records)
    assert again.contains(keys) == [True] * len(keys)
    assert again.remove(keys[:2]) == 2 and again.health.healthy
    again.write([(keys[0], records[keys[0]])])
    assert again.health.healthy and torch.equal(read(again, keys[0], records[keys[0]].numel()), records[keys[0]])
    again.close()


def test_a_damaged_lmdb_file_is_named_as_such_at_start(tmp_path):
    """Attack pass 4, A4-7: a damaged data.mdb stopped the start with advice about the filesystem
    ("pass --disk-path DIR on a local, writable filesystem"); the file, not the filesystem, is bad."""
    tmp_path.chmod(0o700)
    (tmp_path / "data.mdb").write_bytes(os.urandom(64 * 1024))
    (tmp_path / "data.mdb").chmod(0o600)
    with pytest.raises(disk_module.DiskPathError) as e:
        disk_at(tmp_path).open()
    msg = str(e.value)
    assert f"--disk-path {tmp_path}: its LMDB file is damaged or not LMDB" in msg and "move the directory away" in msg
    assert "writable filesystem" not in msg


def test_every_reader_slot_taken_is_a_miss_not_an_unhealthy_tier(tmp_path, records, codec):
    """Attack pass 4, A4-15: MDB_READERS_FULL (more reading threads than --disk-max-readers) marked
    the whole disk tier unhealthy, and every copy on it was UNAVAILABLE until a probe. Reader
    contention is not a failing disk: that read misses, the next one is served."""
    import threading

    k = next(iter(records))
    disk = disk_at(tmp_path, max_readers=1, write_behind=False)
    disk.write([(k, records[k])])
    env = disk._env()[0]
    holding, done = threading.Event(), threading.Event()

    def hold_the_slot():
        with env.begin():
            holding.set()
            done.wait(30)
    t = threading.Thread(target=hold_the_slot)
    t.start()
    try:
        assert holding.wait(30)
        assert read(disk, k, codec.page_nbytes()) is None  # no slot: a miss
        assert disk.health.healthy
    finally:
        done.set()
        t.join(30)
    assert torch.equal(read(disk, k, codec.page_nbytes()), records[k])
    disk.close()


def test_presence_checks_do_not_wait_for_the_index_lock_and_see_a_reload_whole(tmp_path, records):
    """Attack pass 8, A8-4 (LoadPrefix part) and A8-7: ``contains`` and ``lookup`` took the disk tier's
    index lock, which a synchronous commit holds for as long as the disk takes, so an Offload's key
    check and a LoadPrefix's lookup of an idle tenant waited seconds. They read the index without it
    now: with another thread holding the lock, both answer at once and right. While an index reload
    runs (its counter odd) they ask under the lock instead, so a half-refilled index is never read."""
    import threading

    disk = disk_at(tmp_path)
    keys = list(records)[:3]
    for k in keys:
        disk.write([(k, records[k])])
    with HeldLock(disk.index.lock):
        answers: list[object] = []
        t = threading.Thread(target=lambda: answers.extend([disk.contains([keys[0], b"absent"]),
                                                            disk.lookup([keys[0], keys[1], b"absent", keys[2]])]))
        t.start()
        t.join(2)
        assert answers == [[True, False], 2]  # at once, with the lock held elsewhere
        disk._reloads += 1  # noqa: SLF001 - as while an index reload runs
        waited = threading.Thread(target=lambda: answers.append(disk.contains([keys[2]])))
        waited.start()
        waited.join(0.5)
        assert waited.is_alive()  # it asks under the lock, which the holder has
    waited.join(5)
    disk._reloads += 1  # noqa: SLF001
    assert answers[-1] == [True]
    disk.close()
