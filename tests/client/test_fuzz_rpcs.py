"""Property-based fuzzing of every RPC (hypothesis) against one real daemon.

Each RPC gets malformed requests built from its message descriptor: every field set or not, numbers
at and past their limits (negative slots, 2**64 - 1 tokens, unknown enum values), names of real and
absent pools, keys, leases and peers, hostile JSON for model configs, chunks at every offset. For
every input:

* the status is never INTERNAL or UNKNOWN (nor DEADLINE_EXCEEDED: nothing hangs), and
* a rejected call changes nothing: a checksum of the reference pool's KV bytes, its allocation and
  prefix-cache state, and every tier's usage is the same after it as before.

An accepted call may change things; the scene is then rebuilt. The default run tries
``EXAMPLES_PER_RPC`` inputs per RPC (about 1,300 in all: RPCs with an empty request message have
one; the same seed every run); ``KVTIER_FUZZ_EXAMPLES=1000`` runs a deeper pass (attack passes do).
"""

from __future__ import annotations

import hashlib
import json
import os

import grpc
import pytest
import torch
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.client import KVTierClient, KVTierError
from kvtier.client.spawn import DaemonProcess
from kvtier.page_keys import page_keys
from kvtier.v1 import (
    pool_pb2, pool_pb2_grpc, storage_pb2, storage_pb2_grpc, tier_pb2, tier_pb2_grpc, transfer_pb2, transfer_pb2_grpc,
)

EXAMPLES_PER_RPC = int(os.environ.get("KVTIER_FUZZ_EXAMPLES", "80"))
PS = 64
KEYS = page_keys(list(range(3 * PS)), PS)
SERVICES = [(pool_pb2, pool_pb2_grpc, "PoolService"), (tier_pb2, tier_pb2_grpc, "TierService"),
            (transfer_pb2, transfer_pb2_grpc, "TransferService"), (storage_pb2, storage_pb2_grpc, "StorageService")]
RPCS = [(mod, grpc_mod, svc, m) for mod, grpc_mod, svc in SERVICES for m in mod.DESCRIPTOR.services_by_name[svc].methods]
BAD_STATUS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}

# ----- values ----------------------------------------------------------------------------------
INT64 = st.one_of(st.sampled_from([0, 1, -1, 63, 64, 65, 127, 128, 4095, 4096, 2**31, 2**63 - 1, -2**63]),
                  st.integers(-2**63, 2**63 - 1), st.integers(-2, 1100))
UINT64 = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 63, 64, 65, 4096, 2**32 - 1, 2**40, 2**63, 2**64 - 1]),
                   st.integers(0, 2**64 - 1), st.integers(0, 600))
UINT32 = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 7, 8, 64, 78, 4096, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
INT32 = st.one_of(st.sampled_from([0, 1, -1, 2**31 - 1, -2**31]), st.integers(-2**31, 2**31 - 1))
POOL_IDS = st.sampled_from(["victim"] * 4 + ["scratch"] * 2 + ["", "nothere", "x" * 300, "victim\x00", "vïctim"])
# fields that reach deeper checks when set: set three times in four
MOSTLY_SET = {"space", "layout", "keys", "pool_id", "peer_pool_id", "header", "model", "key", "lease_id", "page_keys", "slots", "runs", "data",
              "latent_layers", "index_layers", "src_pages", "dst_pages", "preset", "size_tokens"}


def _hf_json() -> st.SearchStrategy[str]:
    good = {"num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_topk_freq": 4,
            "index_skip_topk_offset": 3}
    mutated = st.fixed_dictionaries({k: st.one_of(st.just(v), INT64, st.text(max_size=4), st.none())
                                     for k, v in good.items()}).map(json.dumps)
    return st.one_of(mutated, st.sampled_from([
        "[" * 100_000 + "]" * 100_000, "{}", "[]", "null", "not json", json.dumps({**good, "num_hidden_layers": 10**9}),
        json.dumps({**good, "indexer_types": ["shared"] * 4}), json.dumps({**good, "index_topk_pattern": "SFFF"}),
        '{"a": ' * 5000 + "1" + "}" * 5000]), st.text(max_size=50))


