"""Which peers a PullKV may name (the daemon connects with its own privileges: a confused deputy).

A daemon on a unix socket in a private directory (mode 0700) is reachable only by its own user; it
may run without tokens for that reason. A tenant of another daemon must not reach it by naming its
socket as a pull's peer: unix-socket peers other than the daemon's own address are refused before
anything is asked or moved. The peer channels a daemon keeps are bounded (least recently used closed).
"""

from __future__ import annotations

import grpc
import pytest
import torch

from kvtier.client import DaemonProcess, FailedPreconditionError, KVTierClient
from kvtier.server.daemon.tenants import Caller
from kvtier.server.service.transfer_peer import GrpcPeerConnector
from kvtier.v1 import transfer_pb2, transfer_pb2_grpc

LIVE = (0, 1, 2, 6)
PS = 64
TOKEN_B = "tenant-b-token-0123456789abcdef"


def _kv(n: int, value: int) -> tuple[dict, dict]:
    latent = {x: torch.full((n, 656), value, dtype=torch.uint8) for x in range(8)}
    index = {x: (torch.full((n, 128), value, dtype=torch.uint8), torch.full((n,), float(value))) for x in LIVE}
    return latent, index


def test_pull_from_another_daemons_unix_socket_is_refused_and_changes_nothing(tmp_path):
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_B}" = "b"\n')
    tokens.chmod(0o600)
    base = ["--device", "cpu", "--host-memory", "16MiB", "--pool-memory", "256MiB", "--log-level", "WARNING"]
    # private: a tokenless single-tenant daemon on a unix socket in its own 0700 directory
    with DaemonProcess(extra_args=[*base, "--pool", "glm-5.2:1024", "--pool-layers", "8"]) as private, \
            DaemonProcess(f"unix://{tmp_path}/shared.sock", extra_args=[*base, "--auth-tokens", str(tokens)]) as shared:
        assert private.address.startswith("unix://")
        with KVTierClient(private.address) as p:
            secret = p.allocate_slots("default", PS)
            latent, index = _kv(PS, 0x5A)
            p.write_kv("default", secret, latent=latent, index=index)
        with KVTierClient(shared.address, token=TOKEN_B, timeout=30) as b:
            b.create_pool("glm-5.2", num_layers=8, size_tokens=1024, pool_id="mine")
            dst = b.allocate_slots("mine", PS)
            latent, index = _kv(PS, 0x11)
            b.write_kv("mine", dst, latent=latent, index=index)
            with pytest.raises(FailedPreconditionError, match="unix socket and not this daemon's own address"):
                b.pull_kv("mine", private.address, "default", src_pages=[int(secret[0]) // PS],
                          dst_pages=[int(dst[0]) // PS], transport="grpc")
            kv = b.read_kv("mine", dst)  # still allocated (a failed move would have freed them), bytes unchanged
            for x in range(8):
                assert torch.equal(kv.latent[x], torch.full((PS, 656), 0x11, dtype=torch.uint8)), f"latent layer {x}"
            for x in LIVE:
                assert torch.equal(kv.index_k[x], torch.full((PS, 128), 0x11, dtype=torch.uint8)), f"index_k layer {x}"
        with KVTierClient(private.address) as p:  # the private daemon was never asked for its pages
            assert torch.equal(p.read_kv("default", secret).latent[0], torch.full((PS, 656), 0x5A, dtype=torch.uint8))


def _closed(channel: grpc.Channel) -> bool:
    """True if ``channel`` was closed (an RPC on it is refused at once); an open one to a port nothing
    listens on answers with an RpcError."""
    try:
        transfer_pb2_grpc.TransferServiceStub(channel).GetTransferLayout(transfer_pb2.TransferLayoutRequest(), timeout=5)
    except ValueError:
        return True
    except grpc.RpcError:
        return False
    raise AssertionError("nothing listens there: the call cannot succeed")


def test_peer_channels_are_bounded_and_the_evicted_are_closed_once_unused():
    connector = GrpcPeerConnector([], max_channels=2)
    caller = Caller("default")
    addresses = [f"127.0.0.1:{port}" for port in (1, 2, 3, 4)]  # nothing listens on ports 1-4
    with connector.connect(addresses[0], caller) as first:
        for a in addresses[1:3]:
            with connector.connect(a, caller) as link:
                second = link if a == addresses[1] else second
        assert connector.open_channels() == 2
        assert not _closed(first.channel)
    try:
        assert _closed(first.channel)  # evicted while in use: closed when its pull ended
        with connector.connect(addresses[3], caller):
            pass
        assert connector.open_channels() == 2
        assert _closed(second.channel)  # the least recently used one, not in use: closed at once
    finally:
        connector.close()


def test_pd_peers_lists_unix_sockets_only():
    from kvtier.server.daemon.config import DaemonConfig

    assert DaemonConfig(pd_peers="unix:///run/a.sock,/run/b.sock").pd_peers == ("unix:///run/a.sock", "unix:///run/b.sock")
    assert DaemonConfig.from_mapping({"pd_peers": ["unix:///run/a.sock"]}).pd_peers == ("unix:///run/a.sock",)
    with pytest.raises(ValueError, match="TCP peers need no listing"):
        DaemonConfig(pd_peers=("127.0.0.1:5000",))


def test_a_token_goes_to_no_plaintext_tcp_peer_loopback_included():
    """Attack pass 6, A6-1: PullKV sent the caller's token in plaintext to loopback TCP peers, and a
    loopback port has no owner: another uid that took the prefill daemon's port while it was down
    (or took over the peer channel's background reconnect) received it, and could answer with bytes
    of its choosing. A token now goes only to a unix-socket peer or over TLS."""
    connector = GrpcPeerConnector([])
    try:
        for address in ("127.0.0.1:5000", "localhost:5000"):
            with pytest.raises(Exception) as e:
                with connector.connect(address, Caller("b", TOKEN_B)):
                    pass
            assert type(e.value).__name__ == "FailedPrecondition"
            assert f"refusing to send the caller's token to peer {address} in plaintext" in str(e.value)
    finally:
        connector.close()


@pytest.mark.parametrize("mode, words", [(0o755, "socket {path} is owned by uid 65534"),
                                           (0o1777, "directory {dir} (mode 1777) is writable by group or others")])
def test_a_unix_peer_socket_of_another_user_gets_nothing(tmp_path, mode, words):
    """Attack pass 4, A4-14: a listed unix-socket peer (--pd-peers) whose path another uid took while
    the real peer was down got the caller's bearer token with every PullKV retry (and could have
    answered with bytes of its choosing). The daemon now makes the client's own socket check before
    it sends anything: the socket and the directories on its way owned by root or the daemon's uid.
    Attack pass 6, A6-9: in a sticky directory (accepted then) the peer channel's background
    reconnect reached a socket nobody made and unlinked again before the next check; the directory
    holding a peer's socket must now be writable by nobody else, sticky or not."""
    import os
    import socket

    where = tmp_path / "peers"
    where.mkdir()
    where.chmod(mode)
    path = where / "peer.sock"
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(str(path))
    squatter.listen(8)
    squatter.setblocking(False)
    os.lchown(path, 65534, 65534)  # tests run as root: the socket is now another user's
    connector = GrpcPeerConnector([])
    try:
        with pytest.raises(Exception) as e:
            with connector.connect(f"unix://{path}", Caller("b", TOKEN_B)):
                pass
        assert type(e.value).__name__ == "FailedPrecondition"
        assert words.format(path=path, dir=where) in str(e.value) and "nothing was sent to the peer" in str(e.value)
        with pytest.raises(BlockingIOError):
            squatter.accept()  # nobody connected
    finally:
        connector.close()
        squatter.close()
