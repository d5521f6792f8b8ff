"""WriteKV's landing and commit in process (``server/daemon/kv_write.py``): a write that allocates puts
every chunk's latent bytes straight into its reserved pages, whatever the chunk boundaries (inside a
row, across runs of pages, across segments, into the staged indexer part), and the commit grants the
pages; a write into named slots leaves the pool untouched until its commit. Expected bytes are placed
by hand here: row ``i`` of layer ``x`` at ``pool.kv_buffer[x][slot i]``."""

from __future__ import annotations

import pytest
import torch
from daemonkit import A, PS, daemon, pool, read_rows

from kvtier.server.daemon import kv_write
from kvtier.server.daemon.errors import Cancelled, InvalidArgument
from kvtier.server.daemon.kv_ops import KVSelection


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
