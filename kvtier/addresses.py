"""Daemon addresses, shared by the daemon and the client (no server imports here).

An address is ``unix:///absolute/path``, ``HOST:PORT`` (``[::1]:PORT`` for IPv6) or a bare socket path
(``/run/kvtier/kv.sock``, ``./kv.sock``: anything with a ``/`` is a path, since no ``HOST:PORT`` has
one). With none given, both sides use :func:`default_socket_path`: ``$XDG_RUNTIME_DIR/kvtier/kvtier.sock``
if that variable is set, else ``/tmp/kvtier-<uid>/kvtier.sock``; the directory is private (mode 0700,
owned by the daemon's user, not a symlink: :func:`prepare_private_dir`).

Both sides also check the way to any unix socket (:func:`check_socket_path`): every directory on it
is owned by root or this process's uid and not writable by group or others unless sticky (``/tmp``),
and the socket is owned by root or this uid. Another local user could otherwise swap or squat the
socket and receive the clients' bearer tokens.

Before it binds, the daemon makes way at each of its socket paths with :func:`clear_stale_socket`:
only a socket of its own uid that nobody answers on (left by a daemon that is gone) is removed;
anything else there is refused in one line.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
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
    if int(port) > 65535:  # gRPC would take it modulo 65536 (99999 -> 34463) without a word
        raise ValueError(f"port must be 0-65535 (0: any free port), got {port} in {address!r}")
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
    missing: list[Path] = []
    q = p.parent
    while not os.path.lexists(q) and q != q.parent:
        missing.append(q)
        q = q.parent
    for d in reversed(missing):  # e.g. a missing $XDG_RUNTIME_DIR: 0700 whatever the umask, never 0777
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue  # made meanwhile by someone else: not ours to chmod (check_socket_path judges it)
        os.chmod(d, 0o700)  # mkdir's mode passes through the umask; chmod does not
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


class UnsafePathError(ValueError):
    """Another local user could swap what lies at a path: a directory on its way is owned by another
    uid or writable by group/others without the sticky bit, or the entry (or a symlink on the way) is
    owned by another uid."""


class UnsafeSocketError(UnsafePathError):
    """:class:`UnsafePathError` of a unix socket's path."""


_MAX_SYMLINKS = 40


def _trusted(uid: int) -> bool:
    return uid in (0, os.getuid())


def check_path_owners(path: str | Path, what: str = "unix socket", entry: str = "socket",
                      error: type[UnsafePathError] = UnsafeSocketError, *, entry_owner: bool = True,
                      private_dir: bool = False) -> bool:
    """Check the way to ``path`` before the daemon trusts what lies there (a socket it listens on or
    sends a token to, the disk tier's directory). Every directory a name is looked up in (symlinks
    followed, each checked) must be owned by root or this uid and not writable by group/others unless
    it has the sticky bit (in ``/tmp`` nobody can rename or remove another user's entry); each
    symlink followed and the entry itself must be owned by root or this uid.

    Args:
        path: the path to check.
        what: what the path is, for messages (``unix socket``, ``--disk-path``).
        entry: what the last name is (``socket``, ``directory``), for messages.
        error: the exception class to raise.
        entry_owner: check the owner of the entry itself (False: the caller checks it, stricter).
        private_dir: the directory holding the entry must not be writable by group or others even
            with the sticky bit (a socket: while none is there, or between a daemon's unlink and
            bind, another user could make one, and a client's reconnect would reach it; attack
            pass 6, A6-9 and A6-11).

    Returns:
        True when the path exists, False when a name on the way is missing (whoever could create it
        there passed the checks above).

    Raises:
        UnsafePathError: (``error``) the checks fail; the one-line message names the path and the reason.
    """
    given = os.path.abspath(str(path))
    todo = [c for c in given.split("/") if c]
    cur = "/"
    hops = 0
    place = "a socket" if entry == "socket" else f"a {what}"
    while todo:
        name = todo.pop(0)
        if name == ".":
            continue
        if name == "..":
            cur = os.path.dirname(cur)
            continue
        st = os.stat(cur)
        if not _trusted(st.st_uid):
            raise error(f"refusing {what} {given}: directory {cur} is owned by uid {st.st_uid}, "
                        f"not by root or this uid {os.getuid()}, so that user could swap the {entry}; use {place} in a "
                        f"directory you own")
        if private_dir and not todo and stat.S_IMODE(st.st_mode) & 0o022:
            raise error(f"refusing {what} {given}: directory {cur} (mode {stat.S_IMODE(st.st_mode):04o}) is writable "
                        f"by group or others, so another user could put {place} there while none is (sticky bit "
                        f"or not); `chmod go-w {cur}`, or use a directory only you or root can write")
        if stat.S_IMODE(st.st_mode) & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise error(f"refusing {what} {given}: directory {cur} (mode "
                        f"{stat.S_IMODE(st.st_mode):04o}) is writable by group or others without the "
                        f"sticky bit, so another user could swap the {entry}; `chmod go-w {cur}` or use "
                        f"another directory")
        nxt = os.path.join(cur, name)
        try:
            lst = os.lstat(nxt)
        except FileNotFoundError:
            return False
        if not _trusted(lst.st_uid) and (entry_owner or todo or stat.S_ISLNK(lst.st_mode)):
            kind = "symlink" if stat.S_ISLNK(lst.st_mode) else (entry if not todo else "directory")
            raise error(f"refusing {what} {given}: {kind} {nxt} is owned by uid {lst.st_uid}, "
                        f"not by root or this uid {os.getuid()} (another user's; remove it, or use "
                        f"{place} in a directory only you or root can write)")
        if stat.S_ISLNK(lst.st_mode):
            hops += 1
            if hops > _MAX_SYMLINKS:
                raise error(f"refusing {what} {given}: too many symlinks on the way")
            target = os.readlink(nxt)
            if target.startswith("/"):
                cur = "/"
            todo = [c for c in target.split("/") if c] + todo
            continue
        if todo and not stat.S_ISDIR(lst.st_mode):
            return False  # not a directory: nothing there (the caller's own open names the error)
        cur = nxt
    return True


