"""The unit store over gRPC against a real daemon: parts streamed in chunks under the message limit,
one record per unit, tenants apart, units on disk survive a restart, bad input refused.

Geometry: GLM-5.2 layers 20-27 (fp8): 8 layers of 656-byte rows, live indexer layers 22 and 26; a
unit is 8 x 64 x 656 = 335,872 KV bytes + 2 x 8448 index bytes. Chunks of 64 KiB, so a put of 3
units is ~16 messages.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvtier.client import InvalidArgumentError, KVTierClient
from kvtier.client.spawn import DaemonProcess
from kvtier.client.storage import UnitSpaceSpec

PS = 64
MASK = "".join("F" if max(layer - 2, 0) % 4 == 0 else "S" for layer in range(20, 28))
SPACE = UnitSpaceSpec("GLM-5.2", num_layers=8, start_layer=20, kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128,
                      kv_cache_dtype="fp8", page_size=PS, latent_row_bytes=656, skip_mask=MASK)
TOKEN_A = "unit-tenant-a-0123456789abcdef"
TOKEN_B = "unit-tenant-b-0123456789abcdef"


def unit_bytes(seed: int, part: str = "both") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    both = torch.randint(0, 256, (SPACE.part_nbytes("both"),), dtype=torch.uint8, generator=g)
    return {"both": both, "kv": both[:SPACE.kv_nbytes], "index": both[SPACE.kv_nbytes:]}[part]


@pytest.fixture
def daemon(tmp_path):
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = "team-a"\n"{TOKEN_B}" = "team-b"\n')
    os.chmod(tokens, 0o600)
    args = ["--device", "cpu", "--auth-tokens", str(tokens), "--host-memory", "16MiB", "--disk-path",
            str(tmp_path / "disk"), "--disk-size", "64MiB", "--chunk-bytes", str(64 << 10)]
    d = DaemonProcess(f"unix://{tmp_path}/kv.sock", extra_args=args)
    d.start()
    yield d
    d.stop()
    d.cleanup()


def client(d, token=TOKEN_A):
    return KVTierClient(d.address, token=token, chunk_bytes=64 << 10, timeout=60)


def test_parts_apart_become_one_unit_and_come_back_byte_exact(daemon):
    keys = [b"h0", b"h1", b"h2"]
    with client(daemon) as c:
        assert SPACE.index_nbytes == 2 * 8448 and SPACE.kv_nbytes == 8 * PS * 656
        r = c.put_units(SPACE, keys, "index", torch.cat([unit_bytes(i, "index") for i in range(3)]))
        assert r.accepted == [True] * 3 and r.completed == 0 and r.pending == 3
        assert c.exist_units(SPACE, keys) == 0                      # indexer alone: invisible
        r = c.put_units(SPACE, keys[:2], "kv", torch.cat([unit_bytes(i, "kv") for i in range(2)]))
        assert r.completed == 2 and r.pending == 0
        assert c.exist_units(SPACE, keys) == 2                      # h2 still lacks its KV
        out = torch.zeros(3 * SPACE.part_nbytes("both"), dtype=torch.uint8)
        assert c.get_units(SPACE, keys, "both", out) == [True, True, False]
        n = SPACE.part_nbytes("both")
        for i in range(2):
            assert torch.equal(out[i * n:(i + 1) * n], unit_bytes(i))
        assert int(out[2 * n:].count_nonzero()) == 0
        idx = torch.zeros(2 * SPACE.index_nbytes, dtype=torch.uint8)
        assert c.get_units(SPACE, [b"h1", b"h0"], "index", idx) == [True, True]
        assert torch.equal(idx[:SPACE.index_nbytes], unit_bytes(1, "index"))
        st = c.unit_stats()
        assert st["units_stored"] == 2 and st["parts_pending"] == 1 and st["pending_bytes"] == SPACE.index_nbytes
    with client(daemon, TOKEN_B) as other:                          # another tenant sees nothing
        assert other.exist_units(SPACE, keys) == 0
        assert other.get_units(SPACE, keys, "both", torch.zeros(3 * n, dtype=torch.uint8)) == [False] * 3
        assert other.unit_stats().get("units_stored", 0) == 0


def test_units_on_disk_survive_a_restart(daemon):
    keys = [b"r0", b"r1"]
    with client(daemon) as c:
        c.put_units(SPACE, keys, "both", torch.cat([unit_bytes(10), unit_bytes(11)]))
    daemon.stop()            # SIGTERM: host records move down to the disk tier
    daemon.start()
    with client(daemon) as c:
        assert c.exist_units(SPACE, keys) == 2
        out = torch.empty(2 * SPACE.part_nbytes("both"), dtype=torch.uint8)
        assert c.get_units(SPACE, keys, "both", out) == [True, True]
        assert torch.equal(out, torch.cat([unit_bytes(10), unit_bytes(11)]))
        assert c.clear_units(SPACE) == 2 and c.exist_units(SPACE, keys) == 0


def test_bad_input_is_refused_and_stores_nothing(daemon):
    with client(daemon) as c:
        for bad in (dict(latent_row_bytes=576), dict(skip_mask="FS"), dict(kv_cache_dtype="fp4"), dict(model_name=""),
                    dict(scope="x" * 65)):
            s = UnitSpaceSpec(**{**SPACE.__dict__, **bad})
            with pytest.raises(InvalidArgumentError):
                c.exist_units(s, [b"k"])
        with pytest.raises(InvalidArgumentError):
            c.exist_units(SPACE, [b""])
        with pytest.raises(InvalidArgumentError):
            c.put_units(SPACE, [b"k", b"k"], "kv", torch.zeros(2 * SPACE.kv_nbytes, dtype=torch.uint8))
        no_index = UnitSpaceSpec(**{**SPACE.__dict__, "with_index": False})
        with pytest.raises(InvalidArgumentError):
            c.put_units(no_index, [b"k"], "index", torch.zeros(SPACE.index_nbytes, dtype=torch.uint8))
        with pytest.raises(ValueError):
            c.put_units(SPACE, [b"k"], "kv", torch.zeros(SPACE.kv_nbytes - 1, dtype=torch.uint8))
        assert c.unit_stats().get("units_stored", 0) == 0 and c.unit_stats()["parts_pending"] == 0


def test_units_shared_through_a_mooncake_store_tier(mooncake_master, tmp_path):
    """With ``u:`` among the Mooncake tier's shared namespaces, a unit one daemon stores is found and
    read byte-exact by another daemon on the same store (another machine's SGLang reads it); the
    other tenant's keys differ, so it finds nothing."""
    cfg = tmp_path / "kv.toml"
    cfg.write_text('[tiers.mooncake]\nnamespaces = ["p:", "u:"]\n')
    args = ["--device", "cpu", "--config", str(cfg), "--host-memory", "8MiB", "--tiers", "host,mooncake",
            "--mooncake-master", mooncake_master.master, "--mooncake-metadata", mooncake_master.metadata,
            "--mooncake-segment-size", "64MiB"]
    with DaemonProcess(f"unix://{tmp_path}/a.sock", extra_args=args) as a, \
            DaemonProcess(f"unix://{tmp_path}/b.sock", extra_args=args) as b, \
            KVTierClient(a.address, timeout=60) as ca, KVTierClient(b.address, timeout=60) as cb:
        keys = [b"m0", b"m1"]
        data = torch.cat([unit_bytes(20), unit_bytes(21)])
        assert ca.put_units(SPACE, keys, "both", data).completed == 2
        assert cb.exist_units(SPACE, keys) == 2
        out = torch.zeros_like(data)
        assert cb.get_units(SPACE, keys, "both", out) == [True, True] and torch.equal(out, data)
        assert cb.tier_stats().tiers["mooncake"]["hits"] >= 2
        other = UnitSpaceSpec(**{**SPACE.__dict__, "scope": "tp1/2"})
        assert cb.exist_units(other, keys) == 0


def test_one_tenants_flood_of_waiting_parts_never_drops_anothers(tmp_path):
    """Scenario (adversarial findings 15, 16): tenant B, with a 1 MiB host quota, floods KV parts whose
    indexer never comes. The pending table was one daemon-wide budget, oldest first: B's flood
    dropped tenant A's waiting indexer parts, so A's units (indexer then KV, SGLang's order) never
    completed, and B held ~40 MB of waiting parts against its 1 MiB quota. Now B's waiting parts stay
    within its quota, B makes room from its own oldest parts, and A's units all complete byte-exact."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = "team-a"\n"{TOKEN_B}" = "team-b"\n')
    os.chmod(tokens, 0o600)
    cfg = tmp_path / "kvtier.toml"
    cfg.write_text('[units]\npending_bytes = "32MiB"\n[quotas.team-b]\nhost_bytes = "1MiB"\n')
    d = DaemonProcess(f"unix://{tmp_path}/kv.sock", extra_args=[
        "--device", "cpu", "--auth-tokens", str(tokens), "--host-memory", "64MiB", "--config", str(cfg)])
    d.start()
    try:
        with client(d) as a, client(d, TOKEN_B) as b:
            ka = [b"a%d" % i for i in range(8)]
            assert a.put_units(SPACE, ka, "index", torch.cat([unit_bytes(i, "index") for i in range(8)])).pending == 8
            kb = [[b"b%d-%d" % (j, i) for i in range(10)] for j in range(12)]
            for j, keys in enumerate(kb):                       # 120 KV parts, ~40 MB, never completed
                b.put_units(SPACE, keys, "kv", torch.cat([unit_bytes(100 + i, "kv") for i in range(10)]))
            sa, sb = a.unit_stats(), b.unit_stats()
            assert sa["parts_pending"] == 8 and sa["pending_bytes"] == 8 * SPACE.index_nbytes
            assert 1 <= sb["parts_pending"] and sb["pending_bytes"] <= 1 << 20     # within B's host quota
            assert sb["partial_evicted"] >= 120 - sb["parts_pending"]
            # B's newest waiting part is the one kept: its indexer completes it; its oldest is gone
            assert b.put_units(SPACE, [kb[-1][-1]], "index", unit_bytes(109, "index")).completed == 1
            assert b.put_units(SPACE, [kb[0][0]], "index", unit_bytes(100, "index")).completed == 0
            r = a.put_units(SPACE, ka, "kv", torch.cat([unit_bytes(i, "kv") for i in range(8)]))
            assert r.completed == 8 and a.exist_units(SPACE, ka) == 8
            n = SPACE.part_nbytes("both")
            out = torch.zeros(8 * n, dtype=torch.uint8)
            assert a.get_units(SPACE, ka, "both", out) == [True] * 8
            assert torch.equal(out, torch.cat([unit_bytes(i) for i in range(8)]))
    finally:
        d.stop()
        d.cleanup()


@pytest.mark.parametrize("order", [("A index", "B index", "A kv", "B kv"), ("A index", "B index", "B kv", "A kv"),
                                   ("A kv", "B kv", "A index", "B index"), ("A kv", "B index", "B kv", "A index")])
def test_two_clients_writing_one_unit_never_get_their_parts_joined(daemon, order):
    """Attack pass 4, A4-8, through the daemon: two clients put the same key's parts interleaved;
    the unit served is whole from one of them (each client is its own writer), never A's KV with
    B's indexer rows."""
    key = "-".join(order).encode()
    with client(daemon) as a, client(daemon) as b:
        data = {"A": unit_bytes(1), "B": unit_bytes(2)}
        for step in order:
            who, part = step.split()
            c = a if who == "A" else b
            c.put_units(SPACE, [key], part, data[who][:SPACE.kv_nbytes] if part == "kv" else data[who][SPACE.kv_nbytes:])
        out = torch.zeros(SPACE.part_nbytes("both"), dtype=torch.uint8)
        assert a.get_units(SPACE, [key], "both", out) == [True]
        assert torch.equal(out, data["A"]) or torch.equal(out, data["B"])
