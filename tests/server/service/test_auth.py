"""Tenants over gRPC, against a real daemon with ``--auth-tokens``: UNAUTHENTICATED without a known
token (health and reflection stay open), every RPC tried across tenants is NOT_FOUND (with the
message of an absent name) or harmless and changes nothing, PullKV forwards the caller's token, no
token ever reaches the log; the tokens file and the listening rules are enforced at start."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.client import KVTierClient, UnauthenticatedError
from kvtier.client.spawn import DaemonProcess
from kvtier.page_keys import page_keys
from kvtier.v1 import pool_pb2, pool_pb2_grpc, tier_pb2, tier_pb2_grpc, transfer_pb2, transfer_pb2_grpc

TOKEN_A = "tenant-a-secret-0123456789abcdef"
TOKEN_B = "tenant-b-secret-0123456789abcdef"
PS = 64
LAYERS = 4  # GLM-5.2's first 4 layers: 0, 1, 2 own an indexer buffer, 3 skips top-k
LIVE = (0, 1, 2)


def write_tokens(path, text: str | None = None, mode: int = 0o600):
    path.write_text(text if text is not None else f'[tokens]\n"{TOKEN_A}" = "team-a"\n"{TOKEN_B}" = "team-b"\n')
    os.chmod(path, mode)
    return path


@pytest.fixture(scope="module")
def authd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    tokens = write_tokens(tmp / "tokens.toml")
    args = ["--device", "cpu", "--auth-tokens", str(tokens), "--host-memory", "16MiB", "--pool-memory", "256MiB",
            "--disk-path", str(tmp / "disk"), "--disk-size", "64MiB", "--log-level", "DEBUG"]
    with DaemonProcess(extra_args=args) as d:
        yield d


def kv(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    latent = {x: torch.randint(0, 256, (n, 656), dtype=torch.uint8, generator=g) for x in range(LAYERS)}
    index = {x: (torch.randint(0, 256, (n, 128), dtype=torch.uint8, generator=g),
                 torch.rand(n, generator=g, dtype=torch.float32)) for x in LIVE}
    return latent, index


def test_calls_without_a_known_token_are_unauthenticated_but_health_and_reflection_are_open(authd):
    for token in ("", "not-a-token-but-long-enough"):
        with KVTierClient(authd.address, token=token, timeout=10) as c:
            with pytest.raises(UnauthenticatedError, match="no token" if not token else "unknown token"):
                c.list_pools()
            with pytest.raises(UnauthenticatedError):
                c.tier_stats()
    with grpc.insecure_channel(authd.address) as ch:  # no metadata at all
        with pytest.raises(grpc.RpcError) as e:
            list(pool_pb2_grpc.PoolServiceStub(ch).ReadKV(pool_pb2.ReadKVRequest(), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

        assert "kvtier.v1.PoolService" in set(ProtoReflectionDescriptorDatabase(ch).get_services())


class Scene:
    """Tenant a's things: a pool with written KV, an offloaded copy, cached prefix pages and an open lease."""

    def __init__(self, address: str) -> None:
        self.a = KVTierClient(address, token=TOKEN_A, timeout=30)
        self.b = KVTierClient(address, token=TOKEN_B, timeout=30)
        self.a.create_pool("glm-5.2", num_layers=LAYERS, size_tokens=16 * PS, pool_id="alpha")
        self.b.create_pool("glm-5.2", num_layers=LAYERS, size_tokens=16 * PS, pool_id="beta")
        self.slots = self.a.allocate_slots("alpha", 2 * PS)
        self.latent, self.index = kv(2 * PS, seed=1)
        self.a.write_kv("alpha", self.slots, latent=self.latent, index=self.index)
        copy = self.a.allocate_slots("alpha", PS)
        self.a.write_kv("alpha", copy, latent=kv(PS, 2)[0])
        self.a.offload("alpha", "ka", copy, free_slots=True)
        self.keys = page_keys(list(range(3 * PS)), PS)
        ld = self.a.load_prefix("alpha", self.keys[:2])
        self.a.write_kv("alpha", ld.slots, latent=kv(2 * PS, 3)[0])
        self.a.store_prefix(ld, self.keys[:2], ld.slots)
        self.a.release_prefix(ld)
        self.lease = self.a.load_prefix("alpha", self.keys)  # 2 cached pages pinned + 1 fresh page, left open

    def checksum(self) -> str:
        """Everything of tenant a's state a's own calls can see."""
        h = hashlib.sha256()
        got = self.a.read_kv("alpha", self.slots)
        for x in range(LAYERS):
            h.update(got.latent[x].numpy().tobytes())
        for x in LIVE:
            h.update(got.index_k[x].numpy().tobytes() + got.index_scale[x].numpy().tobytes())
        info = self.a.describe_pool("alpha")
        h.update(repr((info.free_pages, info.used_pages, [p.pool_id for p in self.a.list_pools()])).encode())
        h.update(repr(self.a.where_is("alpha", self.keys)).encode())
        t = self.a.tier_stats("alpha")
        h.update(repr((t.device, {k: (v["entries"], v["tenant_used_bytes"]) for k, v in t.tiers.items()})).encode())
        return h.hexdigest()

    def close(self) -> None:
        self.a.close()
        self.b.close()