def check_socket_path(path: str | Path) -> bool:
    """:func:`check_path_owners` of unix socket ``path``, in a directory only root or this uid may
    write (raises :class:`UnsafeSocketError`)."""
    return check_path_owners(path, private_dir=True)


class SocketPathInUseError(ValueError):
    """Something the daemon may not remove lies at a path it would listen on (the message says what and
    what to do)."""


_ELSEWHERE = "or pass --listen unix:///another/path.sock"


def _kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISLNK(mode):
        return "a symlink"
    return "not a socket"


def clear_stale_socket(path: str | Path, kind: int = socket.SOCK_STREAM) -> None:
    """Make way for a listening socket of type ``kind`` at ``path``: nothing there is fine; a socket of
    this uid that nobody answers on (a daemon that is gone left it) is removed. Anything else is left
    alone and refused: a file, a directory or a symlink; a socket of another uid (root's included); a
    socket somebody listens on, of any type (``connect`` answers it, or refuses the type: EPROTOTYPE).
    Run it after :func:`check_socket_path`, whose checks keep others from swapping the entry meanwhile.

    Raises:
        SocketPathInUseError: one line naming the path, what lies there and what to do.
    """
    p = str(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketPathInUseError(f"{p} is {_kind_of(st.st_mode)}, not a socket, and kvtier replaces only a stale "
                                   f"socket of its own: remove it if nothing needs it, {_ELSEWHERE}")
    if st.st_uid != os.getuid():
        raise SocketPathInUseError(f"{p} is a socket of uid {st.st_uid}, not of this daemon's uid {os.getuid()}: "
                                   f"leaving it alone; have its owner remove it, {_ELSEWHERE}")
    probe = socket.socket(socket.AF_UNIX, kind)
    try:
        probe.connect(p)
    except ConnectionRefusedError:  # a socket file nobody listens on: stale
        pass
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno == errno.EPROTOTYPE:
            raise SocketPathInUseError(f"{p} is in use by a running process (a socket of another type, such as "
                                       f"another daemon's attach socket): stop it, {_ELSEWHERE}") from None
        raise SocketPathInUseError(f"{p} could not be checked ({e.strerror}): remove it if it is stale, "
                                   f"{_ELSEWHERE}") from None
    else:
        raise SocketPathInUseError(f"{p} is in use by a running daemon (stop it, {_ELSEWHERE})")
    finally:
        probe.close()
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass
