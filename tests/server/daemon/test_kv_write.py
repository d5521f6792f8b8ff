"""WriteKV's landing and commit in process (``server/daemon/kv_write.py``): a write that allocates puts
every chunk's latent bytes straight into its reserved pages, whatever the chunk boundaries (inside a
row, across runs of pages, across segments, into the staged indexer part), and the commit grants the
pages. A write into named slots claims their pages and writes its latent rows in place, keeping the
rows it replaces: while it is in flight every call naming those pages is refused, and an abort puts the
old rows back. Expected bytes are placed by hand here: row ``i`` of layer ``x`` at
``pool.kv_buffer[x][slot i]``."""

from __future__ import annotations

import pytest
import torch
from daemonkit import A, PS, daemon, pool, read_rows

from kvtier.server.daemon import kv_ops, kv_write
from kvtier.server.daemon.errors import Cancelled, InvalidArgument, NotFound, Unavailable
from kvtier.server.daemon.kv_ops import KVSelection
from kvtier.server.daemon.tenants import Caller


@pytest.fixture
def d():
    dm = daemon(host_memory_bytes=8 << 20)
    yield dm
    dm.close()


def stream_bytes(n: int, layers, live, seed: int) -> tuple[bytes, dict, dict]:
    """The packed stream of ``n`` tokens (latent layers, then keys and scales of each live layer) and its parts."""
    g = torch.Generator().manual_seed(seed)
    lat = {x: torch.randint(0, 256, (n, 656), dtype=torch.uint8, generator=g) for x in layers}
    idx = {x: (torch.randint(0, 256, (n, 128), dtype=torch.uint8, generator=g), torch.rand(n, generator=g)) for x in live}
    parts = [lat[x].numpy().tobytes() for x in layers]
    for x in live:
        parts += [idx[x][0].numpy().tobytes(), idx[x][1].numpy().tobytes()]
    return b"".join(parts), lat, idx


@pytest.mark.parametrize("chunk", [4096, 5000, 656 * 64 + 1, 1 << 20])
def test_a_write_that_allocates_lands_every_chunk_where_its_slot_says(d, chunk):
    """Free pages 2, 4, 5 (pages 1, 3 held): 150 tokens on layers 0-3 (indexer on 0-2) land on
    pages 2, 4, 5 in that order, whatever the chunk size; before the commit no call may name them."""
    pool(d, A)
    with d.pools.locked(A, "p", exclusive=True) as e:
        held = e.alloc(5 * PS)  # pages 1..5
        e.free(held[PS:2 * PS])  # page 2
        e.free(held[3 * PS:])  # pages 4, 5
    data, lat, idx = stream_bytes(150, range(4), (0, 1, 2), seed=chunk)
    sel = KVSelection("p", [], (0, 1, 2, 3), (0, 1, 2))
    buf = kv_write.reserve_write(d.pools, A, sel, 150)
    want = [p * PS + i for p in (2, 4, 5) for i in range(PS)][:150]
    assert buf.in_place and buf.slots.tolist() == want and buf.nbytes == len(data)
    for off in range(0, len(data), chunk):
        buf.add_packed(off, memoryview(data)[off:off + chunk])
    with d.pools.locked(A, "p", exclusive=False) as e, pytest.raises(InvalidArgument, match="not allocated"):
        e.slots(want[:1])
    slots, nbytes = kv_write.write_new_kv(d.pools, A, buf)
    assert slots.tolist() == want and nbytes == len(data)
    for x in range(4):
        assert torch.equal(read_rows(d, A, "p", slots, layer=x), lat[x])
    with d.pools.locked(A, "p", exclusive=False) as e:
        for x in (0, 1, 2):
            keys, scales = e.pool.get_index_k_scale(x, slots)
            assert torch.equal(keys.view(torch.uint8).reshape(150, -1), idx[x][0])
            assert torch.equal(scales.reshape(-1), idx[x][1])
        assert bool(e.page_allocated[[2, 4, 5]].all())
        # they hold the caller's KV now, not whatever the allocator left (attack pass 10, A10-5: a
        # PullKV or Restore into them kept no undo rows, and a cancelled one left a mix)
        assert not e.unwritten([2, 4, 5])


