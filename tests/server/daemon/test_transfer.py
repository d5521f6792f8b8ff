"""The source side of a gRPC pull (``TransferState.read_pages`` in ``server/daemon/transfer.py``) in
process: a ReadPages stream checks every run before its first chunk and copies the runs one at a
time, each under the pool's shared lock; a run whose pages a WriteKV began writing in place after that
first check must be refused, not copied half written; and a stream that names the generations its
pull read with the layout sends a page only while it still has them (attack pass F4)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from daemonkit import A, PS, daemon, fill, keys, pool, read_rows
from test_kv_write import stream_bytes

from kvtier.server.daemon import kv_ops, kv_write
from kvtier.server.daemon.errors import Busy, Cancelled, InvalidArgument, NotFound
from kvtier.server.daemon.kv_ops import KVSelection
from kvtier.server.daemon.transfer import PeerLayout, PullSpec
from kvtier.server.transfer import PageChanged, TransferError


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


# ----- a PullKV whose caller left (attack pass 8, A8-10) -----------------------------------------

class _Caller:
    """A PullKV caller that is there until :meth:`leave`."""

    def __init__(self, there: bool = True) -> None:
        self.there = there

    def leave(self) -> None:
        self.there = False

    def __call__(self) -> bool:
        return self.there


class _HalfThenAskTransport:
    """A gRPC-like transport: lands 0xEE on the destination pages' rows (a first batch arrived),
    then the caller leaves and the next batch asks for its time left, as GrpcPageTransport does."""

    name = "grpc"

    def __init__(self, entry, dst_slots: torch.Tensor, spec, caller: _Caller) -> None:
        self.entry, self.dst_slots, self.spec, self.caller = entry, dst_slots, spec, caller
        self.batches = 0

    def pull(self, remote, plan) -> None:
        self.batches += 1
        junk = torch.full((self.dst_slots.numel(), self.entry.pool.row_bytes), 0xEE, dtype=torch.uint8)
        for layer in range(self.entry.pool.layer_num):
            self.entry.pool.set_kv_buffer(layer, self.dst_slots, junk)
        self.caller.leave()
        self.spec.remaining(60.0)  # raises TransferError: the caller is gone


class _Peer:
    """A peer daemon (another in-process Daemon) reached without gRPC."""

    def __init__(self, src_daemon, caller: _Caller) -> None:
        self.src, self.caller = src_daemon, caller
        self.transports: list[_HalfThenAskTransport] = []

    @contextmanager
    def connect(self, address, caller):
        yield self

    def layout(self, pool_id, check_pages, spec, known_digest=""):
        _, layout, digest, gens = self.src.transfer.transfer_layout(A, pool_id, check_pages, known_digest)
        return PeerLayout(digest, layout, self.src.transfer.daemon_id, gens)

    def page_transport(self, entry, chunk_bytes, fail_batch, spec, expect, daemon_id):
        dst = torch.tensor(sorted(set(spec.dst_slots)), dtype=torch.int64)
        t = _HalfThenAskTransport(entry, dst, spec, self.caller)
        self.transports.append(t)
        return t


def _free_pages(d, pool_id: str) -> int:
    with d.pools.locked(A, pool_id, exclusive=False) as e:
        return e.allocator.free_pages


def test_a_pull_from_this_daemon_whose_caller_left_while_it_waited_changes_nothing(d):
    """Attack pass 8, A8-10 (same-daemon variant): a PullKV told DEADLINE_EXCEEDED while it waited for
    its destination pool went on once it had the pool and copied the source's bytes into the caller's
    pages. Now it is CANCELLED there: the 2 destination pages stay allocated, holding their old rows."""
    pool(d, A, "src")
    pool(d, A, "dst")
    src, _ = fill(d, A, "src", 2 * PS, seed=11)
    dst, old = fill(d, A, "dst", 2 * PS, seed=12)
    free_before = _free_pages(d, "dst")
    d.transfer.own_addresses.add("127.0.0.1:7")  # this daemon's address: the pull copies in process
    spec = PullSpec(pool_id="dst", peer_address="127.0.0.1:7", peer_pool_id="src", src_slots=src.tolist(),
                    dst_slots=dst.tolist(), transport="grpc", is_active=_Caller(there=False))
    with pytest.raises(Cancelled, match="nothing was changed"):
        d.transfer.pull(A, spec, peers=None)
    assert _free_pages(d, "dst") == free_before == 512 // PS - 2
    for layer in range(4):
        assert torch.equal(read_rows(d, A, "dst", dst, layer), old)


@pytest.mark.parametrize("leaves", ["while it waited", "between batches"])
def test_a_pull_from_a_peer_whose_caller_left_keeps_the_destination_pages(d, leaves):
    """Attack pass 8, A8-10: a PullKV from a peer whose caller left freed the caller's destination
    pages and answered ABORTED, to a caller told DEADLINE_EXCEEDED that still believed it held them.
    A caller gone while the pull waited for the destination pool gets CANCELLED before any byte moves;
    one gone between batches gets CANCELLED with the rows the pull replaced written back. Either way
    the 2 pages stay allocated holding their old rows."""
    peer_daemon = daemon(host_memory_bytes=8 << 20)
    try:
        pool(peer_daemon, A, "src")
        src, _ = fill(peer_daemon, A, "src", 2 * PS, seed=21)
        pool(d, A, "dst")
        dst, old = fill(d, A, "dst", 2 * PS, seed=22)
        free_before = _free_pages(d, "dst")
        caller = _Caller(there=leaves != "while it waited")
        peer = _Peer(peer_daemon, caller)
        spec = PullSpec(pool_id="dst", peer_address="127.0.0.1:7", peer_pool_id="src", src_slots=src.tolist(),
                        dst_slots=dst.tolist(), transport="grpc", is_active=caller)
        with pytest.raises(Cancelled, match="nothing was changed"):
            d.transfer.pull(A, spec, peer)
        assert sum(t.batches for t in peer.transports) == (0 if leaves == "while it waited" else 1)
        assert _free_pages(d, "dst") == free_before == 512 // PS - 2
        for layer in range(4):
            assert torch.equal(read_rows(d, A, "dst", dst, layer), old)
    finally:
        peer_daemon.close()


def test_a_pull_into_pages_never_written_since_allocation_copies_no_undo_rows(d, monkeypatch):
    """The undo rows of A8-10 cost a host copy of the destination (PullKV at about half the engine
    read's speed in the pd benchmark). Fresh destination pages (a decode side's freshly allocated
    slots, the usual case) hold nothing a call may rely on, so no copy is taken: a caller gone
    between batches gets CANCELLED and its 2 pages stay allocated; a destination the caller had
    written (stamped by a WriteKV) is copied once and written back, as the test above shows."""
    peer_daemon = daemon(host_memory_bytes=8 << 20)
    try:
        pool(peer_daemon, A, "src")
        src, _ = fill(peer_daemon, A, "src", 2 * PS, seed=51)
        pool(d, A, "dst")
        with d.pools.locked(A, "dst", exclusive=True) as e:
            fresh = e.alloc(2 * PS)  # allocated, never written
            pool_obj = e.pool
        copies: list[int] = []
        real = type(pool_obj).get_cpu_copy
        monkeypatch.setattr(type(pool_obj), "get_cpu_copy",
                            lambda self, idx, *a, **k: (copies.append(int(idx.numel())), real(self, idx, *a, **k))[1])
        free_before = _free_pages(d, "dst")
        caller = _Caller(there=True)
        spec = PullSpec(pool_id="dst", peer_address="127.0.0.1:7", peer_pool_id="src", src_slots=src.tolist(),
                        dst_slots=fresh.tolist(), transport="grpc", is_active=caller)
        with pytest.raises(Cancelled, match="never written since they were allocated"):
            d.transfer.pull(A, spec, _Peer(peer_daemon, caller))
        assert copies == []  # no undo rows taken of the destination
        assert _free_pages(d, "dst") == free_before == 512 // PS - 2  # still the caller's
        written, _ = fill(d, A, "dst", 2 * PS, seed=52)
        caller = _Caller(there=True)
        spec = PullSpec(pool_id="dst", peer_address="127.0.0.1:7", peer_pool_id="src", src_slots=src.tolist(),
                        dst_slots=written.tolist(), transport="grpc", is_active=caller)
        with pytest.raises(Cancelled, match="hold their old bytes again"):
            d.transfer.pull(A, spec, _Peer(peer_daemon, caller))
        assert copies == [2 * PS]
    finally:
        peer_daemon.close()


def test_a_pull_that_fails_while_its_caller_waits_still_frees_its_destination_pages(d):
    """The other side of A8-10: a move that fails for another reason (here the peer's transport)
    while the caller still waits frees the 2 destination pages (ABORTED: never presented as valid)."""
    peer_daemon = daemon(host_memory_bytes=8 << 20)
    try:
        pool(peer_daemon, A, "src")
        src, _ = fill(peer_daemon, A, "src", 2 * PS, seed=31)
        pool(d, A, "dst")
        dst, _ = fill(d, A, "dst", 2 * PS, seed=32)
        free_before = _free_pages(d, "dst")

        class Failing(_Peer):
            def page_transport(self, entry, chunk_bytes, fail_batch, spec, expect, daemon_id):
                class T:
                    name = "grpc"

                    def pull(self, remote, plan):
                        raise TransferError("the peer's stream broke")
                return T()

        spec = PullSpec(pool_id="dst", peer_address="127.0.0.1:7", peer_pool_id="src", src_slots=src.tolist(),
                        dst_slots=dst.tolist(), transport="grpc", is_active=_Caller())
        with pytest.raises(TransferError, match="the 2 destination pages"):
            d.transfer.pull(A, spec, Failing(peer_daemon, _Caller()))
        assert _free_pages(d, "dst") == free_before + 2
    finally:
        peer_daemon.close()
