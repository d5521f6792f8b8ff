"""Tenants in the domain: the tokens file's checks, constant-time lookup, tenant-namespaced tier keys,
quotas from the config."""

from __future__ import annotations

import os

import pytest

from kvtier.server.daemon.config import DaemonConfig
from kvtier.server.daemon.quotas import Quota
from kvtier.server.daemon.tenants import AuthConfigError, Caller, TokenTable, tenant_key, tenant_of_key

TOKEN_A = "tok-a-0123456789abcdef"
TOKEN_B = "tok-b-0123456789abcdef"


def _tokens_file(tmp_path, text: str, mode: int = 0o600):
    p = tmp_path / "tokens.toml"
    p.write_text(text)
    os.chmod(p, mode)
    return p


def test_a_good_file_maps_tokens_to_tenants(tmp_path):
    t = TokenTable.from_file(_tokens_file(tmp_path, f'[tokens]\n"{TOKEN_A}" = "team-a"\n"{TOKEN_B}" = "team-b"\n'))
    assert (t.tenant_for(TOKEN_A), t.tenant_for(TOKEN_B)) == ("team-a", "team-b")
    assert t.tenant_for(TOKEN_A + "x") is None and t.tenant_for("") is None and t.tenant_for(None) is None
    assert t.tenants == {"team-a", "team-b"}


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_file_others_can_read_is_refused_in_one_line(tmp_path, mode):
    p = _tokens_file(tmp_path, f'[tokens]\n"{TOKEN_A}" = "a"\n', mode)
    with pytest.raises(AuthConfigError) as e:
        TokenTable.from_file(p)
    msg = str(e.value)
    assert f"mode {mode:04o}" in msg and f"chmod 600 {p}" in msg and "\n" not in msg and TOKEN_A not in msg


def test_a_file_of_another_user_or_a_symlink_is_refused(tmp_path):
    p = _tokens_file(tmp_path, f'[tokens]\n"{TOKEN_A}" = "a"\n')
    link = tmp_path / "link.toml"
    link.symlink_to(p)
    with pytest.raises(AuthConfigError, match="not a symlink"):
        TokenTable.from_file(link)
    os.chown(p, 65534, 65534)  # tests run as root (BRIEF.md): hand the file to "nobody"
    with pytest.raises(AuthConfigError, match="owned by uid 65534, not by the daemon's user"):
        TokenTable.from_file(p)


@pytest.mark.parametrize("text, match", [
    ("[tokens]\n", "empty"),
    ('[tokens]\n"short" = "a"\n', "shorter than 16"),
    (f'[tokens]\n"{TOKEN_A}" = "bad tenant!"\n', "tenant names"),
    (f'"{TOKEN_A}" = "a"\n', "unknown tables/keys"),
    ("[tokens\n", "not valid TOML"),
    (f'[tokens]\n"{TOKEN_A}" = 3\n', "strings"),
    # a token no client could send: gRPC headers carry visible ASCII only (attack pass 3, N9)
    (f'[tokens]\n"{TOKEN_A} x" = "a"\n', "character #23, code 32"),
    (f'[tokens]\n"{TOKEN_A}\u00fc" = "a"\n', "a gRPC header cannot carry"),
])
def test_bad_contents_are_refused_without_echoing_tokens(tmp_path, text, match):
    with pytest.raises(AuthConfigError, match=match) as e:
        TokenTable.from_file(_tokens_file(tmp_path, text))
    assert TOKEN_A not in str(e.value) and "\n" not in str(e.value)


def test_the_caller_never_prints_its_token():
    c = Caller("team-a", TOKEN_A)
    assert TOKEN_A not in repr(c) and TOKEN_A not in str(c)
    with pytest.raises(ValueError):
        Caller("no spaces allowed")


def test_tenant_keys_round_trip_and_never_collide():
    a, b = tenant_key("a", b"o:k"), tenant_key("ab", b"o:k")
    assert a != b and tenant_of_key(a) == "a" and tenant_of_key(b) == "ab"
    assert tenant_key("a", b"bc") != tenant_key("ab", b"c")  # the length prefix keeps names apart
    assert tenant_of_key(b"p:" + bytes(8)) is None and tenant_of_key(b"t") is None and tenant_of_key(3) is None


def test_quotas_come_from_quota_tables_with_a_default_for_everyone_else():
    c = DaemonConfig.from_mapping({"quotas": {"team-a": {"pool_bytes": "1GiB", "host_bytes": 4096},
                                              "*": {"disk_bytes": "2MiB"}}})
    assert c.quotas.of("team-a") == Quota(pool_bytes=1 << 30, host_bytes=4096)
    assert c.quotas.of("team-b") == Quota(disk_bytes=2 << 20)
    assert c.quotas.tier_bytes("team-b", "disk") == 2 << 20 and c.quotas.tier_bytes("team-a", "disk") is None
    with pytest.raises(ValueError, match=r"unknown \[quotas.x\] keys \['pools'\]"):
        DaemonConfig.from_mapping({"quotas": {"x": {"pools": 1}}})
    with pytest.raises(ValueError, match="tenant names"):
        DaemonConfig.from_mapping({"quotas": {"bad name": {"pool_bytes": 1}}})
