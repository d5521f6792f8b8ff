"""Every error class comes back with its status code and a message, and leaves the pool unchanged.

The daemon under test has a 4 MiB host tier and a 256 MiB cap on all pools (conftest.DAEMON_ARGS).
"""

from __future__ import annotations

import resource
import time

import grpc
import pytest
import torch
from kv_helpers import NUM_LAYERS, ROW_BYTES, random_kv, verify_same

from kvtier.client import KVTierClient, KVTierError
from kvtier.client.spawn import DaemonProcess
from kvtier.v1 import pool_pb2, pool_pb2_grpc

INVALID, NOT_FOUND, EXHAUSTED, PRECONDITION, EXISTS = (
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS)


class Scene:
    """A pool with 100 written slots (pages 1-2) and an offloaded copy under key ``kept``."""

    def __init__(self, client, pool):
        self.client, self.pool = client, pool
        self.slots = client.allocate_slots(pool, 100)
        self.latent, self.index = random_kv(100, seed=11)
        client.write_kv(pool, self.slots, latent=self.latent, index=self.index)
        self.key = f"kept-{pool}"
        client.offload(pool, self.key, self.slots[:64])
        self.before = self.snapshot()

    def snapshot(self):
        info = self.client.describe_pool(self.pool)
        host = [t for t in self.client.stats().tiers if t.tier == "host"][0]
        return info.free_pages, info.used_pages, host.used_bytes, self.client.read_kv(self.pool, self.slots)

    def verify_unchanged(self):
        free, used, host, kv = self.snapshot()
        assert (free, used, host) == self.before[:3], "allocation or host tier changed"
        verify_same(kv, self.before[3])

    def close(self):
        self.client.drop(self.key)


@pytest.fixture()
def scene(client, pool):
    s = Scene(client, pool)
    yield s
    s.close()


def _n(s, k=3):
    return s.slots[:k]


