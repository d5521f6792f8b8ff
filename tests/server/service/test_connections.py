"""Connections that send nothing (attack pass 3, N8): a process without a token opened TCP
connections that never sent the HTTP/2 preface until the daemon ran out of file descriptors; no
client, health checks included, could connect for as long as they stayed open (gRPC's default
handshake deadline is 120 s, and the listener then retried accept once a second, forever).

Now a connection that has not finished its handshake within ``--request-arrival-seconds`` is closed,
and connections hold at most half the daemon's descriptors (``server/service/connections.py``).
The daemon runs under a hard limit of 256 descriptors so the cap is 128.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvtier.client import KVTierClient

FD_LIMIT = 256
IDLE_CONNECTIONS = 300  # more than the daemon has descriptors
ARRIVAL_S = 1.0


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _start_daemon(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, str, Path]:
    """A TCP daemon under the 256-descriptor limit (``args`` added to its flags); returns it, its
    address once ready, and its log."""
    ready, log = tmp_path / "ready", tmp_path / "daemon.log"
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", "--listen", "127.0.0.1:0", "--allow-unauthenticated",
           "--device", "cpu", "--pool", "glm-5.2:64", "--pool-layers", "2", "--log-level", "WARNING",
           *args, "--ready-file", str(ready)]
    with open(log, "wb") as out:
        daemon = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_limit_fds)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            daemon.kill()
            raise AssertionError(log.read_text())
        time.sleep(0.05)
    return daemon, ready.read_text().strip(), log


def _closed_by_peer(s: socket.socket) -> bool:
    """Read what the daemon sent (its SETTINGS, then GOAWAY: about 100 bytes; read a byte a poll, they
    took 24 s to drain here) and say whether it has closed the connection."""
    s.setblocking(False)
    try:
        while s.recv(65536):
            pass
        return True  # b"": closed
    except BlockingIOError:
        return False
    except OSError:  # reset: closed too
        return True


def test_connections_that_send_nothing_are_capped_and_closed_and_health_answers_again(tmp_path: Path):
    daemon, address, _ = _start_daemon(tmp_path, "--request-arrival-seconds", str(ARRIVAL_S))
    socks: list[socket.socket] = []
    try:
        host, port = address.rsplit(":", 1)
        for _ in range(IDLE_CONNECTIONS):
            socks.append(socket.create_connection((host, int(port)), timeout=5))
        # the daemon never holds more than half its descriptors as connections (128 of 256), so it
        # always has descriptors left for its disk tier, attach channel and log
        assert _open_fds(daemon.pid) <= FD_LIMIT // 2 + 64
        # every connection that sent nothing is closed by the daemon within a few seconds (1 s
        # handshake deadline; gRPC's default was 120 s), then a client connects and the health check answers
        closed = [False] * len(socks)
        until = time.monotonic() + 20
        while not all(closed) and time.monotonic() < until:
            for i, s in enumerate(socks):
                if closed[i]:
                    continue
                closed[i] = _closed_by_peer(s)
            time.sleep(0.2)
        assert sum(closed) == len(socks), f"{len(socks) - sum(closed)} idle connections still open after 20 s"
        with KVTierClient(address, timeout=10) as c:
            assert c.health() == "SERVING"
            assert [p.size_tokens for p in c.list_pools()] == [64]
        assert daemon.poll() is None
    finally:
        for s in socks:
            s.close()
        daemon.terminate()
        daemon.wait(30)


def _hold_tls_connections(host: str, port: int, n: int, *, cert: tuple[str, str] | None) -> list[socket.socket]:
    """Open ``n`` TLS connections that finish their handshake (ALPN h2) and send the HTTP/2 preface,
    then nothing; the ones the daemon did not close at once are returned, still open."""
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    if cert:
        ctx.load_cert_chain(*cert)
    held = []
    for _ in range(n):
        raw = socket.create_connection((host, port), timeout=5)
        try:
            s = ctx.wrap_socket(raw)
            # HTTP/2 client preface and an empty SETTINGS frame: the handshake as gRPC counts it
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            s.settimeout(0.5)
            try:
                if s.recv(1) == b"":  # the server's SETTINGS, or its close
                    s.close()
                    continue
            except (ssl.SSLError, OSError):  # a TLS alert, a reset or nothing yet
                pass
            held.append(s)
        except (ssl.SSLError, OSError):
            raw.close()
    return held


def _still_open(socks: list[socket.socket]) -> int:
    n = 0
    for s in socks:
        s.setblocking(False)
        try:
            while s.recv(65536):
                pass
            continue  # b"": closed
        except (BlockingIOError, __import__("ssl").SSLWantReadError):
            n += 1
        except OSError:
            pass
    return n


def test_with_mutual_tls_a_peer_without_a_certificate_cannot_hold_connections(tmp_path: Path):
    """Attack pass 6, A6-12: anyone who reaches a TCP port may finish a server-only TLS handshake and
    the HTTP/2 settings with no token, then hold the connection idle; enough of them fill the
    connection cap and legitimate clients are refused. gRPC exposes no per-peer accounting of
    connections, so the documented remedy for a listener that untrusted peers reach is mutual TLS
    (``--tls-client-ca``): a peer without a certificate the CA signed is closed during the handshake,
    and holds nothing. 300 such connections (the cap is 128), then a client with a certificate is
    served at once, while they are still open on the attacker's side."""
    from pki import make_pki

    pki = make_pki(tmp_path)
    daemon, address, _ = _start_daemon(tmp_path, "--tls-cert", str(pki["server.pem"]), "--tls-key", str(pki["server.key"]),
                                       "--tls-client-ca", str(pki["ca.pem"]))
    socks: list[socket.socket] = []
    try:
        host, port = address.rsplit(":", 1)
        # the check is real: a client with the CA's certificate holds its connection
        own = _hold_tls_connections(host, int(port), 1, cert=(str(pki["client.pem"]), str(pki["client.key"])))
        assert _still_open(own) == 1
        socks = _hold_tls_connections(host, int(port), IDLE_CONNECTIONS, cert=None)
        time.sleep(0.5)
        assert _still_open(socks) == 0
        assert _open_fds(daemon.pid) < 64
        with KVTierClient(address, timeout=10, retries=0, tls_root_cert=str(pki["ca.pem"]),
                          tls_client_cert=pki["client.pem"], tls_client_key=pki["client.key"]) as c:
            assert c.health() == "SERVING"
            assert [p.size_tokens for p in c.list_pools()] == [64]
        for s in own:
            s.close()
    finally:
        for s in socks:
            s.close()
        daemon.terminate()
        daemon.wait(30)
