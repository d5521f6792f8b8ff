"""One tenant cannot take the data path from the others: KV streams and PullKVs that ask a peer hold
at most the tenant's share of the ``--max-streams`` slots (attack pass 2, F5 and F6).

Regressions, against a real daemon with two tenants, ``--workers 8`` and ``--max-streams 4`` (a share
of 2 each, the default half):

* F5: tenant A held every stream slot with WriteKV or PutUnits streams trickling the minimum 4 KiB
  just inside ``--stream-idle-seconds``, and tenant B's WriteKV and ReadKV were refused for as long
  as A liked;
* F6: tenant A's PullKVs naming a gRPC peer it ran, whose ``GetTransferLayout`` never answers, each
  held a worker for up to 30 s; re-issued, they held every worker and B's AllocateSlots and
  LoadPrefix ran out of their deadlines.

Structural, not timed: A's streams are ReadPages confirmed running by their first message (40 MB,
beyond gRPC's flow-control window, then not read; the idle bound is 600 s), A's pulls are confirmed
waiting by the stalling peer, which counts each layout request it holds. Then A's next stream or
pull of any kind is refused RESOURCE_EXHAUSTED marked "changed nothing" (the client retries it), and
B's calls, made without retries, are served: B's own share is free. Before the fix A's third stream
ran and B's calls were refused (F5), and A's third pull waited for the peer too (F6).
"""

from __future__ import annotations

import os
import threading
from concurrent import futures

import grpc
import pytest
import torch

from kvtier.client import KVTierClient, ResourceExhaustedError
from kvtier.client.spawn import DaemonProcess
from kvtier.v1 import pool_pb2, pool_pb2_grpc, storage_pb2, storage_pb2_grpc, transfer_pb2, transfer_pb2_grpc

TOKEN_A = "tenant-a-slots-0123456789abcdef"
TOKEN_B = "tenant-b-slots-0123456789abcdef"
PS = 64
SHARE = 2  # of --max-streams 4, with two tenants
ARGS = ["--device", "cpu", "--workers", "8", "--max-streams", "4", "--stream-idle-seconds", "600",
        "--host-memory", "16MiB", "--log-level", "INFO"]
RETRY = ("kvtier-retry", "unchanged")
HANG_GUARD_S = 120  # only ends a run that already failed


