"""The source side of a gRPC pull (``TransferState.read_pages`` in ``server/daemon/transfer.py``) in
process: a ReadPages stream checks every run before its first chunk and copies the runs one at a
time, each under the pool's shared lock; a run whose pages a WriteKV began writing in place after that
first check must be refused, not copied half written; and a stream that names the generations its
pull read with the layout sends a page only while it still has them (attack pass F4)."""

from __future__ import annotations

import pytest
import torch
from daemonkit import A, PS, daemon, fill, keys, pool
from test_kv_write import stream_bytes

from kvtier.server.daemon import kv_ops, kv_write
from kvtier.server.daemon.errors import Busy, InvalidArgument, NotFound
from kvtier.server.daemon.kv_ops import KVSelection
from kvtier.server.transfer import PageChanged


@pytest.fixture
def d():
    dm = daemon(host_memory_bytes=8 << 20)
    yield dm
    dm.close()


def test_a_run_claimed_after_the_streams_check_is_refused_not_sent_half_written(d):
    """ReadPages of page 1 on layers 0 and 1 (two runs): run 0 is sent; then a WriteKV into page 1
    claims it and lands half of layer 1's new rows in place. Run 1 must be refused Busy (the
    destination frees its pages and the pull fails), never sent holding half old, half new rows
    (bytes no commit ever made; an abort would put the old ones back after they left)."""
    pool(d, A)
    slots, old = fill(d, A, "p", PS, seed=1)
    pages = d.transfer.read_pages(A, "p", [(0, "latent", 1, 1), (1, "latent", 1, 1)], 1 << 20)
    first = next(pages)
    assert first[0] == 0 and first[2] == old.numpy().tobytes()
    data, _, _ = stream_bytes(PS, [1], (), seed=2)
    buf = kv_write.begin_write(d.pools, A, KVSelection("p", slots.tolist(), (1,), ()))
    assert buf.claimed
    buf.add_packed(0, memoryview(data)[:len(data) // 2])
    with pytest.raises(Busy, match="being written by a WriteKV"):
        for _ in pages:
            pass
    kv_write.abort_claimed(d.pools, A, buf)


def test_a_pool_made_again_under_its_name_mid_stream_is_not_read(d):
    """ReadPages of page 1 on layers 0 and 1; after run 0 the pool is deleted (force) and made again
    under its name with page 1 allocated: run 1 is NOT_FOUND, not read from the new pool."""
    pool(d, A)
    fill(d, A, "p", PS, seed=3)
    pages = d.transfer.read_pages(A, "p", [(0, "latent", 1, 1), (1, "latent", 1, 1)], 1 << 20)
    next(pages)
    d.delete_pool(A, "p", force=True)
    pool(d, A)
    fill(d, A, "p", PS, seed=4)
    with pytest.raises(NotFound):
        for _ in pages:
            pass


def generation(d, page: int) -> int:
    with d.pools.locked(A, "p", exclusive=False) as e:
        return e.generations([page])[0]


def write(d, slots: torch.Tensor, seed: int) -> None:
    """A WriteKV into ``slots`` (latent of layer 1), committed."""
    data, _, _ = stream_bytes(slots.numel(), [1], (), seed=seed)
    buf = kv_write.begin_write(d.pools, A, KVSelection("p", slots.tolist(), (1,), ()))
    buf.add_packed(0, memoryview(data))
    kv_write.write_kv(d.pools, A, buf)


def test_every_change_of_a_page_renews_its_write_generation(d):
    """A pull proves a page did not change by its write generation: every way the daemon changes a
    page -- allocate, write, claim, MoveKV onto, Restore into, free, the prefix cache's allocation
    and free -- must give it a generation it never had. A claim given back (the old rows copied
    back) changes nothing more: a stream naming the generation from before the claim still sends
    the page."""
    pool(d, A)
    slots, _ = fill(d, A, "p", PS, seed=1)  # page 1
    other, _ = fill(d, A, "p", PS, seed=2)  # page 2
    seen = [generation(d, 1)]

    def renewed() -> None:
        now = generation(d, 1)
        assert now not in seen, f"page 1 kept generation {now} ({seen})"
        seen.append(now)

    write(d, slots, seed=3)
    renewed()
    before_claim = seen[-1]
    buf = kv_write.begin_write(d.pools, A, KVSelection("p", slots.tolist(), (1,), ()))
    renewed()  # claimed: its rows change from now on, without the lock (an engine read must see it)
    kv_write.abort_claimed(d.pools, A, buf)
    assert generation(d, 1) == seen[-1]
    sent = d.transfer.read_pages(A, "p", [(1, "latent", 1, 1)], 1 << 20, [1], [before_claim], d.transfer.daemon_id)
    assert [r for r, _, _ in sent] == [0]
    kv_ops.move_kv(d.pools, A, "p", slots, other)
    renewed()
    kv_ops.offload(d.pools, d.offload_store, A, "p", "k", other, free_slots=False)
    kv_ops.restore(d.pools, d.offload_store, A, "p", "k", slots.tolist(), drop=True)
    renewed()
    kv_ops.free_slots(d.pools, A, "p", slots)
    renewed()
    again, _ = kv_ops.allocate_slots(d.pools, A, "p", PS)
    assert again.tolist() == slots.tolist()  # the same page, another allocation: the ABA of a freed page
    renewed()
    kv_ops.free_slots(d.pools, A, "p", slots)
    ld = d.tiers.load(A, "p", keys(1, seed=7), None)  # the prefix cache allocates page 1 as a fresh page
    assert ld.slots.tolist() == slots.tolist()
    renewed()
    d.tiers.release(A, "p", ld.lease)  # and frees it
    renewed()


def test_a_page_changed_between_two_runs_of_a_stream_is_refused(d):
    """ReadPages of page 1 on layers 0 and 1, naming the generation the layout gave: run 0 goes out;
    a committed WriteKV (or a free and a new allocation of the page, the next request's) lands
    before run 1, which must be refused PageChanged -- never sent, so no page leaves with layers of
    two writes. Without a change both runs go out."""
    pool(d, A)
    slots, old = fill(d, A, "p", PS, seed=1)
    _, _, _, gens = d.transfer.transfer_layout(A, "p", [1])
    runs = [(0, "latent", 1, 1), (1, "latent", 1, 1)]
    assert [r for r, _, _ in d.transfer.read_pages(A, "p", runs, 1 << 20, [1], gens, d.transfer.daemon_id)] == [0, 1]
    for change in ("write", "free + allocate"):
        _, _, _, gens = d.transfer.transfer_layout(A, "p", [1])
        pages = d.transfer.read_pages(A, "p", runs, 1 << 20, [1], gens, d.transfer.daemon_id)
        assert next(pages)[0] == 0
        if change == "write":
            write(d, slots, seed=2)
        else:
            kv_ops.free_slots(d.pools, A, "p", slots)
            assert kv_ops.allocate_slots(d.pools, A, "p", PS)[0].tolist() == slots.tolist()
        with pytest.raises(PageChanged, match="source page 1 .* changed"):
            next(pages)


def test_a_stream_with_wrong_expectations_is_refused_before_its_first_chunk(d):
    """Generations from another daemon process (a restarted peer) are ABORTED; a run's page without
    a generation, or lists of different lengths, are INVALID_ARGUMENT."""
    pool(d, A)
    fill(d, A, "p", 2 * PS, seed=1)  # pages 1, 2
    _, _, _, gens = d.transfer.transfer_layout(A, "p", [1, 2])
    with pytest.raises(PageChanged, match="another daemon process"):
        next(d.transfer.read_pages(A, "p", [(0, "latent", 1, 2)], 1 << 20, [1, 2], gens, "0" * 32))
    with pytest.raises(InvalidArgument, match="page 2 without its generation"):
        next(d.transfer.read_pages(A, "p", [(0, "latent", 1, 2)], 1 << 20, [1], gens[:1], d.transfer.daemon_id))
    with pytest.raises(InvalidArgument, match="expect_generations"):
        next(d.transfer.read_pages(A, "p", [(0, "latent", 1, 2)], 1 << 20, [1, 2], gens[:1], d.transfer.daemon_id))