STRINGS = {
    "pool_id": POOL_IDS, "peer_pool_id": POOL_IDS,
    "key": st.sampled_from(["ka", "kb", "", "k" * 401, "ka\x00", "ключ"]),
    "lease_id": st.one_of(st.sampled_from(["", "0" * 32, "z" * 32, "x" * 5000]), st.text(max_size=40)),
    "preset": st.sampled_from(["glm-5.2", "deepseek-v3.2", "GLM-5.2", "nope", ""]),
    "hf_config_json": _hf_json(),
    "kv_cache_dtype": st.sampled_from(["", "fp8", "bf16", "fp4", "x" * 100]),
    "role": st.sampled_from(["", "target", "draft", "hisparse", "boss"]),
    "device": st.sampled_from(["", "cpu", "auto", "cuda", "tpu"]),
    "layout_digest": st.sampled_from(["", "0" * 16, "deadbeef"]),
    "name": st.text(max_size=300),
    "model_name": st.sampled_from(["GLM-5.2", "", "x" * 300, "glm\x00"]),
    "skip_mask": st.sampled_from(["SSFS", "FFFF", "F", "", "XXXX", "F" * 5000]),
    "scope": st.sampled_from(["", "tp0/2", "x" * 100]),
}


def _peer_addresses(address: str) -> st.SearchStrategy[str]:
    # only this daemon, unix paths and 127.0.0.1 (tests never talk to anything else), and garbage
    return st.sampled_from([address, "", "unix:///nonexistent/k.sock", "127.0.0.1:1", "no-port", "unix:", ":80",
                            "127.0.0.1:99999999"])


def _bytes_for(field: str) -> st.SearchStrategy[bytes]:
    if field == "page_keys":
        return st.one_of(st.sampled_from(KEYS), st.binary(max_size=70))
    return st.one_of(st.binary(max_size=300), st.builds(bytes, st.integers(0, 20000)))


def message(desc, address: str, depth: int = 0) -> st.SearchStrategy:
    """Random instances of message ``desc``: each field unset or set to a hostile value."""
    fields = []
    for f in desc.fields:
        if f.type == F.TYPE_MESSAGE:
            if depth >= 2 or f.message_type.GetOptions().map_entry:
                continue
            value = message(f.message_type, address, depth + 1)
        elif f.type in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
            value = INT64
        elif f.type in (F.TYPE_UINT64, F.TYPE_FIXED64):
            value = UINT64
        elif f.type in (F.TYPE_UINT32, F.TYPE_FIXED32):
            value = UINT32
        elif f.type in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
            value = INT32
        elif f.type == F.TYPE_ENUM:
            value = st.one_of(st.sampled_from([v.number for v in f.enum_type.values]), st.integers(-3, 9))
        elif f.type == F.TYPE_BOOL:
            value = st.booleans()
        elif f.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
            value = st.floats(width=32)
        elif f.type == F.TYPE_STRING:
            value = _peer_addresses(address) if f.name == "peer_address" else STRINGS.get(f.name, st.text(max_size=40))
        else:
            value = _bytes_for(f.name)
        if f.is_repeated:
            size = 600 if f.name in ("slots", "tgt_slots", "src_slots", "src_pages", "dst_pages", "check_pages") else 8
            value = st.lists(value, max_size=size)
        fields.append((f, st.one_of(value, value, value, st.none()) if f.name in MOSTLY_SET else st.one_of(st.none(), value)))

    def build(values):
        msg = desc._concrete_class()
        for f, v in values:
            if v is None:
                continue
            if f.is_repeated:
                getattr(msg, f.name).extend(v)
            elif f.type == F.TYPE_MESSAGE:
                getattr(msg, f.name).CopyFrom(v)
            else:
                setattr(msg, f.name, v)
        return msg

    return st.tuples(*(st.tuples(st.just(f), s) for f, s in fields)).map(build) if fields else st.just(desc._concrete_class())


