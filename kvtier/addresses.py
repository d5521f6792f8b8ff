"""Daemon addresses, shared by the daemon and the client (no server imports here).

An address is ``unix:///absolute/path``, ``HOST:PORT`` (``[::1]:PORT`` for IPv6) or a bare socket path
(``/run/kvtier/kv.sock``, ``./kv.sock``: anything with a ``/`` is a path, since no ``HOST:PORT`` has
one). With none given, both sides use :func:`default_socket_path`: ``$XDG_RUNTIME_DIR/kvtier/kvtier.sock``
if that variable is set, else ``/tmp/kvtier-<uid>/kvtier.sock``; the directory is private (mode 0700,
owned by the daemon's user, not a symlink: :func:`prepare_private_dir`).
"""

from __future__ import annotations

import ipaddress
import os
import stat
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
    """``None``/``""`` -> :func:`default_address`; ``unix:/p``/``unix:///p`` kept; ``HOST:PORT`` kept;
    a bare path (``/run/kvtier/kv.sock``, ``./kv.sock``, ``~/kv.sock``) -> ``unix://`` + its absolute path.

    Raises:
        ValueError: neither a unix address, a path, nor ``HOST:PORT`` with a numeric port (another
            scheme such as ``dns:///`` is refused, not taken for a relative path).
    """
    if not address:
        return default_address()
    scheme, sep, _ = address.partition("://")
    if sep and scheme != "unix":
        raise ValueError(f"address scheme {scheme!r} is not supported: use unix:///path, a socket path or HOST:PORT, "
                         f"got {address[:200]!r}")
    if not address.startswith("unix:") and ("/" in address or address.startswith("~")):
        return f"unix://{os.path.abspath(os.path.expanduser(address))}"
    if address.startswith("unix:"):
        path = socket_path(address)
        if not path:
            raise ValueError(f"unix address without a path: {address!r}")
        return f"unix://{path}" if path.startswith("/") else f"unix:{path}"
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address must be unix:///path, a socket path such as ./kvtier.sock, or HOST:PORT, "
                         f"got {address!r}")
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


class UnsafeSocketDirError(ValueError):
    """The socket's directory is not private: owned by another user, a symlink, or not a directory."""


def prepare_private_dir(path: str | Path) -> Path:
    """Create ``path`` (mode 0700) or check an existing one: a real directory (not a symlink), owned by
    this process's uid, mode 0700 afterwards (a looser mode on our own directory is tightened).

    A directory another user made (e.g. ``/tmp/kvtier-<uid>`` created in advance by someone else) or a
    symlink (which could point anywhere) is refused, never chmod'ed: whoever owns it could swap the
    socket under us.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        UnsafeSocketDirError: the checks above fail (the message says which and what to do).
        OSError: the directory cannot be created (e.g. its parent is missing or read-only).
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(p, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeSocketDirError(f"socket directory {p} is a symlink; refusing it (remove it, or pass "
                                   f"--listen unix:///path in a directory you own)")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSocketDirError(f"socket directory {p} is not a directory; remove it or pass --listen")
    if st.st_uid != os.getuid():
        raise UnsafeSocketDirError(f"socket directory {p} is owned by uid {st.st_uid}, not by this daemon's uid "
                                   f"{os.getuid()}; refusing it (remove it, or pass --listen unix:///path in a "
                                   f"directory you own)")
    if stat.S_IMODE(st.st_mode) != 0o700:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, 0o700)  # through the descriptor we checked: a swapped path cannot redirect it
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
            raise UnsafeSocketDirError(f"socket directory {p} changed while it was checked; refusing it")
    return p
