"""Files the daemon trusts: secrets it reads from files only its own user may read (the
``--auth-tokens`` table, :class:`~kvtier.server.daemon.tenants.TokenTable`, and the
``--metrics-token-file`` bearer token), and its ``--config`` file, which no other user may write.

Secrets (:func:`read_private_file`): a regular file, not a symlink (opened with ``O_NOFOLLOW``),
owned by the daemon's uid, with no permission bit for group or others (0600 or 0400). Anyone who can
read such a file can act with its tokens, so a file that fails the check is refused at start with one
line saying what to fix; the line never holds the file's contents. Settings
(:func:`read_trusted_file`): owned by root or the daemon's uid, not writable by group or others, on
a way no other user controls.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from kvtier.addresses import UnsafePathError, check_path_owners


class AuthConfigError(ValueError):
    """A secret file cannot be used (permissions, owner, format); the message is one line."""


def read_private_file(path: str | Path, flag: str) -> bytes:
    """The bytes of ``path`` once it passed the module's check (``flag`` names the option in errors).

    Raises:
        AuthConfigError: a one-line reason (missing, a symlink, not a regular file, owner, mode).
    """
    try:
        # O_NONBLOCK: a FIFO at the path must not hang the start waiting for a writer (it is refused below)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    except OSError as e:
        raise AuthConfigError(f"{flag} {path}: cannot open it ({e.strerror}); it must be a regular "
                              f"file, not a symlink") from None
    return _read_checked(fd, path, flag, owners=(os.getuid(),), bad_bits=0o077,
                         owner_fix="chown it to that user", mode_fix=f"lets other users read it; run chmod 600 {path}")


def read_trusted_file(path: str | Path, flag: str) -> bytes:
    """The bytes of a settings file (``--config``) no other user could have written: a regular file
    owned by root or the daemon's uid, with no write bit for group or others, on a way
    (:func:`kvtier.addresses.check_path_owners`) no other user could redirect. Others may read it (it
    names files, it holds no secret). A config file another user can write decides the token file,
    the attach uids, the disk path and what the metrics endpoint shows: it is refused at start
    (attack pass 4, A4-5).

    Raises:
        AuthConfigError: a one-line reason (missing, not a regular file, owner, mode, the way to it).
    """
    try:
        check_path_owners(path, flag, "file", UnsafePathError)
    except UnsafePathError as e:
        raise AuthConfigError(str(e)) from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise AuthConfigError(f"{flag} {path}: cannot open it ({e.strerror})") from None
    return _read_checked(fd, path, flag, owners=(0, os.getuid()), bad_bits=0o022,
                         owner_fix="so that user decides the daemon's settings; chown it",
                         mode_fix=f"lets other users change the daemon's settings; run chmod go-w {path}")


def _read_checked(fd: int, path: str | Path, flag: str, *, owners: tuple[int, ...], bad_bits: int, owner_fix: str,
                  mode_fix: str) -> bytes:
    """The bytes behind ``fd`` once the file it opened passed the checks: a regular file, owned by one
    of ``owners``, with none of ``bad_bits`` in its mode (``fd`` is closed either way)."""
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise AuthConfigError(f"{flag} {path}: not a regular file")
        if st.st_uid not in owners:
            who = "by the daemon's user" if owners == (os.getuid(),) else "by root or the daemon's user"
            raise AuthConfigError(f"{flag} {path}: owned by uid {st.st_uid}, not {who} (uid {os.getuid()}); {owner_fix}")
        mode = stat.S_IMODE(st.st_mode)
        if mode & bad_bits:
            raise AuthConfigError(f"{flag} {path}: mode {mode:04o} {mode_fix}")
        return f.read()


def read_tls_files(config: Any) -> dict[str, bytes]:
    """The TLS files of a daemon config, each checked before it is trusted (attack pass 4/5, A5-2: a
    ``--tls-client-ca`` in another user's directory let that user swap in its own CA and call the
    daemon): ``--tls-key`` as a secret (:func:`read_private_file`), ``--tls-cert``,
    ``--tls-client-ca`` and ``--peer-tls-ca`` as settings (:func:`read_trusted_file`). Returns the
    bytes by config field name (the fields that are set).

    Raises:
        AuthConfigError: one line naming the flag, the file and what to fix.
    """
    out: dict[str, bytes] = {}
    for field, flag in (("tls_cert", "--tls-cert"), ("tls_client_ca", "--tls-client-ca"), ("peer_tls_ca", "--peer-tls-ca")):
        if getattr(config, field):
            out[field] = read_trusted_file(getattr(config, field), flag)
    if config.tls_key:
        out["tls_key"] = read_private_file(config.tls_key, "--tls-key")
    return out


def read_token_file(path: str | Path, flag: str, min_chars: int) -> str:
    """One bearer token from ``path`` (checked by :func:`read_private_file`): the file's text with
    surrounding whitespace removed, as Prometheus reads ``authorization: credentials_file:``.

    Raises:
        AuthConfigError: the file's check failed, or the token is shorter than ``min_chars`` or holds
            anything but visible ASCII (an HTTP header value without spaces).
    """
    raw = read_private_file(path, flag).strip()
    if not raw:
        raise AuthConfigError(f"{flag} {path}: the file is empty; write one long random token into it "
                              f"(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    if not all(0x21 <= b <= 0x7E for b in raw):
        raise AuthConfigError(f"{flag} {path}: the token must be one word of visible ASCII characters "
                              f"(no spaces or line breaks inside)")
    if len(raw) < min_chars:
        raise AuthConfigError(f"{flag} {path}: the token is shorter than {min_chars} characters; use a long random "
                              f"secret (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return raw.decode("ascii")