def _auth(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slots")
    tokens = tmp / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = "team-a"\n"{TOKEN_B}" = "team-b"\n')
    os.chmod(tokens, 0o600)
    # the stalling peer's unix socket, listed (a token goes to no plaintext TCP peer: attack pass 6, A6-1)
    dp_peer = tmp / "peer.sock"
    with DaemonProcess(extra_args=[*ARGS, "--auth-tokens", str(tokens), "--pd-peers", f"unix://{dp_peer}"]) as dp:
        dp.peer_socket = dp_peer
        with KVTierClient(dp.address, token=TOKEN_A, timeout=60) as a, KVTierClient(dp.address, token=TOKEN_B, timeout=60) as b:
            a.create_pool("glm-5.2", num_layers=8, size_tokens=8192, pool_id="pa")
            a.allocate_slots("pa", 120 * PS)  # pages 1..120: what A's stalled streams read
            b.create_pool("glm-5.2", num_layers=8, size_tokens=8192, pool_id="pb")
            b.allocate_slots("pb", 120 * PS)
        yield dp


class StalledReads:
    """``n`` ReadPages streams of ``token``'s pool, each running (its first message received), then
    not read: each holds a stream slot and a worker until closed."""

    def __init__(self, address: str, token: str, pool_id: str, n: int) -> None:
        runs = [transfer_pb2.PageRun(layer_id=x, component=transfer_pb2.PAGE_COMPONENT_LATENT, first_page=1,
                                     num_pages=120) for x in range(8)]
        self.channels, self.calls = [], []
        try:
            for _ in range(n):
                ch = grpc.insecure_channel(address)
                self.channels.append(ch)
                call = transfer_pb2_grpc.TransferServiceStub(ch).ReadPages(
                    transfer_pb2.ReadPagesRequest(pool_id=pool_id, runs=runs), metadata=_auth(token), timeout=300)
                self.calls.append(call)
                next(call)  # it holds its slot now
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        for ch in self.channels:
            ch.close()

    def __enter__(self) -> StalledReads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def verify_refused_for_the_share(e: grpc.RpcError, tenant: str) -> None:
    """RESOURCE_EXHAUSTED naming the tenant's share, marked "changed nothing" (a client retries it)."""
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
    assert f"tenant {tenant!r} holds {SHARE} KV streams, its share" in e.details(), e.details()
    assert RETRY in tuple(e.trailing_metadata() or ()), e.trailing_metadata()


def verify_tenant_served(address: str, token: str, pool_id: str, seed: int, retries: int = 0) -> None:
    """WriteKV, ReadKV and AllocateSlots of ``token``'s tenant are served (without a retry: ``retries=0``;
    a stream slot still being given back by a cancelled stream is waited for with ``retries``)."""
    with KVTierClient(address, token=token, timeout=60, retries=retries) as c:
        slots = c.allocate_slots(pool_id, PS)
        latent = {x: torch.randint(0, 256, (PS, 656), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
                  for x in range(8)}
        c.write_kv(pool_id, slots, latent=latent)
        kv = c.read_kv(pool_id, slots, index_layers=[])
        assert all(torch.equal(kv.latent[x], latent[x]) for x in range(8))
        c.free_slots(pool_id, slots)


def test_a_tenant_holding_its_share_of_streams_leaves_the_rest_to_others(d):
    """F5: A holds its 2 slots; A's next ReadPages, WriteKV and PutUnits are refused for its share
    (before reading anything), while B writes and reads without a retry, and B may hold its own 2."""
    with StalledReads(d.address, TOKEN_A, "pa", SHARE):
        ch = grpc.insecure_channel(d.address)
        try:
            with pytest.raises(grpc.RpcError) as info:
                next(transfer_pb2_grpc.TransferServiceStub(ch).ReadPages(transfer_pb2.ReadPagesRequest(
                    pool_id="pa", runs=[transfer_pb2.PageRun(layer_id=0, component=transfer_pb2.PAGE_COMPONENT_LATENT,
                                                     first_page=1, num_pages=1)]),
                    metadata=_auth(TOKEN_A), timeout=60))
            verify_refused_for_the_share(info.value, "team-a")
            header = pool_pb2.WriteKVRequest(header=pool_pb2.KVHeader(pool_id="pa", slots=[0], latent_layers=[0]))
            with pytest.raises(grpc.RpcError) as info:
                pool_pb2_grpc.PoolServiceStub(ch).WriteKV(iter([header]), metadata=_auth(TOKEN_A), timeout=60)
            verify_refused_for_the_share(info.value, "team-a")
            with pytest.raises(grpc.RpcError) as info:
                storage_pb2_grpc.StorageServiceStub(ch).PutUnits(iter([storage_pb2.PutUnitsRequest()]),
                                                                 metadata=_auth(TOKEN_A), timeout=60)
            verify_refused_for_the_share(info.value, "team-a")
        finally:
            ch.close()
        verify_tenant_served(d.address, TOKEN_B, "pb", seed=1)
        with StalledReads(d.address, TOKEN_B, "pb", SHARE):  # B's whole share was free
            pass
    verify_tenant_served(d.address, TOKEN_A, "pa", seed=2, retries=3)  # A's slots come back


class StallingPeer:
    """A gRPC "peer" on unix socket ``path`` whose GetTransferLayout never answers until
    :meth:`release`; it counts the layout requests it holds."""

    def __init__(self, path) -> None:
        self.held = 0
        self.cond = threading.Condition()
        self.released = threading.Event()
        peer = self

        class Stall(transfer_pb2_grpc.TransferServiceServicer):
            def GetTransferLayout(self, request, context):
                with peer.cond:
                    peer.held += 1
                    peer.cond.notify_all()
                peer.released.wait(HANG_GUARD_S)
                context.abort(grpc.StatusCode.NOT_FOUND, "the stalling peer lets go")

        self.server = grpc.server(futures.ThreadPoolExecutor(16))
        transfer_pb2_grpc.add_TransferServiceServicer_to_server(Stall(), self.server)
        path.unlink(missing_ok=True)
        self.address = f"unix://{path}"
        self.server.add_insecure_port(self.address)
        self.server.start()

    def wait_held(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.held >= n, HANG_GUARD_S), f"the peer holds {self.held} of {n} pulls"

    def release(self) -> None:
        self.released.set()
        self.server.stop(0)


def _pull(address: str, token: str, pool_id: str, peer: str, slots, timeout: float = HANG_GUARD_S, retries: int = 3):
    """A PullKV of ``slots`` from ``peer``; ``retries=3``: a refusal that changed nothing (a slot still
    being given back by an earlier test's stream) is sent again; 0: never."""
    with KVTierClient(address, token=token, timeout=timeout, retries=retries) as c:
        return c.pull_kv(pool_id, peer, "x", src_slots=slots, dst_slots=slots, transport="grpc")


def test_pulls_to_a_peer_that_never_answers_hold_only_the_tenants_share(d):
    """F6: A's 2 pulls wait on the stalling peer (it holds both); A's third is refused for its share
    at once, before asking the peer, and marked "changed nothing"; B's AllocateSlots and LoadPrefix
    are served without a retry, and B's own pull, without a retry, gets a slot (the peer holds it too)."""
    peer = StallingPeer(d.peer_socket)
    with KVTierClient(d.address, token=TOKEN_A, timeout=60) as a:
        slots = a.allocate_slots("pa", PS)
    ends: list[BaseException | object] = []
    threads = [threading.Thread(target=lambda: ends.append(_catch(_pull, d.address, TOKEN_A, "pa", peer.address, slots)),
                                daemon=True) for _ in range(SHARE)]
    try:
        for t in threads:
            t.start()
        peer.wait_held(SHARE)
        with pytest.raises(ResourceExhaustedError) as info:
            _pull(d.address, TOKEN_A, "pa", peer.address, slots, timeout=30, retries=0)
        assert info.value.unchanged and "tenant 'team-a' holds 2 KV streams, its share" in info.value.details
        assert peer.held == SHARE  # the refused pull never reached the peer
        with KVTierClient(d.address, token=TOKEN_B, timeout=60, retries=0) as b:
            got = b.allocate_slots("pb", PS)
            lease = b.load_prefix("pb", [b"k" * 16])
            b.release_prefix(lease)
            b.free_slots("pb", got)
            mine = b.allocate_slots("pb", PS)
        threads.append(threading.Thread(target=lambda: ends.append(_catch(_pull, d.address, TOKEN_B, "pb", peer.address,
                                                                          mine, HANG_GUARD_S, 0)), daemon=True))
        threads[-1].start()
        peer.wait_held(SHARE + 1)  # B's pull reached the peer: it had a slot
    finally:
        peer.release()
        for t in threads:
            t.join(HANG_GUARD_S)
    assert len(ends) == SHARE + 1 and all(isinstance(e, Exception) for e in ends), ends  # the peer never answered
    verify_tenant_served(d.address, TOKEN_A, "pa", seed=3, retries=3)  # the pulls' slots came back


def _catch(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return e