def _b_call(address: str, stub_cls, method: str, request):
    """One raw RPC as tenant b; returns ``(status code, details, response or None)``."""
    with grpc.insecure_channel(address) as ch:
        rpc = getattr(stub_cls(ch), method)
        md = [("authorization", f"Bearer {TOKEN_B}")]
        try:
            if method == "WriteKV":
                resp = rpc(iter(request), timeout=30, metadata=md)
            elif method in ("ReadKV", "ReadPages"):
                resp = list(rpc(request, timeout=30, metadata=md))
            else:
                resp = rpc(request, timeout=30, metadata=md)
            return grpc.StatusCode.OK, "", resp
        except grpc.RpcError as e:
            return e.code(), e.details(), None


def test_every_rpc_across_tenants_is_not_found_or_harmless_and_changes_nothing(authd):
    s = Scene(authd.address)
    try:
        before = s.checksum()
        slots, lease = s.slots.tolist(), s.lease.lease_id
        header = pool_pb2.KVHeader(pool_id="alpha", slots=slots, latent_layers=[0])
        data = pool_pb2.WriteKVRequest(layer_id=0, component=pool_pb2.COMPONENT_LATENT, offset=0, data=bytes(len(slots) * 656))
        P, T, X = pool_pb2_grpc.PoolServiceStub, tier_pb2_grpc.TierServiceStub, transfer_pb2_grpc.TransferServiceStub
        b_pages = s.b.allocate_slots("beta", PS)
        not_found = {  # rpc -> (stub, request, the same request naming something absent)
            "DescribePool": (P, pool_pb2.DescribePoolRequest(pool_id="alpha"), pool_pb2.DescribePoolRequest(pool_id="nothere")),
            "DeletePool": (P, pool_pb2.DeletePoolRequest(pool_id="alpha", force=True), pool_pb2.DeletePoolRequest(pool_id="nothere", force=True)),
            "AllocateSlots": (P, pool_pb2.AllocateSlotsRequest(pool_id="alpha", num_tokens=64), pool_pb2.AllocateSlotsRequest(pool_id="nothere", num_tokens=64)),
            "FreeSlots": (P, pool_pb2.FreeSlotsRequest(pool_id="alpha", slots=slots), pool_pb2.FreeSlotsRequest(pool_id="nothere", slots=slots)),
            "WriteKV": (P, [pool_pb2.WriteKVRequest(header=header), data],
                        [pool_pb2.WriteKVRequest(header=pool_pb2.KVHeader(pool_id="nothere", slots=slots, latent_layers=[0])), data]),
            "ReadKV": (P, pool_pb2.ReadKVRequest(header=header), pool_pb2.ReadKVRequest(header=pool_pb2.KVHeader(pool_id="nothere", slots=slots, latent_layers=[0]))),
            "MoveKV": (P, pool_pb2.MoveKVRequest(pool_id="alpha", tgt_slots=slots[:1], src_slots=slots[1:2]),
                       pool_pb2.MoveKVRequest(pool_id="nothere", tgt_slots=slots[:1], src_slots=slots[1:2])),
            "Offload": (P, pool_pb2.OffloadRequest(pool_id="alpha", key="kb", slots=slots, free_slots=True),
                        pool_pb2.OffloadRequest(pool_id="nothere", key="kb", slots=slots, free_slots=True)),
            "Restore": (P, pool_pb2.RestoreRequest(pool_id="beta", key="ka"), pool_pb2.RestoreRequest(pool_id="beta", key="nokey")),
            "GetBufferInfos": (P, pool_pb2.BufferInfosRequest(pool_id="alpha"), pool_pb2.BufferInfosRequest(pool_id="nothere")),
            "LookupPrefix": (T, tier_pb2.LookupPrefixRequest(pool_id="alpha", page_keys=s.keys), tier_pb2.LookupPrefixRequest(pool_id="nothere", page_keys=s.keys)),
            "LoadPrefix": (T, tier_pb2.LoadPrefixRequest(pool_id="alpha", page_keys=s.keys), tier_pb2.LoadPrefixRequest(pool_id="nothere", page_keys=s.keys)),
            "StorePrefix": (T, tier_pb2.StorePrefixRequest(pool_id="beta", lease_id=lease, page_keys=s.keys[2:], slots=b_pages.tolist()),
                            tier_pb2.StorePrefixRequest(pool_id="beta", lease_id="0" * 32, page_keys=s.keys[2:], slots=b_pages.tolist())),
            "ReleasePrefix": (T, tier_pb2.ReleasePrefixRequest(pool_id="beta", lease_id=lease), tier_pb2.ReleasePrefixRequest(pool_id="beta", lease_id="0" * 32)),
            "WhereIs": (T, tier_pb2.WhereIsRequest(pool_id="alpha", page_keys=s.keys), tier_pb2.WhereIsRequest(pool_id="nothere", page_keys=s.keys)),
            "GetTierStats": (T, tier_pb2.TierStatsRequest(pool_id="alpha"), tier_pb2.TierStatsRequest(pool_id="nothere")),
            "GetTransferLayout": (X, transfer_pb2.TransferLayoutRequest(pool_id="alpha"), transfer_pb2.TransferLayoutRequest(pool_id="nothere")),
            "ReadPages": (X, transfer_pb2.ReadPagesRequest(pool_id="alpha", runs=[transfer_pb2.PageRun(layer_id=0, component=transfer_pb2.PAGE_COMPONENT_LATENT, first_page=1, num_pages=1)]),
                          transfer_pb2.ReadPagesRequest(pool_id="nothere", runs=[transfer_pb2.PageRun(layer_id=0, component=transfer_pb2.PAGE_COMPONENT_LATENT, first_page=1, num_pages=1)])),
            "PullKV": (X, transfer_pb2.PullKVRequest(pool_id="beta", peer_address=authd.address, peer_pool_id="alpha",
                                                     src_pages=[1], dst_pages=[int(b_pages[0]) // PS], transport=transfer_pb2.TRANSPORT_GRPC),
                       transfer_pb2.PullKVRequest(pool_id="beta", peer_address=authd.address, peer_pool_id="nothere",
                                                  src_pages=[1], dst_pages=[int(b_pages[0]) // PS], transport=transfer_pb2.TRANSPORT_GRPC)),
        }
        for method, (stub, req, absent) in not_found.items():
            code, details, _ = _b_call(authd.address, stub, method, req)
            code2, details2, _ = _b_call(authd.address, stub, method, absent)
            assert code == code2 == grpc.StatusCode.NOT_FOUND, (method, code, details, code2, details2)
            norm = details.replace("alpha", "X").replace("ka", "X").replace(lease, "X")
            assert norm == details2.replace("nothere", "X").replace("nokey", "X").replace("0" * 32, "X"), method
        # harmless: b's view holds nothing of a's
        assert [p.pool_id for p in _b_call(authd.address, P, "ListPools", pool_pb2.ListPoolsRequest())[2].pools] == ["beta"]
        stats = _b_call(authd.address, P, "GetStats", pool_pb2.StatsRequest())[2]
        assert stats.tenant == "team-b" and [p.pool_id for p in stats.pools] == ["beta"]
        assert "offloads" not in stats.counters and "kv_writes" not in stats.counters
        drop = _b_call(authd.address, P, "Drop", pool_pb2.DropRequest(key="ka"))[2]
        assert drop.dropped is False and drop.nbytes == 0
        assert s.b.lookup_prefix("beta", s.keys).tiers == [] and s.b.where_is("beta", s.keys) == [[]] * 3
        assert all(t["tenant_used_bytes"] == 0 for t in s.b.tier_stats().tiers.values())
        assert s.checksum() == before
        assert s.a.restore("alpha", "ka", drop=True).numel() == PS  # a's copy and lease still work
        assert s.a.store_prefix(s.lease, s.keys[2:], s.lease.slots[2 * PS:]) == 1
        s.a.release_prefix(s.lease)
    finally:
        s.close()


def test_lease_ids_are_128_bit_random_and_private(authd):
    with KVTierClient(authd.address, token=TOKEN_A, timeout=30) as a:
        a.create_pool("glm-5.2", num_layers=LAYERS, size_tokens=8 * PS, pool_id="leases")
        leases = [a.load_prefix("leases", page_keys(list(range(i * PS, (i + 1) * PS)), PS)) for i in range(6)]
        ids = [x.lease_id for x in leases]
        assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids) and len(set(ids)) == 6
        assert all(i not in repr(x) for i, x in zip(ids, leases))
        for x in leases:
            a.release_prefix(x)
        a.delete_pool("leases", force=True)


def test_pull_kv_forwards_the_callers_token_to_the_peer(authd):
    """Tenant a pulls its own pages (the daemon is its own peer): the peer sees a's token and serves a's pool."""
    with KVTierClient(authd.address, token=TOKEN_A, timeout=60) as a:
        a.create_pool("glm-5.2", num_layers=LAYERS, size_tokens=8 * PS, pool_id="src")
        a.create_pool("glm-5.2", num_layers=LAYERS, size_tokens=8 * PS, pool_id="dst")
        src, dst = a.allocate_slots("src", 2 * PS), a.allocate_slots("dst", 2 * PS)
        latent, index = kv(2 * PS, seed=7)
        a.write_kv("src", src, latent=latent, index=index)
        r = a.pull_kv("dst", authd.address, "src", src_slots=src, dst_slots=dst, transport="grpc")
        assert r.num_pages == 2
        got = a.read_kv("dst", dst)
        assert all(torch.equal(got.latent[x], latent[x]) for x in range(LAYERS))
        assert all(torch.equal(got.index_k[x], index[x][0]) for x in LIVE)
        for p in ("src", "dst"):
            a.delete_pool(p, force=True)


def test_no_token_reaches_the_log(authd):
    """With DEBUG logging, after refused and served calls of both tenants (and whatever ran before in
    this module), neither token is anywhere in the daemon's output."""
    with KVTierClient(authd.address, token=TOKEN_A + "x", timeout=10) as bad, pytest.raises(UnauthenticatedError):
        bad.stats()
    for token in (TOKEN_A, TOKEN_B):
        with KVTierClient(authd.address, token=token, timeout=10) as c:
            c.stats()
            with pytest.raises(Exception):
                c.describe_pool("nothere")
    text = authd.log_path.read_text(errors="replace")
    assert "UNAUTHENTICATED" in text and "NOT_FOUND" in text
    assert TOKEN_A not in text and TOKEN_B not in text and TOKEN_A[:12] not in text


def _serve(args, timeout=60):
    return subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("case", ["mode", "owner", "missing"])
def test_an_unsafe_tokens_file_stops_the_daemon_with_one_line(tmp_path, case):
    p = write_tokens(tmp_path / "tokens.toml", mode=0o644 if case == "mode" else 0o600)
    if case == "owner":
        os.chown(p, 65534, 65534)
    if case == "missing":
        p = tmp_path / "absent.toml"
    r = _serve(["--listen", f"unix://{tmp_path}/k.sock", "--auth-tokens", str(p)])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and "Traceback" not in r.stderr and TOKEN_A not in r.stderr
    assert len(lines) == 1 and "--auth-tokens" in lines[0], r.stderr
    assert {"mode": "chmod 600", "owner": "owned by uid 65534", "missing": "cannot open it"}[case] in lines[0]


def test_without_tokens_even_tls_may_not_listen_beyond_loopback(tmp_path):
    from pki import make_pki

    pki = make_pki(tmp_path)
    r = _serve(["--listen", "0.0.0.0:0", "--tls-cert", str(pki["server.pem"]), "--tls-key", str(pki["server.key"])])
    assert r.returncode != 0 and "refusing to listen on 0.0.0.0:0 without --auth-tokens" in r.stderr
    assert "Traceback" not in r.stderr
