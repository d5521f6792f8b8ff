"""Daemon addresses: defaults, forms, loopback rule."""

from __future__ import annotations

import os

import pytest

from kvtier.addresses import default_socket_path, is_loopback, resolve_address, socket_path


def test_default_socket_path(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_socket_path() == tmp_path / "kvtier" / "kvtier.sock"
    assert resolve_address(None) == f"unix://{tmp_path}/kvtier/kvtier.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket_path().name == "kvtier.sock" and default_socket_path().parent.name.startswith("kvtier-")


def test_forms():
    assert resolve_address("unix:///a/b.sock") == "unix:///a/b.sock"
    assert socket_path("unix:///a/b.sock") == "/a/b.sock"
    assert resolve_address("127.0.0.1:0") == "127.0.0.1:0"
    assert resolve_address("[::1]:7600") == "[::1]:7600"
    for bad in ("nohost", "host:port", "unix:", "dns:///x", "http://h:1"):  # a scheme is never a relative path
        with pytest.raises(ValueError):
            resolve_address(bad)
    assert resolve_address("127.0.0.1:65535") == "127.0.0.1:65535"
    # attack pass 4, A4-4: gRPC took 99999 modulo 65536 and served 127.0.0.1:34463 without a word
    with pytest.raises(ValueError, match="port must be 0-65535 \\(0: any free port\\), got 99999"):
        resolve_address("127.0.0.1:99999")


@pytest.mark.parametrize("addr,loop", [("127.0.0.1:1", True), ("127.0.0.2:1", True), ("localhost:1", True), ("[::1]:1", True),
                                       ("unix:///x", True), ("0.0.0.0:1", False), ("192.0.2.2:1", False), ("[::]:1", False),
                                       ("example.com:1", False)])
def test_loopback(addr, loop):
    assert is_loopback(addr) is loop


def test_a_bare_path_is_a_unix_socket(tmp_path, monkeypatch):
    """Regression (issue 8, defect 8): ``--server /path/kv.sock`` used to end in a traceback."""
    monkeypatch.chdir(tmp_path)
    assert resolve_address("/run/kvtier/kv.sock") == "unix:///run/kvtier/kv.sock"
    assert resolve_address("./kv.sock") == f"unix://{tmp_path}/kv.sock"
    assert resolve_address("socks/kv.sock") == f"unix://{tmp_path}/socks/kv.sock"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_address("~/kv.sock") == f"unix://{tmp_path}/kv.sock"
    assert resolve_address("localhost:7600") == "localhost:7600"  # HOST:PORT never has a slash
    with pytest.raises(ValueError, match="socket path such as ./kvtier.sock"):
        resolve_address("kv.sock")


def test_private_dir_is_created_0700_and_a_loose_own_dir_is_tightened(tmp_path):
    import os
    import stat

    from kvtier.addresses import prepare_private_dir

    new = prepare_private_dir(tmp_path / "a" / "kvtier")
    assert stat.S_IMODE(os.stat(new).st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    prepare_private_dir(loose)
    assert stat.S_IMODE(os.stat(loose).st_mode) == 0o700


def test_private_dir_of_another_user_or_a_symlink_is_refused_untouched(tmp_path):
    """Regression (issue 8, defect 6): a pre-existing socket directory owned by another user, or a
    symlink, was accepted and chmod'ed. Now it is refused and left as it was."""
    import os
    import stat

    from kvtier.addresses import UnsafeSocketDirError, prepare_private_dir

    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chmod(theirs, 0o777)
    os.chown(theirs, 65534, 65534)  # tests run as root: hand it to "nobody"
    with pytest.raises(UnsafeSocketDirError, match="owned by uid 65534"):
        prepare_private_dir(theirs)
    assert stat.S_IMODE(os.stat(theirs).st_mode) == 0o777 and os.stat(theirs).st_uid == 65534
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(UnsafeSocketDirError, match="is a symlink"):
        prepare_private_dir(link)
    (tmp_path / "file").write_text("")
    with pytest.raises(UnsafeSocketDirError, match="not a directory"):
        prepare_private_dir(tmp_path / "file")


def test_clear_stale_socket_removes_only_a_dead_socket_of_this_uid(tmp_path):
    """Attack pass 2, F7: a dead socket of ours (either type) is removed; a live socket of either type,
    a file, a directory, a symlink and another uid's socket stay, refused in one line; nothing is fine."""
    import socket

    from kvtier.addresses import SocketPathInUseError, clear_stale_socket

    clear_stale_socket(tmp_path / "nothing")
    for kind in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET):
        dead = tmp_path / f"dead-{kind}"
        s = socket.socket(socket.AF_UNIX, kind)
        s.bind(str(dead))
        s.close()
        clear_stale_socket(dead, kind)
        assert not dead.exists()
    live = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    live.bind(str(tmp_path / "live"))
    live.listen(1)
    try:
        with pytest.raises(SocketPathInUseError, match="a socket of another type"):
            clear_stale_socket(tmp_path / "live", socket.SOCK_STREAM)
        with pytest.raises(SocketPathInUseError, match="in use by a running daemon"):
            clear_stale_socket(tmp_path / "live", socket.SOCK_SEQPACKET)
    finally:
        live.close()
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "live")
    for name, what in (("file", "a regular file"), ("dir", "a directory"), ("link", "a symlink")):
        with pytest.raises(SocketPathInUseError, match=f"is {what}, not a socket"):
            clear_stale_socket(tmp_path / name)
        assert os.path.lexists(tmp_path / name)
    if os.getuid() == 0:
        os.chown(tmp_path / "live", 65534, 65534, follow_symlinks=False)
        with pytest.raises(SocketPathInUseError, match="socket of uid 65534"):
            clear_stale_socket(tmp_path / "live")
        assert (tmp_path / "live").exists()
