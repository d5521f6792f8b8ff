"""Every call that writes bytes into existing pages of a pool, against every kind of page (issue 23,
defect 4): one ownership check decides, and what LoadPrefix serves afterwards is what the cache was
given.

Rows (writing calls of a plain gRPC client): WriteKV into named slots, MoveKV onto, Restore into,
PullKV's destination (over gRPC from a second daemon). WriteNewKV and Restore/LoadPrefix into new
slots only write pages they allocate themselves; the attach channel carries no call that writes pool
bytes (its prefix calls are the cache's own), and the SGLang storage backend writes the tiers, never
a pool: none of them is a row.

Columns (the one page the write targets; pool: GLM-5.2's first 2 layers, 16 pages of 64 tokens):
``free`` (never handed out), ``own`` (the writer allocated it), ``session`` (another client's attach
session allocated it), ``cached`` (stored by StorePrefix, lease released), ``pinned`` (cached and
pinned by another session's lease as a hit), ``fresh_other`` (a fresh page of another session's
lease), ``fresh_own`` (a fresh page of the writer's own lease, which it fills before StorePrefix).

Expected outcomes, worked out from the rules (README "Local attach" and issue 23), not read off the code:
a page not allocated is INVALID_ARGUMENT; another session's page, a cached page (pinned or not) and
another lease's fresh page are FAILED_PRECONDITION; the writer's own page and its own lease's fresh
page are written, by every call: PullKV too (a decode side that leased its prompt's pages receives the
missing ones from prefill into the fresh pages, then stores them). A refused write leaves the page's
bytes as they were. A failed PullKV frees its destination: a fresh page of the caller's lease leaves
the lease (it can no longer be stored), the lease stays open.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch
from kv_helpers import PAGE_SIZE, random_kv

from kvtier.client import FailedPreconditionError, InvalidArgumentError, KVTierClient, KVTierError
from kvtier.client.spawn import DaemonProcess

ARGS = ["--device", "cpu", "--host-memory", "4MiB", "--pool-memory", "64MiB", "--log-level", "WARNING"]
KINDS = ("free", "own", "session", "cached", "pinned", "fresh_other", "fresh_own")
OK, IA, FP = "written", InvalidArgumentError, FailedPreconditionError
EXPECTED = {
    #            free own session cached pinned fresh_other fresh_own
    "write_kv": (IA, OK, FP, FP, FP, FP, OK),
    "move_kv": (IA, OK, FP, FP, FP, FP, OK),
    "restore": (IA, OK, FP, FP, FP, FP, OK),
    "pull_kv": (IA, OK, FP, FP, FP, FP, OK),
}
OLD, NEW = 70, 71  # seeds: the bytes a page holds before, the bytes the write carries


def rows(seed: int) -> torch.Tensor:
    """``(64, 656)`` uint8 layer-0 latent rows of one page, seeded."""
    return random_kv(PAGE_SIZE, seed=seed, layers=[0], live=[])[0][0]


def page_slots(page: int) -> torch.Tensor:
    return torch.arange(page * PAGE_SIZE, (page + 1) * PAGE_SIZE, dtype=torch.int64)


def layer0(c: KVTierClient, pool: str, slots: torch.Tensor) -> torch.Tensor:
    return c.read_kv(pool, slots, latent_layers=[0], index_layers=[]).latent[0].view(torch.uint8).reshape(PAGE_SIZE, -1)


@pytest.fixture(scope="module")
def peer() -> Iterator[tuple[DaemonProcess, str]]:
    """A second daemon whose pool ``src`` holds the NEW bytes on ``(page)``: PullKV's source (on TCP:
    a unix-socket peer other than the daemon's own address is refused)."""
    with DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=ARGS) as d, KVTierClient(d.address, timeout=30.0) as c:
        c.create_pool("glm-5.2", num_layers=2, size_tokens=1024, pool_id="src")
        slots = c.allocate_slots("src", PAGE_SIZE)
        c.write_kv("src", slots, latent={0: rows(NEW)})
        yield d, f"{int(slots[0]) // PAGE_SIZE}"


@pytest.fixture(scope="module")
def own_daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess(extra_args=ARGS) as d:
        yield d


