"""The metrics endpoint against a slowloris: connections beyond the cap are closed at once (no thread),
those within it are closed when their request is not in after the deadline, and an authorized scrape
is served afterwards while the attacker's sockets are still open."""

from __future__ import annotations

import select
import socket
import threading
import time
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry

from kvtier.server.observe import metrics as m

TOKEN = "s3cret-token-0123456789"
CAP = 8
ATTACKERS = CAP + 12
DEADLINE = 1.5


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (EOF or reset); never blocks."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(4096) == b""
    except (ConnectionError, OSError):
        return True


def _scrape(url: str, token: str | None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def test_slowloris_is_capped_and_cut_off_at_the_deadline(monkeypatch):
    monkeypatch.setattr(m._QuietHandler, "request_deadline", DEADLINE, raising=False)
    registry = CollectorRegistry()
    m.RpcMetrics(registry).observe(0.01, method="Ping", code="OK", tenant="t")
    endpoint = m.MetricsEndpoint(registry, token=TOKEN)
    url = endpoint.start()
    port = endpoint._server.server_port
    baseline = threading.active_count()
    socks: list[socket.socket] = []
    try:
        for _ in range(ATTACKERS):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"G")
            socks.append(s)
        open_ = set(range(ATTACKERS))
        start = time.monotonic()
        peak = 0
        # trickle one byte to each every 0.2 s, well within the idle timeout, past the deadline
        while time.monotonic() - start < DEADLINE + 2.0 and open_:
            peak = max(peak, threading.active_count() - baseline)
            for i in list(open_):
                if _closed_by_peer(socks[i]):
                    open_.discard(i)
                    continue
                try:
                    socks[i].sendall(b"E")
                except OSError:
                    open_.discard(i)
            if time.monotonic() - start < DEADLINE - 0.5:
                # before the deadline: at most CAP handler threads, the rest refused already
                assert threading.active_count() - baseline <= CAP
            time.sleep(0.2)
        assert peak <= CAP, f"{peak} handler threads for {ATTACKERS} trickling connections"
        assert not open_, f"{len(open_)} trickling connections still open after the deadline"
        assert endpoint._server.refused_connections > 0  # (some wait in the listen backlog and get a slot later)
        # the attacker's sockets are still open on its side; scrapes are served
        status, body = _scrape(url, TOKEN)
        assert status == 200 and b"kvtier_rpc_duration_seconds" in body
        assert _scrape(url, None)[0] == 401
        assert _scrape(url, "wrong-token-0123456789")[0] == 401
        deadline = time.monotonic() + 5
        while endpoint._server.active_connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert endpoint._server.active_connections == 0
        assert threading.active_count() <= baseline
    finally:
        for s in socks:
            s.close()
        endpoint.stop()


def test_a_request_sent_in_pieces_within_the_deadline_is_served():
    registry = CollectorRegistry()
    endpoint = m.MetricsEndpoint(registry, token=TOKEN)
    endpoint.start()
    try:
        request = (f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", endpoint._server.server_port), timeout=5) as s:
            for i in range(0, len(request), 16):
                s.sendall(request[i:i + 16])
                time.sleep(0.05)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.0 200") or data.startswith(b"HTTP/1.1 200")
    finally:
        endpoint.stop()