def test_an_aborted_write_gives_its_pages_back_and_a_cancelled_commit_writes_nothing(d):
    """A write that allocates, aborted after half its stream: its pages are free again (the next
    reservation takes the same ones). A write into named slots whose call is no longer wanted at
    commit: Cancelled, the slots keep their bytes."""
    pool(d, A)
    data, lat, _ = stream_bytes(64, range(4), (), seed=1)
    sel = KVSelection("p", [], (0, 1, 2, 3), ())
    buf = kv_write.reserve_write(d.pools, A, sel, 64)
    buf.add_packed(0, memoryview(data)[:len(data) // 2])
    kv_write.abort_reserved(d.pools, A, buf.entry, buf.slots)
    again = kv_write.reserve_write(d.pools, A, sel, 64)
    assert again.slots.tolist() == buf.slots.tolist()
    for off in range(0, len(data), 1 << 16):
        again.add_packed(off, memoryview(data)[off:off + (1 << 16)])
    slots, _ = kv_write.write_new_kv(d.pools, A, again)
    new, _, _ = stream_bytes(64, range(4), (), seed=2)
    named = kv_write.KVWriteBuffer(d.pools.get(A, "p"), KVSelection("p", slots.tolist(), (0, 1, 2, 3), ()))
    named.add_packed(0, memoryview(new))
    with pytest.raises(Cancelled):
        kv_write.write_kv(d.pools, A, named, wanted=lambda: False)
    for x in range(4):
        assert torch.equal(read_rows(d, A, "p", slots, layer=x), lat[x])


def _write_whole(d, caller, slots, layers, live, seed, chunk=1 << 16):
    """A complete packed write of seeded bytes into named ``slots``; returns ``(latent, index)``."""
    data, lat, idx = stream_bytes(slots.numel(), layers, live, seed=seed)
    buf = kv_write.begin_write(d.pools, caller, KVSelection("p", slots.tolist(), tuple(layers), tuple(live)))
    for off in range(0, len(data), chunk):
        buf.add_packed(off, memoryview(data)[off:off + chunk])
    kv_write.write_kv(d.pools, caller, buf)
    return lat, idx


def _refused_while_claimed(d, slots):
    """Every kind of call that names a claimed page is UNAVAILABLE (nothing changes)."""
    other = d.pools.get(A, "p").alloc(0)  # no-op: the pool answers
    assert other.numel() == 0
    for call in (lambda: kv_ops.free_slots(d.pools, A, "p", slots[:1].tolist()),
                 lambda: kv_ops.read_kv(d.pools, A, KVSelection("p", slots[:4].tolist(), (0,), ())),
                 lambda: kv_ops.move_kv(d.pools, A, "p", slots[:1].tolist(), [0]),
                 lambda: kv_write.begin_write(d.pools, A, KVSelection("p", slots[-1:].tolist(), (1,), ())),
                 lambda: d.transfer.transfer_layout(A, "p", [int(slots[0]) // PS])):
        with pytest.raises(Unavailable, match="being written by a WriteKV"):
            call()


@pytest.mark.parametrize("chunk,packed", [(4096, True), (5000, True), (656 * 64 + 1, False), (1 << 20, False)])
def test_a_write_into_named_slots_lands_in_place_and_an_abort_puts_the_old_rows_back(d, chunk, packed):
    """130 named slots on pages 1-3 (two runs: page 2's first slot is left out) hold seed-1 rows on
    layers 0-3. A seed-2 write is cut off after about 60% of its stream: the rows it reached hold the
    new bytes already (in place), every call naming the pages is refused meanwhile, and the abort
    puts the seed-1 rows back byte for byte and ends the claim."""
    pool(d, A)
    with d.pools.locked(A, "p", exclusive=True) as e:
        allocated = e.alloc(3 * PS)
    slots = torch.cat([allocated[:PS], allocated[PS + 1:PS + 67]])  # 130 slots, two runs
    old, _ = _write_whole(d, A, slots, range(4), (0, 1), seed=1)
    data, new, _ = stream_bytes(130, range(4), (0, 1), seed=2)
    sel = KVSelection("p", slots.tolist(), (0, 1, 2, 3), (0, 1))
    buf = kv_write.begin_write(d.pools, A, sel)
    assert buf.claimed and buf.pages.tolist() == [1, 2, 3]
    cut = int(len(data) * 0.6) // chunk * chunk
    if packed:
        for off in range(0, cut, chunk):
            buf.add_packed(off, memoryview(data)[off:min(off + chunk, cut)])
    else:  # per segment: layers 0 and 1 whole, layer 2 in part
        seg = 130 * 656
        for x in range(2):
            for off in range(0, seg, chunk):
                buf.add(x, "latent", off, data[x * seg + off:x * seg + min(off + chunk, seg)])
        buf.add(2, "latent", 0, data[2 * seg:2 * seg + 3 * 4096])
        cut = 2 * seg + 3 * 4096
    seg = 130 * 656
    for x in range(4):  # rows the stream reached are new already; rows past it keep their old bytes
        done = min(max(cut - x * seg, 0), seg)
        now = read_rows(d, A, "p", slots, layer=x)
        assert torch.equal(now[:done // 656], new[x][:done // 656])
        assert torch.equal(now[-(-done // 656):], old[x][-(-done // 656):])
    assert 0 < cut - 2 * seg < seg  # the cut lies inside layer 2: both kinds of row are checked
    _refused_while_claimed(d, slots)
    with pytest.raises(InvalidArgument, match="got"):
        kv_write.write_kv(d.pools, A, buf)  # incomplete: refused before anything else
    kv_write.abort_claimed(d.pools, A, buf)
    for x in range(4):
        assert torch.equal(read_rows(d, A, "p", slots, layer=x), old[x])
    e = d.pools.get(A, "p")
    assert e.claimed_pages == 0 and not bool(e.page_claimed.any())
    assert kv_ops.read_kv(d.pools, A, KVSelection("p", slots[:4].tolist(), (0,), ()))  # readable again


def test_a_write_into_named_slots_commits_in_place_and_ends_its_claim(d):
    """A whole stream into pages 1-2: the commit writes the staged indexer keys and scales, the
    latent rows are the stream's, the claim is over and the pages stay allocated."""
    pool(d, A)
    with d.pools.locked(A, "p", exclusive=True) as e:
        slots = e.alloc(2 * PS)
    lat, idx = _write_whole(d, A, slots, range(4), (0, 1, 2), seed=3, chunk=5000)
    e = d.pools.get(A, "p")
    for x in range(4):
        assert torch.equal(read_rows(d, A, "p", slots, layer=x), lat[x])
    for x in (0, 1, 2):
        keys, scales = e.pool.get_index_k_scale(x, slots)
        assert torch.equal(keys.view(torch.uint8).reshape(2 * PS, -1), idx[x][0])
        assert torch.equal(scales.reshape(-1), idx[x][1])
    assert e.claimed_pages == 0 and bool(e.page_allocated[[1, 2]].all())


def test_writes_on_prefix_cache_pages_or_scattered_slots_are_staged_not_claimed(d):
    """Slots of a lease's fresh pages (the prefix cache's) and 17 slots that make 17 runs are staged
    whole: no claim, readers see the old rows until the commit, which writes the new ones."""
    pool(d, A)
    ld = d.tiers.load(A, "p", [bytes([7]) * 16], None)  # one missing page: a fresh page of a lease
    with d.pools.locked(A, "p", exclusive=True) as e:
        spread = e.alloc(PS)[::2][:17]
    for slots in (ld.slots, spread):
        old, _ = _write_whole(d, A, slots, [0], (), seed=4)
        data, new, _ = stream_bytes(slots.numel(), [0], (), seed=5)
        buf = kv_write.begin_write(d.pools, A, KVSelection("p", slots.tolist(), (0,), ()))
        assert not buf.claimed and not buf.in_place
        buf.add_packed(0, memoryview(data)[:4096])
        assert torch.equal(read_rows(d, A, "p", slots), old[0])  # untouched, and readable through the API
        assert kv_ops.read_kv(d.pools, A, KVSelection("p", slots.tolist(), (0,), ()))
        for off in range(4096, len(data), 4096):
            buf.add_packed(off, memoryview(data)[off:off + 4096])
        kv_write.write_kv(d.pools, A, buf)
        assert torch.equal(read_rows(d, A, "p", slots), new[0])
    d.tiers.release(A, "p", ld.lease)


def test_an_attach_session_that_ends_leaves_claimed_pages_to_the_write(d):
    """A session holds pages 1-3 and writes into page 2 in place; the session ends mid-stream: pages
    1 and 3 are freed at once, page 2 stays allocated (a page freed under a write in flight could
    be handed out and written over) until the write's end, which puts the old rows back and frees it."""
    from test_sessions import attach

    owner = Caller("default")  # a daemon without a tokens file: every worker is the default tenant
    pool(d, owner)
    me, _ = attach(d, owner)
    slots, _ = kv_ops.allocate_slots(d.pools, me, "p", 3 * PS)
    target = slots[PS:2 * PS]
    data, _, _ = stream_bytes(PS, [0], (), seed=6)
    buf = kv_write.begin_write(d.pools, me, KVSelection("p", target.tolist(), (0,), ()))
    assert buf.claimed
    buf.add_packed(0, memoryview(data)[:8192])
    e = d.pools.get(owner, "p")
    free_before = e.allocator.free_pages
    assert d.end_session(me.session, "test")
    assert e.allocator.free_pages == free_before + 2
    assert e.page_allocated.tolist()[1:4] == [False, True, False]
    buf.add_packed(8192, memoryview(data)[8192:])
    with pytest.raises(NotFound, match="session has ended"):
        kv_write.write_kv(d.pools, me, buf)
    kv_write.abort_claimed(d.pools, me, buf)
    assert e.allocator.free_pages == free_before + 3 and e.claimed_pages == 0
    assert not bool(e.page_allocated[2]) and int(e.page_owner[2]) == 0


def test_a_pool_deleted_under_a_claimed_write_ends_it_not_found(d):
    """DeletePool(force) while a write into named slots is in flight: the commit is NOT_FOUND, the
    abort does nothing (the pool is gone), and a pool made again under the name is not written."""
    pool(d, A)
    with d.pools.locked(A, "p", exclusive=True) as e:
        slots = e.alloc(PS)
    data, _, _ = stream_bytes(PS, [0], (), seed=7)
    buf = kv_write.begin_write(d.pools, A, KVSelection("p", slots.tolist(), (0,), ()))
    buf.add_packed(0, memoryview(data))
    d.delete_pool(A, "p", force=True)
    pool(d, A)
    with d.pools.locked(A, "p", exclusive=True) as e:
        again = e.alloc(PS)
    assert again.tolist() == slots.tolist()
    with pytest.raises(NotFound, match="deleted and made again"):
        kv_write.write_kv(d.pools, A, buf)
    kv_write.abort_claimed(d.pools, A, buf)
    assert not bool(read_rows(d, A, "p", again).any())  # the new pool's rows: never written


def test_a_write_of_indexer_parts_only_is_staged_not_claimed(d):
    """A WriteKV into named slots that selects no latent layer (indexer keys and scales of layer 0
    only) has nothing to write in place -- the indexer part is always staged -- yet it claimed its
    pages, so every reader of them was refused for the whole stream. Staged now: no claim, readers
    are served meanwhile, and the commit writes the keys and scales."""
    pool(d, A)
    with d.pools.locked(A, "p", exclusive=True) as e:
        slots = e.alloc(PS)
    data, _, idx = stream_bytes(PS, [], (0,), seed=8)
    buf = kv_write.begin_write(d.pools, A, KVSelection("p", slots.tolist(), (), (0,)))
    assert not buf.claimed and not buf.in_place
    buf.add_packed(0, memoryview(data)[:4096])
    assert kv_ops.read_kv(d.pools, A, KVSelection("p", slots.tolist(), (0,), (0,)))  # served, not Busy
    buf.add_packed(4096, memoryview(data)[4096:])
    kv_write.write_kv(d.pools, A, buf)
    with d.pools.locked(A, "p", exclusive=False) as e:
        keys, scales = e.pool.get_index_k_scale(0, slots)
    assert torch.equal(keys.view(torch.uint8).reshape(PS, -1), idx[0][0])
    assert torch.equal(scales.reshape(-1), idx[0][1])


def test_a_claimed_write_whose_commit_cannot_get_the_pool_in_time_puts_its_rows_back_before_its_deadline(d):
    """Attack pass 9, A9-2 (WriteKV): a write into named slots whose commit waited for its pool past
    the caller's deadline wrote the replaced rows back only once it got the lock, seconds after the
    client was told DEADLINE_EXCEEDED: over what an attached worker had written through its tensors
    since. Now a claimed write's commit waits in slices and, once its deadline is within a margin,
    puts the old rows back at once without the lock (the claim keeps other calls off them) and is
    CANCELLED; the abort that follows under the lock does not put them back again. Here the pool is
    held by another thread; the commit gives up with 0.3 s left; then the "worker" writes its own rows
    straight into the pool, and after the abort they are still there."""
    import threading
    import time

    pool(d, A)
    with d.pools.locked(A, "p", exclusive=True) as e:
        slots = e.alloc(2 * PS)
        p = e.pool
    old = torch.full((2 * PS, 656), 0x55, dtype=torch.uint8)
    for x in range(4):
        p.set_kv_buffer(x, slots, old)
    data, _, _ = stream_bytes(slots.numel(), range(4), (), seed=9)
    buf = kv_write.begin_write(d.pools, A, KVSelection("p", slots.tolist(), tuple(range(4)), ()))
    buf.add_packed(0, memoryview(data))
    held, let_go = threading.Event(), threading.Event()

    def hold() -> None:
        with d.pools.locked(A, "p", exclusive=True):
            held.set()
            let_go.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(5)
    deadline = time.monotonic() + 0.6
    try:
        t0 = time.monotonic()
        with pytest.raises(Cancelled, match="rows it replaced are back"):
            kv_write.write_kv(d.pools, A, buf, wanted=lambda: time.monotonic() < deadline,
                              time_left=lambda: deadline - time.monotonic())
        assert time.monotonic() < deadline  # answered before the caller's deadline
        assert time.monotonic() - t0 >= 0.2  # it did wait for the pool first
        for x in range(4):  # the old rows back, read without the lock (the holder has it)
            assert torch.equal(p.get_kv_buffer_rows(x, slots).reshape(2 * PS, -1), old)
        mine = torch.full((2 * PS, 656), 0x77, dtype=torch.uint8)
        for x in range(4):  # the worker, told the write failed, writes through its tensors
            p.set_kv_buffer(x, slots, mine)
    finally:
        let_go.set()
        holder.join(5)
    kv_write.abort_claimed(d.pools, A, buf)  # ends the claim; no second restore
    for x in range(4):
        assert torch.equal(read_rows(d, A, "p", slots, layer=x), mine)
    assert d.pools.get(A, "p").claimed_pages == 0
