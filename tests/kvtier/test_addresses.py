"""Daemon addresses: defaults, forms, loopback rule."""

from __future__ import annotations

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
    for bad in ("nohost", "host:port", "unix:"):
        with pytest.raises(ValueError):
            resolve_address(bad)


@pytest.mark.parametrize("addr,loop", [("127.0.0.1:1", True), ("127.0.0.2:1", True), ("localhost:1", True), ("[::1]:1", True),
                                       ("unix:///x", True), ("0.0.0.0:1", False), ("192.0.2.2:1", False), ("[::]:1", False),
                                       ("example.com:1", False)])
def test_loopback(addr, loop):
    assert is_loopback(addr) is loop