# ----- the scene ---------------------------------------------------------------------------------
class Scene:
    """Pools ``victim`` (written KV, cached prefix pages) and ``scratch``, and the copy ``ka``."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.c = KVTierClient(address, timeout=20, retries=0)
        self.channel = grpc.insecure_channel(address)
        self.rebuild()

    def rebuild(self) -> None:
        c = self.c
        for p in c.list_pools():
            c.delete_pool(p.pool_id, force=True)
        c.drop("ka")
        c.drop("kb")
        c.create_pool("glm-5.2", num_layers=4, size_tokens=16 * PS, pool_id="victim")
        c.create_pool("glm-5.2", num_layers=4, size_tokens=8 * PS, pool_id="scratch")
        self.region = c.allocate_slots("victim", 2 * PS)
        g = torch.Generator().manual_seed(5)
        c.write_kv("victim", self.region, latent={x: torch.randint(0, 256, (2 * PS, 656), dtype=torch.uint8, generator=g)
                                                  for x in range(4)},
                   index={x: (torch.randint(0, 256, (2 * PS, 128), dtype=torch.uint8, generator=g), torch.rand(2 * PS, generator=g))
                          for x in (0, 1, 2)})
        copy = c.allocate_slots("victim", PS)
        c.offload("victim", "ka", copy, free_slots=True)
        lease = c.load_prefix("victim", KEYS)  # an earlier victim of the same layout may have left them in a lower tier
        n = lease.loaded_pages
        c.store_prefix(lease, KEYS[n:], lease.slots[n * PS:])
        c.release_prefix(lease)
        self.baseline = self.checksum()

    def checksum(self) -> str | None:
        """Hash of everything a rejected call must leave alone (None if the scene is broken)."""
        c = self.c
        try:
            h = hashlib.sha256()
            kv = c.read_kv("victim", self.region)
            for part in (kv.latent, kv.index_k, kv.index_scale):
                for x in sorted(part):
                    h.update(part[x].contiguous().view(torch.uint8).numpy().tobytes())
            h.update(repr(sorted((p.pool_id, p.free_pages, p.used_pages) for p in c.list_pools())).encode())
            h.update(repr([(t.tier, t.used_bytes, t.entries) for t in c.stats().tiers]).encode())
            t = c.tier_stats("victim")
            h.update(repr((t.device, c.lookup_prefix("victim", KEYS).tiers, c.where_is("victim", KEYS))).encode())
            return h.hexdigest()
        except KVTierError:
            return None

    def call(self, grpc_mod, service: str, method, request):
        """Send ``request`` (a list of messages for a client stream); returns the status code."""
        rpc = getattr(getattr(grpc_mod, f"{service}Stub")(self.channel), method.name)
        try:
            if method.client_streaming:
                rpc(iter(request), timeout=20)
            elif method.server_streaming:
                for _ in rpc(request, timeout=20):
                    pass
            else:
                rpc(request, timeout=20)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details()


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    args = ["--device", "cpu", "--host-memory", "4MiB", "--pool-memory", "64MiB", "--disk-path", str(tmp / "disk"),
            "--disk-size", "32MiB", "--log-level", "WARNING"]
    with DaemonProcess(extra_args=args) as d:
        s = Scene(d.address)
        s.codes, s.per_rpc = {}, {}
        yield s
        print(f"fuzz: {sum(s.codes.values())} inputs, statuses {dict(sorted(s.codes.items()))}, per RPC {s.per_rpc}")
        s.c.close()
        s.channel.close()
        assert d.process.poll() is None, "the daemon died under fuzzing"


@pytest.mark.parametrize("mod, grpc_mod, service, method", RPCS, ids=[m.name for *_, m in RPCS])
def test_malformed_requests_get_clean_statuses_and_change_nothing(scene, mod, grpc_mod, service, method):
    req = message(method.input_type, scene.address)
    strategy = st.lists(req, min_size=0, max_size=4) if method.client_streaming else req

    @settings(max_examples=EXAMPLES_PER_RPC, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def fuzz(request):
        code, details = scene.call(grpc_mod, service, method, request)
        scene.codes[code.name] = scene.codes.get(code.name, 0) + 1
        scene.per_rpc[method.name] = scene.per_rpc.get(method.name, 0) + 1
        assert code not in BAD_STATUS, f"{method.name} -> {code.name}: {details}\nrequest: {request!r}"[:3000]
        after = scene.checksum()
        if code != grpc.StatusCode.OK:
            assert after == scene.baseline, f"rejected {method.name} ({code.name}: {details}) changed the daemon"
        if after != scene.baseline:  # an accepted call changed things: start from a known scene again
            scene.rebuild()

    fuzz()
