"""Every pair of RPC kinds at once against one real daemon: nothing hangs and every byte stays right.

Issue 8, defect 1: a stats poll racing an offload deadlocked the daemon. The cause was two locks
taken in opposite orders; the fix is one lock order for the whole daemon (README "Concurrency").
This test keeps it honest: each of the 36 kinds -- every PoolService, TierService, TransferService
and StorageService RPC, WriteKV also as the write that allocates (the staged ones through a storage session's shared memory), the three prefix
calls of an attach connection (``AttachedPool.load_prefix`` / ``store_prefix`` / ``release_prefix``:
each side has its own attach session on the prefix pool, its pages read and written through the
mapped tensors), plus health and what ``kvtier status`` calls -- runs beside every kind (itself
included: 666 pairs), each side a small scenario that checks its own bytes, every call with
a 30 s deadline (a hang fails instead of stalling). At the end the reference KV, the reference copy,
the reference prefix pages and the reference units are still byte-exact, and nothing is left
allocated, pinned or waiting.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import uuid
from collections.abc import Callable

import grpc
import pytest
import torch

from kvtier.client import InvalidArgumentError, KVTierClient, NotFoundError
from kvtier.client.attach import AttachedPool
from kvtier.client.spawn import DaemonProcess
from kvtier.client.storage import UnitSpaceSpec
from kvtier.page_keys import page_keys
from kvtier.v1 import storage_pb2, transfer_pb2, transfer_pb2_grpc

PS = 64
LAYERS = 4
LIVE = (0, 1, 2)
STORE_KEYS = page_keys(list(range(10_000, 10_000 + 6 * PS)), PS)  # the keys StorePrefix scenarios share
REF_KEYS = page_keys(list(range(2 * PS)), PS)
UNITS = UnitSpaceSpec("glm-5.2", num_layers=LAYERS, start_layer=0, kv_lora_rank=512, qk_rope_head_dim=64,
                      index_head_dim=128, kv_cache_dtype="fp8", page_size=PS, latent_row_bytes=656, skip_mask="FFFS")


def unit_bytes(seed: int, n: int) -> torch.Tensor:
    """``n`` units (KV part then index part each) of deterministic bytes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n * UNITS.part_nbytes("both"),), dtype=torch.uint8, generator=g)


def content(seed: int, n: int):
    """Deterministic KV of ``n`` slots: latent {layer: (n, 656) uint8}, index {live layer: (keys, scales)}."""
    g = torch.Generator().manual_seed(seed)
    latent = {x: torch.randint(0, 256, (n, 656), dtype=torch.uint8, generator=g) for x in range(LAYERS)}
    index = {x: (torch.randint(0, 256, (n, 128), dtype=torch.uint8, generator=g), torch.rand(n, generator=g)) for x in LIVE}
    return latent, index


def key_seed(key: bytes) -> int:
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little")


def mapped_same(ap: AttachedPool, slots: torch.Tensor, latent, index) -> bool:
    """The attached pool's mapped tensors hold ``latent``/``index`` at ``slots`` (the worker's view)."""
    return (all(torch.equal(ap.kv_buffer[x][slots].view(-1, 656), latent[x]) for x in latent)
            and all(all(torch.equal(a, b) for a, b in zip(ap.get_index_k_scale(x, slots), index[x])) for x in index))


def write_mapped(ap: AttachedPool, slots: torch.Tensor, latent, index) -> None:
    """Write KV onto ``slots`` through the attached pool's mapped tensors, as an engine does."""
    for x, rows in latent.items():
        ap.kv_buffer[x][slots] = rows.view(-1, 1, 656)
    for x, (keys, scales) in index.items():
        ap.set_index_k_scale_buffer(x, slots, keys, scales)


def same(kv, latent, index, rows: slice = slice(None)) -> bool:
    return (all(torch.equal(kv.latent[x][rows], latent[x]) for x in latent)
            and all(torch.equal(kv.index_k[x][rows], index[x][0]) and torch.equal(kv.index_scale[x][rows], index[x][1])
                    for x in index))


