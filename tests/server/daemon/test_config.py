"""DaemonConfig and PoolSpec: defaults, byte sizes, --pool parsing, TOML keys."""

from __future__ import annotations

import os

import pytest

from kvtier.server.daemon.config import DaemonConfig, PoolSpec, parse_bytes


def test_defaults():
    c = DaemonConfig()
    assert (c.listen, c.device, c.max_message_bytes, c.chunk_bytes, c.workers) == ("", "auto", 4 << 20, 1 << 20, 16)
    assert c.grpc_options() == [("grpc.max_send_message_length", 4 << 20), ("grpc.max_receive_message_length", 4 << 20)]
    assert c.max_chunk_bytes == (4 << 20) - 1024


@pytest.mark.parametrize("text,value", [(4194304, 4194304), ("4MiB", 4 << 20), ("1.5GiB", 3 << 29), ("8gb", 8 * 10**9), ("512 KiB", 512 << 10)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", [(1 << 60) + 1, 2**63 - 1, str(2**64), "2000000TiB", "9" * 400 + "MiB"])
def test_parse_bytes_refuses_more_than_an_exbibyte(text):
    """Attack pass 8, A8-8: ``--host-memory 2^63-1`` and ``--disk-size 2^64`` (flags and TOML) passed the
    parser and overflowed in ``os.ftruncate`` and ``lmdb.open`` with a traceback; 400 digits of MiB
    overflowed the float. Every size is at most 2^60 bytes (1 EiB), said in one line."""
    with pytest.raises(ValueError, match=r"must be at most 1 EiB \(2\^60 bytes\)"):
        parse_bytes(text, "--disk-size")
    assert parse_bytes(1 << 60) == 1 << 60 and parse_bytes("1048576TiB") == 1 << 60


@pytest.mark.parametrize("text", ["-1", "4 parsecs", "", True, -5])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_pool_spec_parse():
    assert PoolSpec.parse("glm-5.2:65536") == PoolSpec(model="glm-5.2", pool_id="default", tokens=65536)
    assert PoolSpec.parse("main=glm-5.2:2GiB") == PoolSpec(model="glm-5.2", pool_id="main", memory_bytes=2 << 30)
    assert PoolSpec.parse("/m/config.json:64").model == "/m/config.json"
    for bad in ("glm-5.2", "glm-5.2:", ":64"):
        with pytest.raises(ValueError):
            PoolSpec.parse(bad)


def test_bad_values_are_refused():
    for kwargs in ({"device": "tpu"}, {"workers": 0}, {"chunk_bytes": 4 << 20}, {"tls_cert": "c.pem"},
                   {"max_message_bytes": 1000}, {"log_level": "LOUD"}, {"request_arrival_seconds": 0}):
        with pytest.raises(ValueError):
            DaemonConfig(**kwargs)


@pytest.mark.parametrize("kwargs, words", [
    ({"grace_seconds": 1e308}, "grace_seconds must be at most 86400 (a day)"),
    ({"close_seconds": 86401}, "close_seconds must be at most 86400"),
    ({"stream_idle_seconds": 1e12}, "stream_idle_seconds must be at most 86400"),
    ({"request_arrival_seconds": 1e9}, "request_arrival_seconds must be at most 86400"),
    ({"peer_retry_seconds": 1e9}, "peer_retry_seconds must be at most 86400"),
    ({"max_message_bytes": 5 << 30}, "max_message_bytes must be 65536..2147483647 (gRPC's limit)"),
    ({"attach_staging_bytes": 10 ** 18}, "attach_staging_bytes must be 0.."),  # attack pass 5 (with A5-8)
    ({"attach_staging_tenant_bytes": -1}, "attach_staging_tenant_bytes must be 0.."),
    # attack pass 6, A6-8: 100,000 torch threads took the machine's thread limit and crashed
    ({"torch_threads": 100000}, "torch_threads must be 1..256"),
    ({"workers": 100000}, "workers must be 2..1024"),
    ({"max_streams": 1000000}, "max_streams must be 0..65536"),
])
def test_values_too_large_for_the_deadlines_or_grpc_are_refused(kwargs, words):
    """Attack pass 4, A4-4: ``--grace 1e308`` was accepted and the daemon died at SIGTERM with
    OverflowError (timestamp out of range) before its shutdown work; ``--max-message-bytes 5GiB``
    ended in gRPC's OverflowError traceback."""
    with pytest.raises(ValueError) as e:
        DaemonConfig(**kwargs)
    assert str(e.value).startswith(words)
    DaemonConfig(grace_seconds=86400, max_message_bytes=(1 << 31) - 1, chunk_bytes=1 << 20)  # the bounds are allowed


def test_a_config_file_another_user_could_write_is_refused(tmp_path):
    """Attack pass 4, A4-5: a --config file of uid 65534 and mode 0666 was applied (it names the tokens
    file, the attach uids, the disk path: everything the strict checks of the tokens file guard).
    Now it must be owned by root or this uid and not writable by group or others; others may read it."""
    p = tmp_path / "k.toml"
    p.write_text('workers = 4\n')
    p.chmod(0o644)
    assert DaemonConfig.from_toml(p).workers == 4
    p.chmod(0o666)
    with pytest.raises(ValueError, match=f"--config {p}: mode 0666 lets other users change the daemon's settings; "
                                         f"run chmod go-w {p}"):
        DaemonConfig.from_toml(p)
    p.chmod(0o644)
    os.chown(p, 65534, 65534)  # tests run as root
    with pytest.raises(ValueError, match=f"refusing --config {p}: file {p} is owned by uid 65534, not by root"):
        DaemonConfig.from_toml(p)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    q = theirs / "k.toml"
    q.write_text('workers = 4\n')
    with pytest.raises(ValueError, match=f"refusing --config {q}: directory {theirs} is owned by uid 65534"):
        DaemonConfig.from_toml(q)


def test_toml(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('listen = "127.0.0.1:0"\nmax_message_bytes = "8MiB"\nchunk_bytes = "2MiB"\nrequest_arrival_seconds = 2.5\n'
                 '[[pools]]\nmodel = "glm-5.2"\ntokens = 128\n')
    c = DaemonConfig.from_toml(p)
    assert (c.listen, c.max_message_bytes, c.chunk_bytes) == ("127.0.0.1:0", 8 << 20, 2 << 20)
    assert (c.request_arrival_seconds, DaemonConfig().request_arrival_seconds) == (2.5, 5.0)
    assert c.pools == (PoolSpec(model="glm-5.2", tokens=128),)
    assert c.replace(listen=None, workers=2).listen == "127.0.0.1:0"
    p.write_text('[[pools]]\nmodel = "glm-5.2"\ntokens = 128\nsize = 3\n')
    with pytest.raises(ValueError, match=r"unknown \[\[pools\]\] keys \['size'\]"):
        DaemonConfig.from_toml(p)
    p.write_text("listen = \n")
    with pytest.raises(ValueError):
        DaemonConfig.from_toml(p)


def test_a_tenants_share_of_the_stream_slots():
    """``max_streams_per_tenant`` 0: every slot with one tenant, half (rounded up) with more; a set value
    is kept, at most ``max_streams``; negative is refused; read from TOML."""
    assert [DaemonConfig().tenant_stream_slots(n) for n in (1, 2, 5)] == [8, 4, 4]
    assert [DaemonConfig(max_streams=5).tenant_stream_slots(n) for n in (1, 2)] == [5, 3]
    assert [DaemonConfig(max_streams=1).tenant_stream_slots(n) for n in (1, 2)] == [1, 1]
    assert [DaemonConfig(max_streams_per_tenant=2).tenant_stream_slots(n) for n in (1, 3)] == [2, 2]
    assert DaemonConfig(max_streams=4, max_streams_per_tenant=9).tenant_stream_slots(2) == 4
    with pytest.raises(ValueError, match="max_streams_per_tenant"):
        DaemonConfig(max_streams_per_tenant=-1)
    assert DaemonConfig.from_mapping({"max_streams_per_tenant": 3}).max_streams_per_tenant == 3


@pytest.mark.parametrize(("line", "words"), [
    ('request_arrival_seconds = "5"', "request_arrival_seconds must be a finite number, got '5'"),
    ("request_arrival_seconds = nan", "request_arrival_seconds must be a finite number, got nan"),
    ("stream_idle_seconds = inf", "stream_idle_seconds must be a finite number, got inf"),
    ("request_arrival_seconds = true", "request_arrival_seconds must be a finite number, got True"),
    ('workers = "4"', "workers must be an integer, got '4'"),
    ("max_streams = 2.5", "max_streams must be an integer, got 2.5"),
    ("log_level = 3", "log_level must be a string, got 3"),
    ('metrics_insecure = "yes"', "metrics_insecure must be true or false, got 'yes'"),
])
def test_a_toml_value_of_the_wrong_type_is_one_clear_error(tmp_path, line, words):
    """Regression (attack pass 3, N5): a string where a number goes ended in a TypeError traceback, and
    NaN or inf seconds started a daemon whose deadlines never fire."""
    p = tmp_path / "c.toml"
    p.write_text(line + "\n")
    with pytest.raises(ValueError) as info:
        DaemonConfig.from_toml(p)
    assert words in str(info.value)


def test_pool_ids_are_per_tenant():
    """Attack pass 4, A4-11: two tenants' start pools could not share an id ("pool ids repeat"),
    though pool ids are per tenant; a repeat within one tenant is still refused."""
    a = PoolSpec(model="glm-5.2", pool_id="p", tokens=64, tenant="team-a")
    b = PoolSpec(model="glm-5.2", pool_id="p", tokens=64, tenant="team-b")
    assert len(DaemonConfig(pools=(a, b)).pools) == 2
    from kvtier.server.daemon import Daemon
    from kvtier.server.daemon.tenants import Caller

    d = Daemon(DaemonConfig(device="cpu", pools=(a, b)))
    d.create_configured_pools()
    assert [e.tenant for e in (d.pools.get(Caller("team-a"), "p"), d.pools.get(Caller("team-b"), "p"))] == ["team-a", "team-b"]
    with pytest.raises(ValueError, match="pool ids repeat within a tenant: team-a/p"):
        DaemonConfig(pools=(a, a))


@pytest.mark.parametrize("pools, words", [(5, "pools must be [[pools]] tables"), ([5], "pools must be [[pools]] tables"),
                                          ([{}], "a [[pools]] table needs model")])
def test_pools_that_are_not_tables_are_one_line(pools, words):
    """Attack pass 6, A6-7: ``pools = 5``, ``[5]`` and ``[{}]`` in the TOML ended in tracebacks."""
    with pytest.raises(ValueError) as e:
        DaemonConfig.from_mapping({"pools": pools})
    assert str(e.value).startswith(words)


@pytest.mark.parametrize("units, words", [({"pending_seconds": float("nan")}, "units.pending_seconds must be > 0 and at most"),
                                          ({"pending_seconds": 1e308}, "units.pending_seconds must be > 0 and at most"),
                                          ({"max_call_bytes": 100 << 40}, "units.max_call_bytes must be at most")])
def test_unit_settings_have_upper_bounds(units, words):
    """Attack pass 6, A6-7: NaN and 1e308 seconds and a 100 TB call were accepted."""
    from kvtier.server.daemon.unit_settings import UnitSettings

    with pytest.raises(ValueError, match=words):
        UnitSettings(**units)


@pytest.mark.parametrize(("workers", "streams", "words"), [
    (4, 4, "max_streams (4) must be below workers (4), so control calls always have a thread: set --max-streams "
           "(max_streams) to at most 3, or leave it unset (half the workers)"),
    (4, 8, "max_streams (8) must be below workers (4)"),
    (2, 2, "max_streams (2) must be below workers (2), so control calls always have a thread: set --max-streams "
           "(max_streams) to at most 1, or leave it unset (half the workers)"),
])
def test_max_streams_at_or_above_workers_is_refused_from_toml_and_flags(workers, streams, words):
    """Attack pass 7, A7-11: ``--workers 4 --max-streams 4`` (or 8) started without a word, and two
    stalled streams then held every worker: control calls waited ~30 s for the idle watchdog. The
    same rule holds for the TOML keys and the flags (``replace`` is what ``kvtier serve`` applies
    its flags with)."""
    for make in (lambda: DaemonConfig(workers=workers, max_streams=streams),
                 lambda: DaemonConfig.from_mapping({"workers": workers, "max_streams": streams}),
                 lambda: DaemonConfig(workers=workers).replace(max_streams=streams)):
        with pytest.raises(ValueError) as info:
            make()
        assert words in str(info.value) and "\n" not in str(info.value)
    assert DaemonConfig(workers=4, max_streams=3).stream_slots == 3
    assert DaemonConfig(workers=2).stream_slots == 1  # unset: half the workers, at least 1
    # attack pass 8, A8-9: with 1 worker its one stream slot was the only worker, flags and TOML alike
    for make in (lambda: DaemonConfig(workers=1), lambda: DaemonConfig.from_mapping({"workers": 1})):
        with pytest.raises(ValueError, match=r"workers must be 2\.\.1024 \(KV streams take at most all but one"):
            make()


@pytest.mark.parametrize(("text", "words"), [
    ("[tenants.a]\nattach_uids = 5", "[tenants.a] attach_uids must be a list of uids (integers 0..2^32-1), got 5"),
    ("[tiers]\nstack = 5", 'tiers.stack must be a list of tier names (or "host,disk"), got 5'),
    ("[tiers.mooncake]\nnamespaces = 5", "tiers.mooncake.namespaces must be a list of strings, got 5"),
    ("[[pools]]\nmodel = 5\ntokens = 64", "[[pools]] model must be a string, got 5"),
    ('[[pools]]\nmodel = "glm-5.2"\ntokens = 64\npool_id = 5', "[[pools]] pool_id must be a string, got 5"),
    ("[tiers.mooncake]\nkey_prefix = 5", "tiers.mooncake.key_prefix must be a string, got 5"),
    ("[tiers.mooncake]\nreplicas = -1", "mooncake replicas must be a non-negative integer, got -1"),
    ("[tiers]\nhost_pin_memory = 5", "tiers.host_pin_memory must be true or false, got 5"),
    ("[units]\npending_seconds = nan", "units.pending_seconds must be > 0 and at most 86400 (a day), got nan"),
])
def test_toml_values_that_were_tracebacks_are_one_line_errors(tmp_path, text, words):
    """Attack pass 7, A7-1: these values gave Python tracebacks at start (TypeError: 'int' object is
    not iterable, ... not int, has no len()), or were taken unread (a mooncake table when the stack
    has no mooncake tier; [units] was first read when the daemon built its tiers)."""
    p = tmp_path / "c.toml"
    p.write_text(text + "\n")
    p.chmod(0o600)
    with pytest.raises(ValueError) as info:
        DaemonConfig.from_toml(p)
    assert words in str(info.value) and "\n" not in str(info.value)


def _every_key_with(values):
    """(key, document) for every key of every table the config file takes, set to each of ``values``."""
    import dataclasses

    from kvtier.server.daemon.quotas import Quota
    from kvtier.server.daemon.tenants import TenantSettings
    from kvtier.server.daemon.tier_settings import TierSettings
    from kvtier.server.daemon.unit_settings import UnitSettings
    from kvtier.server.tiers.mooncake_config import MooncakeStoreTierConfig

    def names(cls, leave=()):
        return [f.name for f in dataclasses.fields(cls) if f.name not in leave]

    for v in values:
        for k in names(DaemonConfig):
            yield k, {k: v}
        for k in names(TierSettings):
            yield f"tiers.{k}", {"tiers": {k: v}}
        for k in names(MooncakeStoreTierConfig):
            yield f"tiers.mooncake.{k}", {"tiers": {"mooncake": {k: v}}}
        for k in names(UnitSettings):
            yield f"units.{k}", {"units": {k: v}}
        for k in names(PoolSpec):
            yield f"pools.{k}", {"pools": [{"model": "glm-5.2", "tokens": 64, k: v}]}
        for k in names(TenantSettings):
            yield f"tenants.a.{k}", {"tenants": {"a": {k: v}}}
        for k in names(Quota):
            yield f"quotas.a.{k}", {"quotas": {"a": {k: v}}}
        yield "tenants.a", {"tenants": {"a": v}}
        yield "quotas.a", {"quotas": {"a": v}}


def test_every_key_of_the_config_file_takes_a_wrong_type_as_one_line():
    """Attack pass 7, A7-1 (every key, not only the five found): each key of each table, set to a
    value of each TOML type, is taken or refused with a one-line ValueError; never another exception
    (the tracebacks were TypeErrors from ``tuple(5)``, ``len(5)``, ``os.fspath(5)``)."""
    import math

    wrong = [5, -1, 1.5, "x", True, [1], {"a": 1}, math.nan, math.inf, [], ""]
    seen = 0
    for key, doc in _every_key_with(wrong):
        seen += 1
        try:
            DaemonConfig.from_mapping(doc)
        except ValueError as e:
            assert "\n" not in str(e), (key, doc, str(e))
        except Exception as e:  # noqa: BLE001 - the point: no other exception
            pytest.fail(f"{key} = {doc}: {type(e).__name__}: {e}")
    assert seen > 900
