"""Connection limits of the gRPC server: what a peer that connects and sends nothing may hold.

Authentication is per call, so a TCP client needs no token to open connections. Without limits a
local process could open connections that never send the HTTP/2 preface until the daemon ran out of
file descriptors, and then no client (health checks included) could connect (attack pass 3, N8).
Three gRPC server arguments bound it:

* ``grpc.server_handshake_timeout_ms``: a connection that has not finished its handshake (the HTTP/2
  preface and settings; TLS first where set) within ``request_arrival_seconds`` is closed, the same
  deadline a call's request message has (:mod:`kvtier.server.service.arrival`);
* ``grpc.max_allowed_incoming_connections``: at most :func:`connection_cap` connections at once, half
  of the process's file descriptors (its soft ``RLIMIT_NOFILE``, raised to the hard limit at start),
  so the disk tier, the attach channel, the metrics endpoint and the log always find descriptors;
  beyond it gRPC closes a new connection at once;
* ``grpc.max_connection_idle_ms``: a connection with no call for :data:`IDLE_SECONDS` gets GOAWAY
  (a gRPC client reconnects by itself on its next call).

What stays possible: a local process that keeps opening connections faster than the handshake
deadline closes them holds the cap, and new clients are refused meanwhile; the daemon itself keeps
running. A peer that finishes its handshake (server-only TLS needs no token for that) holds its
connection until the idle GOAWAY, and gRPC keeps no per-peer count, so enough of them fill the cap
(attack pass 6, A6-12): a TCP listener that untrusted peers reach needs mutual TLS
(``tls_client_ca``), under which a peer without a certificate is closed during the handshake.
"""

from __future__ import annotations

import logging
import resource

from kvtier.server.daemon.config import DaemonConfig

log = logging.getLogger("kvtier.service")

IDLE_SECONDS = 300.0
"""A connection without a call for this long is sent GOAWAY."""
MIN_CONNECTIONS = 16
"""The cap never goes below this, whatever the descriptor limit."""


def raise_fd_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (``serve`` does, once, at start).

    Returns:
        The soft limit now in force (unchanged where raising is not allowed).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.debug("could not raise the file descriptor limit from %d to %d: %s", soft, target, e)
    return soft


def connection_cap() -> int:
    """Most gRPC connections the daemon holds at once: half its soft ``RLIMIT_NOFILE``, at least
    :data:`MIN_CONNECTIONS`."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(MIN_CONNECTIONS, soft // 2)


def connection_options(config: DaemonConfig) -> list[tuple[str, int]]:
    """The gRPC server arguments above for ``config`` (handshake deadline: ``request_arrival_seconds``)."""
    return [("grpc.server_handshake_timeout_ms", max(1, round(config.request_arrival_seconds * 1000))),
            ("grpc.max_allowed_incoming_connections", connection_cap()),
            ("grpc.max_connection_idle_ms", round(IDLE_SECONDS * 1000))]