class Scene:
    """One fresh pool with a target page of ``kind`` (and what it must hold) and a source page of NEW bytes."""

    def __init__(self, c: KVTierClient, kind: str) -> None:
        self.c, self.kind = c, kind
        self.pool = f"own-{uuid.uuid4().hex[:8]}"
        c.create_pool("glm-5.2", num_layers=2, size_tokens=1024, pool_id=self.pool)
        self.session = c.attach(self.pool)
        self.src = c.allocate_slots(self.pool, PAGE_SIZE)
        c.write_kv(self.pool, self.src, latent={0: rows(NEW)})
        self.key = uuid.uuid4().bytes
        self.lease = self.other_lease = None
        if kind == "free":
            self.target = c.allocate_slots(self.pool, PAGE_SIZE)
            c.free_slots(self.pool, self.target)
        elif kind == "own":
            self.target = c.allocate_slots(self.pool, PAGE_SIZE)
            c.write_kv(self.pool, self.target, latent={0: rows(OLD)})
        elif kind == "session":
            self.target = self.session.allocate_slots(PAGE_SIZE)
        elif kind in ("cached", "pinned"):
            lease = c.load_prefix(self.pool, [self.key])
            c.write_kv(self.pool, lease.slots, latent={0: rows(OLD)})
            c.store_prefix(lease, [self.key], lease.slots, release=True)
            self.target = lease.slots
            if kind == "pinned":
                self.other_lease = self.session.load_prefix([self.key])
                assert self.other_lease.loaded_pages == 1 and torch.equal(self.other_lease.slots, self.target)
        elif kind == "fresh_other":
            self.other_lease = self.session.load_prefix([self.key])
            self.target = self.other_lease.slots
        elif kind == "fresh_own":
            self.lease = c.load_prefix(self.pool, [self.key])
            self.target = self.lease.slots
            c.write_kv(self.pool, self.target, latent={0: rows(OLD)})
        self.before = None if kind == "free" else layer0(c, self.pool, self.target)

    @property
    def target_page(self) -> int:
        return int(self.target[0]) // PAGE_SIZE

    def write(self, call: str, peer: tuple[DaemonProcess, str]) -> None:
        c, pool = self.c, self.pool
        if call == "write_kv":
            c.write_kv(pool, self.target, latent={0: rows(NEW)})
        elif call == "move_kv":
            c.move_kv(pool, self.target, self.src)
        elif call == "restore":
            key = f"copy-{uuid.uuid4().hex[:8]}"
            c.offload(pool, key, self.src)
            c.restore(pool, key, self.target, drop=True)
        elif call == "pull_kv":
            d, src_page = peer
            c.pull_kv(pool, d.address, "src", src_pages=[int(src_page)], dst_pages=[self.target_page], transport="grpc")

    def served_by_prefix_cache(self) -> torch.Tensor:
        """Layer 0 of the page a new LoadPrefix of the key serves (after the leases of the scene end)."""
        c = self.c
        if self.lease is not None:
            c.store_prefix(self.lease, [self.key], self.lease.slots, release=True)
        if self.other_lease is not None:
            if self.kind == "fresh_other":
                self.session.store_prefix(self.other_lease, [self.key], self.other_lease.slots, release=True)
            else:
                self.session.release_prefix(self.other_lease)
        lease = c.load_prefix(self.pool, [self.key])
        try:
            assert lease.loaded_pages == 1
            return layer0(c, self.pool, lease.slots)
        finally:
            c.release_prefix(lease)

    def close(self) -> None:
        self.session.detach()
        self.c.delete_pool(self.pool, force=True)


@pytest.mark.parametrize("call", sorted(EXPECTED))
@pytest.mark.parametrize("kind", KINDS)
def test_every_write_against_every_kind_of_page(own_daemon, peer, call, kind):
    """Scenario (issue 23, defect 4): WriteKV, MoveKV onto and Restore into a cached page (after
    ReleasePrefix) or one another client's lease pins were accepted, and the next LoadPrefix served
    the new bytes under the old key. Each cell: the write succeeds or fails as the table in the module
    docstring says; the page then holds the NEW bytes if written, else what it held; a page of the
    prefix cache is served by a new LoadPrefix with exactly those bytes."""
    expected = EXPECTED[call][KINDS.index(kind)]
    with KVTierClient(own_daemon.address, timeout=30.0) as c:
        scene = Scene(c, kind)
        try:
            if expected is OK:
                scene.write(call, peer)
            else:
                with pytest.raises(expected) as e:
                    scene.write(call, peer)
                assert "\n" not in str(e.value)
            if kind == "free":
                return
            want = rows(NEW) if expected is OK else scene.before
            assert torch.equal(layer0(c, scene.pool, scene.target), want)
            if kind in ("cached", "pinned", "fresh_other", "fresh_own"):
                assert torch.equal(scene.served_by_prefix_cache(), want)
        finally:
            scene.close()


def test_a_failed_pull_into_its_own_leases_fresh_page_frees_it_and_caches_nothing(peer):
    """Scenario (security pass, D11): PullKV refused the fresh pages of the caller's own lease (a decode
    side receiving the pages its LoadPrefix did not find), although every other write may fill them.
    Now such a pull is allowed (the table above); when it fails after its first batch moved (a daemon
    that fails batch 2 of every transfer, one item a batch), it is ABORTED and the half-written page
    is freed and taken out of the lease: StorePrefix of it is INVALID_ARGUMENT, the lease itself stays
    open and is released, the pool has every page free again and the key is cached nowhere."""
    import grpc

    d, src_page = peer
    with DaemonProcess(extra_args=ARGS, env={"KVTIER_TRANSFER_FAIL_BATCH": "2"}) as failing, \
            KVTierClient(failing.address, timeout=30.0) as c:
        c.create_pool("glm-5.2", num_layers=2, size_tokens=1024, pool_id="p")
        free_before = c.describe_pool("p").free_pages
        key = uuid.uuid4().bytes
        lease = c.load_prefix("p", [key])
        assert lease.loaded_pages == 0 and lease.slots.numel() == PAGE_SIZE
        with pytest.raises(KVTierError) as e:
            c.pull_kv("p", d.address, "src", src_pages=[int(src_page)], dst_pages=[int(lease.slots[0]) // PAGE_SIZE],
                      transport="grpc", max_batch_items=1)
        assert e.value.code == grpc.StatusCode.ABORTED and "injected failure in batch 2" in e.value.details
        assert "were freed" in e.value.details
        assert c.describe_pool("p").free_pages == free_before
        with pytest.raises(InvalidArgumentError, match="not allocated"):
            c.read_kv("p", lease.slots)
        with pytest.raises(InvalidArgumentError, match="fresh pages of this lease"):
            c.store_prefix(lease, [key], lease.slots)
        c.release_prefix(lease)
        again = c.load_prefix("p", [key])
        assert again.loaded_pages == 0 and again.tiers == []
        c.release_prefix(again)
