"""Daemon addresses, shared by the daemon and the client (no server imports here).

An address is ``unix:///absolute/path`` or ``HOST:PORT`` (``[::1]:PORT`` for IPv6). With none
given, both sides use :func:`default_socket_path`: ``$XDG_RUNTIME_DIR/kvtier/kvtier.sock`` if that
variable is set, else ``/tmp/kvtier-<uid>/kvtier.sock``; the directory is private (mode 0700).
"""

from __future__ import annotations

import ipaddress
import os
import tempfile
from pathlib import Path



def default_socket_path() -> Path:
    """Where the daemon listens and the client connects when no address is given."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "kvtier" if runtime else Path(tempfile.gettempdir()) / f"kvtier-{os.getuid()}"
    return base / "kvtier.sock"


def default_address() -> str:
    """``unix://`` + :func:`default_socket_path`."""
    return f"unix://{default_socket_path()}"


def resolve_address(address: str | None) -> str:
    """``None``/``""`` -> :func:`default_address`; ``unix:/p``/``unix:///p`` kept; ``HOST:PORT`` kept.

    Raises:
        ValueError: neither a unix address nor ``HOST:PORT`` with a numeric port.
    """
    if not address:
        return default_address()
    if address.startswith("unix:"):
        path = socket_path(address)
        if not path:
            raise ValueError(f"unix address without a path: {address!r}")
        return f"unix://{path}" if path.startswith("/") else f"unix:{path}"
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address must be unix:///path or HOST:PORT, got {address!r}")
    return address


def socket_path(address: str) -> str:
    """The filesystem path of a ``unix:`` address (``unix:///a/b`` -> ``/a/b``, ``unix:a`` -> ``a``)."""
    rest = address[len("unix:"):]
    if rest.startswith("//"):
        rest = rest[2:]
    return rest


def is_unix(address: str) -> bool:
    """True for a ``unix:`` address."""
    return address.startswith("unix:")


def tcp_host(address: str) -> str:
    """The host part of ``HOST:PORT`` (brackets of an IPv6 host kept)."""
    return address.rpartition(":")[0]


def is_loopback(address: str) -> bool:
    """True for unix sockets and TCP addresses on a loopback host (127.0.0.0/8, ::1, ``localhost``)."""
    if is_unix(address):
        return True
    host = tcp_host(address).strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
