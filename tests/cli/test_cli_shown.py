"""What ``kvtier status`` and ``kvtier pools`` print of names a client set (attack pass 7, A7-9): never a
control character, never rich markup, even from a daemon that took such a name."""

from __future__ import annotations

import contextlib
import importlib
from types import SimpleNamespace

from click.testing import CliRunner

from kvtier.cli import main
from kvtier.cli.common import shown
from kvtier.v1 import pool_pb2

ESC = "\x1b]0;pwned\x07\x1b[2J\x1b[31mFAKE"


def test_shown_writes_control_characters_as_escapes_and_escapes_markup():
    assert shown(ESC) == "\\x1b]0;pwned\\x07\\x1b[2J\\x1b[31mFAKE"  # "[2J" is no markup tag: left as it is
    assert shown("[bold]x[/]") == "\\[bold]x\\[/]"
    assert shown("glm-5.2 ok") == "glm-5.2 ok"


def test_pools_prints_no_escape_a_daemon_sent(monkeypatch):
    """A daemon that took an escape in a pool id and a model name (an older one): ``kvtier pools``
    shows them as ``\\x1b`` text, with no ESC byte (0x1b) in its output."""
    pools_cli = importlib.import_module("kvtier.cli.pools")  # the package attribute is the click command

    info = pool_pb2.PoolInfo(pool_id="p" + ESC, role="target", device="cpu", size_tokens=64,
                             layout=pool_pb2.PoolLayout(model_name=ESC, page_size=64, num_layers=2, kv_cache_dtype="fp8"))

    @contextlib.contextmanager
    def fake_client(_server, _timeout):
        yield SimpleNamespace(address="unix:///x.sock", list_pools=lambda: [info])

    monkeypatch.setattr(pools_cli, "open_client", fake_client)
    result = CliRunner().invoke(main, ["pools"])
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output
    assert "\\x1b]0;pwned\\x07\\x1b[2J" in result.output  # shown as text, in the pool and model columns