CASES = {
    # INVALID_ARGUMENT: bad slots, shapes, dtypes, lengths
    "slot outside the pool": (INVALID, "outside", lambda s: s.client.write_kv(s.pool, [5000], latent={0: s.latent[0][:1]})),
    "slot on an unallocated page": (INVALID, "not allocated", lambda s: s.client.write_kv(s.pool, [640], latent={0: s.latent[0][:1]})),
    "padding slot 0": (INVALID, "not allocated", lambda s: s.client.write_kv(s.pool, [0], latent={0: s.latent[0][:1]})),
    "negative slot": (INVALID, "negative", lambda s: s.client.read_kv(s.pool, [-1])),
    "duplicate target slots": (INVALID, "duplicate", lambda s: s.client.write_kv(s.pool, [64, 64], latent={0: s.latent[0][:2]})),
    # (the client checks shapes against the pool's layout before it sends; the daemon's own byte checks
    # are tested through raw streams in test_daemon_write_new.py and the fuzz test)
    "latent rows one byte short": (INVALID, "expected (3, 656) uint8 or float8_e4m3fn rows for 3 tokens, got (3, 655) uint8", lambda s: s.client.write_kv(s.pool, _n(s), latent={1: torch.zeros(3, ROW_BYTES - 1, dtype=torch.uint8)})),
    "latent rows one byte long": (INVALID, "got (3, 657) uint8", lambda s: s.client.write_kv(s.pool, _n(s), latent={1: torch.zeros(3, ROW_BYTES + 1, dtype=torch.uint8)})),
    "float64 scales": (INVALID, "index[0] scales: expected (3,) float32 for 3 tokens, got (3,) float64", lambda s: s.client.write_kv(s.pool, _n(s), index={0: (torch.zeros(3, 128, dtype=torch.uint8), torch.ones(3, dtype=torch.float64))})),
    "latent layer out of range": (INVALID, "outside", lambda s: s.client.write_kv(s.pool, _n(s), latent={NUM_LAYERS: s.latent[0][:3]})),
    "read layer out of range": (INVALID, "outside", lambda s: s.client.read_kv(s.pool, _n(s), latent_layers=[9], index_layers=[])),
    "move lengths differ": (INVALID, "slots", lambda s: s.client.move_kv(s.pool, s.slots[:3], s.slots[3:5])),
    "free unallocated slots": (INVALID, "not allocated", lambda s: s.client.free_slots(s.pool, [700])),
    "restore into the wrong slot count": (INVALID, "holds 64 tokens", lambda s: s.client.restore(s.pool, s.key, s.slots[:10])),
    "pool size not whole pages": (INVALID, "multiple", lambda s: s.client.create_pool("glm-5.2", num_layers=2, size_tokens=1000)),
    "unknown model preset": (INVALID, "unknown model preset", lambda s: s.client.create_pool("llama", size_tokens=64)),
    "unknown role": (INVALID, "role", lambda s: s.client.create_pool("glm-5.2", num_layers=2, size_tokens=64, role="x")),
    # NOT_FOUND: unknown pools and keys
    "describe unknown pool": (NOT_FOUND, "no pool", lambda s: s.client.describe_pool("nope")),
    "write to unknown pool": (NOT_FOUND, "no pool", lambda s: s.client.write_kv("nope", [64], latent={0: s.latent[0][:1]})),
    "restore unknown key": (NOT_FOUND, "no offloaded copy", lambda s: s.client.restore(s.pool, "missing-key")),
    "delete unknown pool": (NOT_FOUND, "no pool", lambda s: s.client.delete_pool("nope")),
    # RESOURCE_EXHAUSTED: capacity
    "allocate more than is free": (EXHAUSTED, "free", lambda s: s.client.allocate_slots(s.pool, 1024)),
    "pool above the daemon's pool memory": (EXHAUSTED, "pool memory", lambda s: s.client.create_pool("glm-5.2", size_tokens=65536)),
    "memory budget below one page": (EXHAUSTED, "holds no page", lambda s: s.client.create_pool("glm-5.2", memory_budget_bytes=1000)),
    # FAILED_PRECONDITION: layout mismatches and state
    "indexer write on a skip layer": (PRECONDITION, "skips top-k", lambda s: s.client.write_kv(s.pool, _n(s), index={3: (torch.zeros(3, 128, dtype=torch.uint8), torch.ones(3))})),
    "indexer read on a skip layer": (PRECONDITION, "skips top-k", lambda s: s.client.read_kv(s.pool, _n(s), latent_layers=[], index_layers=[7])),
    "delete a pool with slots in use": (PRECONDITION, "still has", lambda s: s.client.delete_pool(s.pool)),
    # ALREADY_EXISTS
    "offload under a taken key": (EXISTS, "already", lambda s: s.client.offload(s.pool, s.key, s.slots[64:], free_slots=True)),
    "create a pool id that exists": (EXISTS, "already exists", lambda s: s.client.create_pool("glm-5.2", num_layers=2, size_tokens=64, pool_id=s.pool)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_error_status_and_pool_unchanged(scene, case):
    code, words, call = CASES[case]
    with pytest.raises(KVTierError) as err:
        call(scene)
    assert err.value.code == code, f"{case}: {err.value}"
    assert words in err.value.details, f"{case}: message {err.value.details!r} lacks {words!r}"
    scene.verify_unchanged()


def test_host_tier_full(scene):
    """An offload bigger than the 4 MiB host tier is RESOURCE_EXHAUSTED and frees nothing."""
    c, pool = scene.client, scene.pool
    rest = c.allocate_slots(pool, 1024 - 128)
    everything = torch.cat([scene.slots, rest])
    before = c.describe_pool(pool).free_pages
    with pytest.raises(KVTierError) as err:
        c.offload(pool, "too-big", everything, free_slots=True)
    assert err.value.code == EXHAUSTED and "host tier full" in err.value.details
    assert c.describe_pool(pool).free_pages == before
    c.free_slots(pool, rest)
    scene.verify_unchanged()


def test_restore_into_another_layout_is_refused(scene):
    """A copy from a skip-aware pool does not restore into a draft pool (indexer on every layer)."""
    c = scene.client
    draft = f"{scene.pool}-draft"
    c.create_pool("glm-5.2", num_layers=NUM_LAYERS, size_tokens=256, pool_id=draft, role="draft")
    try:
        with pytest.raises(KVTierError) as err:
            c.restore(draft, scene.key)
        assert err.value.code == PRECONDITION and "skip_mask" in err.value.details
        assert c.describe_pool(draft).used_pages == 0
    finally:
        c.delete_pool(draft, force=True)
    scene.verify_unchanged()


def _stalling_write(scene, stall_s: float):
    """Header, the first half of layer 0's latent bytes, then a stall (the rest would follow)."""
    n = scene.slots.numel()
    data = torch.randint(0, 256, (n * ROW_BYTES,), dtype=torch.uint8).numpy().tobytes()
    yield pool_pb2.WriteKVRequest(header=pool_pb2.KVHeader(pool_id=scene.pool, slots=scene.slots.tolist(), latent_layers=[0]))
    yield pool_pb2.WriteKVRequest(layer_id=0, component=pool_pb2.COMPONENT_LATENT, offset=0, data=data[: len(data) // 2])
    time.sleep(stall_s)
    yield pool_pb2.WriteKVRequest(layer_id=0, component=pool_pb2.COMPONENT_LATENT, offset=len(data) // 2, data=data[len(data) // 2:])


def test_deadline_mid_stream_writes_nothing(scene, daemon):
    """A WriteKV whose deadline expires half way through its stream leaves the pool as it was."""
    writes = scene.client.stats().counters["kv_writes"]
    with grpc.insecure_channel(daemon.address) as ch:
        stub = pool_pb2_grpc.PoolServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.WriteKV(_stalling_write(scene, 1.5), timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(1.2)  # let the stalled stream end on both sides
    scene.verify_unchanged()
    assert scene.client.stats().counters["kv_writes"] == writes


def test_cancelled_stream_writes_nothing(scene, daemon):
    """A WriteKV the client cancels mid-stream leaves the pool as it was."""
    with grpc.insecure_channel(daemon.address) as ch:
        fut = pool_pb2_grpc.PoolServiceStub(ch).WriteKV.future(_stalling_write(scene, 1.0), timeout=10)
        time.sleep(0.3)
        fut.cancel()
        with pytest.raises(grpc.FutureCancelledError):
            fut.result()
    time.sleep(1.0)
    scene.verify_unchanged()


def test_stream_that_ends_early_writes_nothing(scene, daemon):
    """A WriteKV stream that ends before all declared bytes arrived is INVALID_ARGUMENT and writes nothing."""
    msgs = list(_stalling_write(scene, 0.0))[:2]
    with grpc.insecure_channel(daemon.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pool_pb2_grpc.PoolServiceStub(ch).WriteKV(iter(msgs), timeout=10)
    assert err.value.code() == INVALID and "got" in err.value.details()
    scene.verify_unchanged()


def test_chunk_out_of_order_writes_nothing(scene, daemon):
    """A chunk at the wrong offset is refused; nothing of the stream is written."""
    msgs = list(_stalling_write(scene, 0.0))
    with grpc.insecure_channel(daemon.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pool_pb2_grpc.PoolServiceStub(ch).WriteKV(iter([msgs[0], msgs[2], msgs[1]]), timeout=10)
    assert err.value.code() == INVALID and "expected 0" in err.value.details()
    scene.verify_unchanged()


def _raw(daemon, method: str, payload: bytes, *, stream: bool = False):
    """Call ``method`` with ``payload`` as the request's bytes (no protobuf encoding on our side)."""
    ch = grpc.insecure_channel(daemon.address)
    try:
        ident = lambda b: b  # noqa: E731 - bytes in, bytes out
        if stream:
            call = ch.stream_unary(method, request_serializer=ident, response_deserializer=ident)
            return call(iter([payload]), timeout=30)
        return ch.unary_unary(method, request_serializer=ident, response_deserializer=ident)(payload, timeout=30)
    finally:
        ch.close()


@pytest.mark.parametrize("method,stream", [("/kvtier.v1.PoolService/ReadKV", False),
                                           ("/kvtier.v1.PoolService/CreatePool", False),
                                           ("/kvtier.v1.PoolService/WriteKV", True)])
def test_bytes_that_are_no_message_are_invalid_argument_not_internal(daemon, client, method, stream):
    """Regression (adversarial pass): b'\\xff\\xff\\xff\\xff' as a request body was gRPC's own INTERNAL
    'Exception deserializing request!' (and a traceback in the daemon's log). Unary and client-stream
    calls alike must answer INVALID_ARGUMENT, and the daemon keeps serving."""
    with pytest.raises(grpc.RpcError) as e:
        _raw(daemon, method, b"\xff\xff\xff\xff", stream=stream)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "not a valid message" in e.value.details()
    assert client.list_pools() is not None


def test_a_status_message_that_echoes_a_huge_input_keeps_its_code(client, pool):
    """Regression (adversarial pass): a 100 KB pool id echoed into the error message overflowed
    gRPC's trailing metadata, so the client saw RESOURCE_EXHAUSTED 'metadata size exceeds' instead of
    the real NOT_FOUND. The message is cut to 1,024 characters, the code kept."""
    with pytest.raises(KVTierError) as e:
        client.read_kv("p" * 100_000, [0])
    assert e.value.code == grpc.StatusCode.NOT_FOUND, e.value.details[:200]
    assert len(e.value.details) <= 1024
    assert e.value.details.startswith("no pool 'ppp") and "characters left out" in e.value.details


ROW1K_MODEL = {"model_type": "row1k", "num_hidden_layers": 8, "kv_lora_rank": 448, "qk_rope_head_dim": 64,
               "index_head_dim": 128}  # bf16: 1024-byte latent rows, so a 1 MiB message holds 1,024 rows


def _vm_data(pid: int) -> int:
    """The process's private writable memory now (``VmData``, what ``RLIMIT_DATA`` caps), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))


def test_read_kv_whose_copy_out_cannot_get_memory_is_resource_exhausted_mid_stream():
    """A ReadKV of 255 MiB (8 layers of 32,704 bf16 1 KiB rows) on a daemon whose host tier (1 MiB)
    cannot hold the copy and whose memory is then capped (``RLIMIT_DATA`` at its use now + 64 MiB: a
    machine out of memory). The reader takes the first message, then reads no more; a MoveKV (the
    pool's exclusive lock) returns only once the worker has let the shared lock go, i.e. after it
    tried to copy the rest off the pool: that fresh host block cannot be allocated. The stream must
    end RESOURCE_EXHAUSTED naming host memory after the messages sent (it was INTERNAL: torch's
    allocator raises a plain RuntimeError), the first message must carry the rows written, and the
    pool must serve writes and reads again once memory is back."""
    n, mib = 32768 - 64, 1 << 20
    with DaemonProcess(extra_args=["--device", "cpu", "--host-memory", "1MiB", "--log-level", "WARNING"]) as d, \
            KVTierClient(d.address) as c:
        c.create_pool(ROW1K_MODEL, kv_cache_dtype="bf16", size_tokens=n + 64, pool_id="big")
        slots = c.allocate_slots("big", n)
        rows = torch.randint(0, 256, (1024, 1024), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
        c.write_kv("big", slots[:1024], latent={0: rows})
        pid = d.process.pid
        soft, hard = resource.prlimit(pid, resource.RLIMIT_DATA)
        cap = _vm_data(pid) + 64 * mib  # room for the messages in flight, not for the ~240 MiB left to copy
        resource.prlimit(pid, resource.RLIMIT_DATA, (cap, hard))
        try:
            with grpc.insecure_channel(d.address) as ch:
                header = pool_pb2.KVHeader(pool_id="big", slots=slots.tolist(), latent_layers=list(range(8)))
                stream = pool_pb2_grpc.PoolServiceStub(ch).ReadKV(
                    pool_pb2.ReadKVRequest(header=header, chunk_bytes=mib, packed=True), timeout=120)
                first = next(stream)
                assert first.offset == 0 and first.data == rows.numpy().tobytes()
                assert c.move_kv("big", slots[1024:1025], slots[1025:1026]) == 1  # the shared lock was let go
                got = 1
                with pytest.raises(grpc.RpcError) as err:
                    for _ in stream:
                        got += 1
        finally:
            resource.prlimit(pid, resource.RLIMIT_DATA, (soft, hard))
        assert err.value.code() == EXHAUSTED, err.value.details()
        assert "host memory" in err.value.details()
        assert 1 < got < n * 8 // 1024  # it failed after the first message, before the last
        back = c.read_kv("big", slots[:1024], latent_layers=[0], index_layers=[])
        assert bytes(back.latent[0].contiguous().view(torch.uint8).reshape(-1).numpy()) == rows.numpy().tobytes()
        c.write_kv("big", slots[:1], latent={0: rows[:1]})
        assert c.delete_pool("big", force=True) is not None


@pytest.mark.parametrize("bad", ["a\nFAKE line", "b\x1b[31mred", "d\x00e", "\x1b]0;pwned\x07"])
def test_names_with_control_characters_are_refused(client, bad):
    """Attack pass 6, A6-10: pool ids and offload keys took control characters, and ``kvtier status``
    and the metrics page (every tenant's pool ids) printed them raw to an operator's terminal."""
    with pytest.raises(KVTierError) as err:
        client.create_pool("glm-5.2", num_layers=2, size_tokens=64, pool_id=bad)
    assert err.value.code == INVALID and "pool_id must be printable characters" in err.value.details
    assert bad not in [p.pool_id for p in client.list_pools()]
    pool = client.create_pool("glm-5.2", num_layers=2, size_tokens=64).pool_id
    try:
        slots = client.allocate_slots(pool, 64)
        with pytest.raises(KVTierError) as err:
            client.offload(pool, bad, slots)
        assert err.value.code == INVALID and "offload key must be printable characters" in err.value.details
        client.free_slots(pool, slots)
    finally:
        client.delete_pool(pool, force=True)