class Scene:
    """The daemon, its pools and the reference data every scenario may read but none changes."""

    def __init__(self, d: DaemonProcess) -> None:
        self.address = d.address
        with KVTierClient(d.address, timeout=30) as c:
            for pool_id, pages in (("shared", 64), ("dst", 64), ("pfx", 32)):
                c.create_pool("glm-5.2", num_layers=LAYERS, size_tokens=pages * PS, pool_id=pool_id)
            self.ref_slots = c.allocate_slots("shared", 2 * PS)
            self.ref = content(1, 2 * PS)
            c.write_kv("shared", self.ref_slots, latent=self.ref[0], index=self.ref[1])
            copy_slots = c.allocate_slots("shared", PS)
            self.copy = content(2, PS)
            c.write_kv("shared", copy_slots, latent=self.copy[0], index=self.copy[1])
            c.offload("shared", "ref-copy", copy_slots, free_slots=True)
            lease = c.load_prefix("pfx", REF_KEYS)
            self.pfx = content(3, 2 * PS)
            c.write_kv("pfx", lease.slots, latent=self.pfx[0], index=self.pfx[1])
            c.store_prefix(lease, REF_KEYS, lease.slots)
            c.release_prefix(lease)
            self.units = unit_bytes(4, 2)
            assert c.put_units(UNITS, [b"ref-0", b"ref-1"], "both", self.units).completed == 2
        self._attached: dict[int, AttachedPool] = {}  # id(client) -> its attach session on "pfx"

    def attached(self, c: KVTierClient) -> AttachedPool:
        """``c``'s attach session on the prefix pool (one a client: a side's calls on it are one at a time)."""
        ap = self._attached.get(id(c))
        if ap is None:
            ap = self._attached[id(c)] = c.attach("pfx")
        return ap

    def detach_all(self) -> None:
        for ap in self._attached.values():
            ap.detach()
        self._attached.clear()

    # ----- one scenario per RPC kind ----------------------------------------------------------
    def CreatePool(self, c: KVTierClient) -> None:
        pid = f"cp-{uuid.uuid4().hex[:8]}"
        assert c.create_pool("glm-5.2", num_layers=2, size_tokens=2 * PS, pool_id=pid).size_tokens == 2 * PS
        c.delete_pool(pid)

    def DeletePool(self, c: KVTierClient) -> None:
        pid = f"dp-{uuid.uuid4().hex[:8]}"
        c.create_pool("glm-5.2", num_layers=2, size_tokens=2 * PS, pool_id=pid)
        c.allocate_slots(pid, PS)
        assert c.delete_pool(pid, force=True) > 0
        with pytest.raises(NotFoundError):
            c.describe_pool(pid)

    def DescribePool(self, c: KVTierClient) -> None:
        info = c.describe_pool("shared")
        assert info.layout.skip_mask == "FFFS" and info.total_pages == 64

    def ListPools(self, c: KVTierClient) -> None:
        assert {"shared", "dst", "pfx"} <= {p.pool_id for p in c.list_pools()}

    def AllocateSlots(self, c: KVTierClient) -> None:
        s = c.allocate_slots("shared", 100)
        assert s.numel() == 100 and int(s[0]) % PS == 0
        c.free_slots("shared", s)

    def FreeSlots(self, c: KVTierClient) -> None:
        pid = f"fs-{uuid.uuid4().hex[:8]}"  # a pool of its own: in "shared" another side may take the page again
        c.create_pool("glm-5.2", num_layers=2, size_tokens=2 * PS, pool_id=pid)
        s = c.allocate_slots(pid, PS)
        assert c.free_slots(pid, s) == 1
        with pytest.raises(InvalidArgumentError, match="not allocated"):
            c.free_slots(pid, s)
        c.delete_pool(pid)

    def WriteKV(self, c: KVTierClient) -> None:
        s = c.allocate_slots("shared", PS)
        lat, idx = content(int(s[0]), PS)
        c.write_kv("shared", s, latent=lat, index=idx)
        assert same(c.read_kv("shared", s), lat, idx)
        c.free_slots("shared", s)

    def WriteNewKV(self, c: KVTierClient) -> None:  # WriteKV with allocate_tokens
        lat, idx = content(7, PS)
        s = c.write_new_kv("shared", latent=lat, index=idx)
        assert same(c.read_kv("shared", s), lat, idx)
        c.free_slots("shared", s)

    def ReadKV(self, c: KVTierClient) -> None:
        assert same(c.read_kv("shared", self.ref_slots), *self.ref)

    def MoveKV(self, c: KVTierClient) -> None:
        s = c.allocate_slots("shared", 2 * PS)
        lat, idx = content(int(s[0]) + 1, PS)
        c.write_kv("shared", s[:PS], latent=lat, index=idx)
        assert c.move_kv("shared", s[PS:], s[:PS]) == PS
        assert same(c.read_kv("shared", s[PS:]), lat, idx)
        c.free_slots("shared", s)

    def Offload(self, c: KVTierClient) -> None:
        s = c.allocate_slots("shared", PS)
        lat, idx = content(int(s[0]) + 2, PS)
        c.write_kv("shared", s, latent=lat, index=idx)
        key = f"off-{uuid.uuid4().hex[:8]}"
        assert c.offload("shared", key, s, free_slots=True).freed_pages == 1
        back = c.restore("shared", key, drop=True)
        assert same(c.read_kv("shared", back), lat, idx)
        c.free_slots("shared", back)

    def Restore(self, c: KVTierClient) -> None:
        back = c.restore("shared", "ref-copy")
        assert same(c.read_kv("shared", back), *self.copy)
        c.free_slots("shared", back)

    def Drop(self, c: KVTierClient) -> None:
        s = c.allocate_slots("shared", PS)
        key = f"drop-{uuid.uuid4().hex[:8]}"
        c.offload("shared", key, s, free_slots=True)
        assert c.drop(key) is True and c.drop(key) is False

    def GetBufferInfos(self, c: KVTierClient) -> None:
        infos = c.buffer_infos("shared")
        assert [i.data_len == 0 for i in infos.state] == [False, False, False, True] and len(infos.contiguous) == LAYERS

    def GetStats(self, c: KVTierClient) -> None:
        assert "shared" in {p.pool_id for p in c.stats().pools}

    def LookupPrefix(self, c: KVTierClient) -> None:
        assert len(c.lookup_prefix("pfx", REF_KEYS).tiers) == 2

    def LoadPrefix(self, c: KVTierClient) -> None:
        lease = c.load_prefix("pfx", REF_KEYS)
        try:
            assert lease.loaded_pages == 2 and same(c.read_kv("pfx", lease.slots), *self.pfx)
        finally:
            c.release_prefix(lease)

    def StorePrefix(self, c: KVTierClient) -> None:
        key = STORE_KEYS[uuid.uuid4().int % len(STORE_KEYS)]
        lat, idx = content(key_seed(key), PS)
        lease = c.load_prefix("pfx", [key])
        try:
            if lease.loaded_pages:  # stored before (maybe moved down and back): the same bytes
                assert same(c.read_kv("pfx", lease.slots), lat, idx)
            else:
                c.write_kv("pfx", lease.slots, latent=lat, index=idx)
                c.store_prefix(lease, [key], lease.slots)
        finally:
            c.release_prefix(lease)

    def ReleasePrefix(self, c: KVTierClient) -> None:
        lease = c.load_prefix("pfx", REF_KEYS[:1])
        c.release_prefix(lease)
        with pytest.raises(NotFoundError, match="unknown or released"):
            c.release_prefix(lease)

    # ----- the prefix calls of an attach connection (one SEQPACKET message each way) -------------
    def AttachLoadPrefix(self, c: KVTierClient) -> None:
        ap = self.attached(c)
        lease = ap.load_prefix(REF_KEYS)
        try:
            assert lease.loaded_pages == 2 and mapped_same(ap, lease.slots, *self.pfx)
        finally:
            ap.release_prefix(lease)

    def AttachStorePrefix(self, c: KVTierClient) -> None:
        ap = self.attached(c)
        key = STORE_KEYS[uuid.uuid4().int % len(STORE_KEYS)]  # shared with StorePrefix: the same bytes a key
        lat, idx = content(key_seed(key), PS)
        lease = ap.load_prefix([key])
        if lease.loaded_pages:
            try:
                assert mapped_same(ap, lease.slots, lat, idx)
            finally:
                ap.release_prefix(lease)
            return
        try:
            write_mapped(ap, lease.slots, lat, idx)
        except BaseException:
            ap.release_prefix(lease)
            raise
        assert ap.store_prefix(lease, [key], lease.slots, release=True) == 1

    def AttachReleasePrefix(self, c: KVTierClient) -> None:
        ap = self.attached(c)
        lease = ap.load_prefix(REF_KEYS[:1])
        ap.release_prefix(lease)
        with pytest.raises(NotFoundError, match="unknown or released"):
            ap.release_prefix(lease)

    def WhereIs(self, c: KVTierClient) -> None:
        assert all(w for w in c.where_is("pfx", REF_KEYS))

    def GetTierStats(self, c: KVTierClient) -> None:
        assert "host" in c.tier_stats("pfx").tiers and c.tier_stats("").tiers["disk"]["capacity_bytes"] > 0

    def GetTransferLayout(self, c: KVTierClient) -> None:
        lay = c.transfer_layout("shared", check_pages=(self.ref_slots[::PS] // PS).tolist())
        assert len(lay.latent) == LAYERS and lay.layout.skip_mask == "FFFS"

    def PullKV(self, c: KVTierClient) -> None:
        dst = c.allocate_slots("dst", 2 * PS)
        try:  # the daemon is its own peer (gRPC transport: ReadPages of the reference pages)
            r = c.pull_kv("dst", self.address, "shared", src_slots=self.ref_slots, dst_slots=dst, transport="grpc")
            assert r.num_pages == 2 and same(c.read_kv("dst", dst), *self.ref)
        finally:
            c.free_slots("dst", dst)

    def ReadPages(self, c: KVTierClient) -> None:
        first = int(self.ref_slots[0]) // PS
        run = transfer_pb2.PageRun(layer_id=1, component=transfer_pb2.PAGE_COMPONENT_LATENT, first_page=first, num_pages=2)
        msgs = list(c.stub(transfer_pb2_grpc.TransferServiceStub).ReadPages(
            transfer_pb2.ReadPagesRequest(pool_id="shared", runs=[run]), timeout=30))
        assert b"".join(m.data for m in msgs) == self.ref[0][1].numpy().tobytes()

    # ----- the unit store (StorageService) ----------------------------------------------------
    def _own_space(self) -> UnitSpaceSpec:
        return UnitSpaceSpec(**{**UNITS.__dict__, "scope": f"s-{uuid.uuid4().hex[:12]}"})

    def ExistUnits(self, c: KVTierClient) -> None:
        assert c.exist_units(UNITS, [b"ref-0", b"ref-1", b"absent"]) == 2

    def PutUnits(self, c: KVTierClient) -> None:
        space, data, n = self._own_space(), unit_bytes(5, 2), UNITS.part_nbytes("both")
        kv = torch.cat([data[:UNITS.kv_nbytes], data[n:n + UNITS.kv_nbytes]])
        index = torch.cat([data[UNITS.kv_nbytes:n], data[n + UNITS.kv_nbytes:]])
        assert c.put_units(space, [b"a", b"b"], "index", index).pending == 2
        assert c.exist_units(space, [b"a", b"b"]) == 0
        assert c.put_units(space, [b"a", b"b"], "kv", kv).completed == 2
        out = torch.empty_like(data)
        assert c.get_units(space, [b"a", b"b"], "both", out) == [True, True] and torch.equal(out, data)
        assert c.clear_units(space) == 2

    def GetUnits(self, c: KVTierClient) -> None:
        out = torch.empty_like(self.units)
        assert c.get_units(UNITS, [b"ref-0", b"ref-1"], "both", out) == [True, True]
        assert torch.equal(out, self.units)

    def ClearUnits(self, c: KVTierClient) -> None:
        space = self._own_space()
        c.put_units(space, [b"c"], "both", unit_bytes(6, 1))
        assert c.clear_units(space) == 1 and c.exist_units(space, [b"c"]) == 0

    def PutUnitsStaged(self, c: KVTierClient) -> None:
        space, data, n = self._own_space(), unit_bytes(7, 2), UNITS.part_nbytes("both")
        with c.storage_session() as s:           # a storage session on the attach channel: shared memory
            buf = s.buffer(2 * n)
            buf.tensor[:UNITS.index_nbytes].copy_(data[UNITS.kv_nbytes:n])
            buf.tensor[UNITS.index_nbytes:2 * UNITS.index_nbytes].copy_(data[n + UNITS.kv_nbytes:])
            assert s.client.put_units_staged(space, [b"a", b"b"], "index", buf.index).pending == 2
            buf.tensor[:UNITS.kv_nbytes].copy_(data[:UNITS.kv_nbytes])
            buf.tensor[UNITS.kv_nbytes:2 * UNITS.kv_nbytes].copy_(data[n:n + UNITS.kv_nbytes])
            assert s.client.put_units_staged(space, [b"a", b"b"], "kv", buf.index).completed == 2
            buf.tensor.zero_()
            assert s.client.get_units_staged(space, [b"a", b"b"], "both", buf.index) == [True, True]
            assert torch.equal(buf.tensor, data)
        assert c.clear_units(space) == 2

    def GetUnitsStaged(self, c: KVTierClient) -> None:
        with c.storage_session() as s:
            buf = s.buffer(self.units.numel())
            assert s.client.get_units_staged(UNITS, [b"ref-0", b"ref-1"], "both", buf.index) == [True, True]
            assert torch.equal(buf.tensor, self.units)

    def GetUnitStats(self, c: KVTierClient) -> None:
        assert c.unit_stats()["units_stored"] >= 2

    def health(self, c: KVTierClient) -> None:
        assert c.health() == "SERVING" and c.health("kvtier.v1.TierService") == "SERVING"

    def status(self, c: KVTierClient) -> None:  # what `kvtier status` asks
        assert c.health() == "SERVING"
        s = c.stats()
        assert s.version and [t.tier for t in s.tiers] == ["device", "host", "disk"]


KINDS = ["CreatePool", "DescribePool", "ListPools", "DeletePool", "AllocateSlots", "FreeSlots", "WriteKV", "WriteNewKV", "ReadKV",
         "MoveKV", "Offload", "Restore", "Drop", "GetBufferInfos", "GetStats", "LookupPrefix", "LoadPrefix",
         "StorePrefix", "ReleasePrefix", "WhereIs", "GetTierStats", "GetTransferLayout", "PullKV", "ReadPages",
         "ExistUnits", "PutUnits", "GetUnits", "ClearUnits", "GetUnitStats", "PutUnitsStaged", "GetUnitsStaged",
         "AttachLoadPrefix", "AttachStorePrefix", "AttachReleasePrefix", "health", "status"]
ATTACH_KINDS = {"AttachLoadPrefix", "AttachStorePrefix", "AttachReleasePrefix"}


def test_the_kinds_cover_every_rpc():
    from kvtier.v1 import pool_pb2, tier_pb2

    rpcs = {m.name for mod, svc in ((pool_pb2, "PoolService"), (tier_pb2, "TierService"), (transfer_pb2, "TransferService"),
                                    (storage_pb2, "StorageService"))
            for m in mod.DESCRIPTOR.services_by_name[svc].methods}
    assert rpcs <= set(KINDS) and len(KINDS) == len(rpcs) + len(ATTACH_KINDS) + 3  # + WriteNewKV, health, status
    from kvtier.attach_wire import PREFIX_KINDS

    assert {"Attach" + "".join(w.title() for w in k.split("_")) for k in PREFIX_KINDS} == ATTACH_KINDS


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pairs")
    args = ["--device", "cpu", "--host-memory", "16MiB", "--disk-path", str(tmp / "disk"), "--disk-size", "64MiB",
            "--pool-memory", "512MiB", "--log-level", "WARNING"]
    with DaemonProcess(extra_args=args) as d:
        yield Scene(d)


def _side(fn: Callable[[KVTierClient], None], client: KVTierClient, other_done: threading.Event, me_done: threading.Event,
          errors: list) -> None:
    try:
        for run in range(3):  # at least once, and on while the other side is still in its first run
            fn(client)
            if run == 0:
                me_done.set()
            if other_done.is_set():
                break
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)
    finally:
        me_done.set()


def test_every_pair_of_rpc_kinds_at_once(scene):
    clients = [KVTierClient(scene.address, timeout=30, retries=0) for _ in range(2)]
    failures: list[str] = []
    pairs = 0
    try:
        for a, b in itertools.combinations_with_replacement(KINDS, 2):
            pairs += 1
            errors: list[BaseException] = []
            done = [threading.Event(), threading.Event()]
            threads = [threading.Thread(target=_side, args=(getattr(scene, k), clients[i], done[1 - i], done[i], errors),
                                        daemon=True) for i, k in enumerate((a, b))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(150)
            if any(t.is_alive() for t in threads):
                pytest.fail(f"{a} + {b} hung past every call's 30 s deadline")
            failures += [f"{a} + {b}: {type(e).__name__}: {e}" for e in errors]
        assert failures == [] and pairs == len(KINDS) * (len(KINDS) + 1) // 2
        with KVTierClient(scene.address, timeout=30) as c:  # the references are intact, nothing leaked
            scene.ReadKV(c)
            scene.Restore(c)
            scene.LoadPrefix(c)
            assert c.describe_pool("shared").used_pages == 2 and c.describe_pool("dst").used_pages == 0
            t = c.tier_stats("pfx")
            assert t.device["pinned_pages"] == 0 and t.device["open_leases"] == 0  # before detach releases any
            scene.detach_all()
            assert all(row["pinned"] == 0 for row in t.tiers.values())
            assert sorted(p.pool_id for p in c.list_pools()) == ["dst", "pfx", "shared"]
            scene.GetUnits(c)
            assert c.unit_stats()["parts_pending"] == 0
    finally:
        scene.detach_all()
        for c in clients:
            c.close()
