"""The pool registry in process: sizes validated before anything loops or allocates, pool ids per
tenant, the pool quota, and allocation that evicts unpinned prefix-cache pages."""

from __future__ import annotations

import json

import pytest
from daemonkit import A, B, PS, daemon, fill, keys, pool, store_prefix

from kvtier.server.daemon.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from kvtier.server.daemon.pools import PoolRequest, parse_hf_config
from kvtier.server.daemon.quotas import Quota, Quotas


@pytest.fixture
def d():
    dm = daemon(host_memory_bytes=8 << 20)
    yield dm
    dm.close()


@pytest.mark.parametrize("req, match", [
    (PoolRequest(pool_id="x", preset="glm-5.2", num_layers=4294967295, size_tokens=64), "exceeds the model's 78 layers"),
    (PoolRequest(pool_id="x", preset="glm-5.2", num_layers=79, size_tokens=64), "num_layers 79 exceeds the model's 78 layers"),
    (PoolRequest(pool_id="x", hf_config={"num_hidden_layers": 10**9, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
                 size_tokens=64), "num_hidden_layers must be an integer in 1..4096"),
    (PoolRequest(pool_id="x", hf_config={"num_hidden_layers": 4, "kv_lora_rank": 2**40, "qk_rope_head_dim": 64},
                 size_tokens=64), "kv_lora_rank must be an integer in 1..65536, got 1099511627776"),
    (PoolRequest(pool_id="x", preset="glm-5.2", size_tokens=2**63), "size_tokens must be at most"),
    (PoolRequest(pool_id="x" * 500, preset="glm-5.2", size_tokens=64), "pool_id must be at most"),
])
def test_absurd_sizes_fail_fast_and_allocate_nothing(d, req, match):
    """Regression (issue 8, defect 3): CreatePool with num_layers=4294967295, or an HF config with
    num_hidden_layers=10**9, looped over every layer at 100% CPU and grew memory by GBs; num_layers
    above the model's layer count was accepted. Every size is checked before any loop or allocation."""
    with pytest.raises(InvalidArgument, match=match):
        d.pools.create(A, req)
    assert d.pools.list() == []


def test_deeply_nested_hf_config_json_is_invalid_argument():
    """Regression (issue 8, defect 8): a deeply nested hf_config_json raised RecursionError (INTERNAL)."""
    with pytest.raises(InvalidArgument, match="nests too deeply"):
        parse_hf_config("[" * 200_000 + "]" * 200_000)
    assert parse_hf_config(json.dumps({"a": [[[1]]]})) == {"a": [[[1]]]}


def test_pool_ids_are_per_tenant_and_others_are_not_found_like_absent_ones(d):
    pool(d, A, "p")
    pool(d, B, "p")  # the same id in another tenant is another pool
    with pytest.raises(AlreadyExists):
        pool(d, A, "p")
    assert [e.tenant for e in d.pools.list()] == ["team-a", "team-b"]
    assert [e.pool_id for e in d.pools.list(A)] == ["p"] and d.pools.get(A, "p") is not d.pools.get(B, "p")
    pool(d, A, "only-a")
    with pytest.raises(NotFound) as other:
        d.pools.get(B, "only-a")
    with pytest.raises(NotFound) as absent:
        d.pools.get(B, "nowhere")
    assert str(other.value).replace("only-a", "X") == str(absent.value).replace("nowhere", "X")
    with pytest.raises(NotFound):
        d.pools.delete(B, "only-a", force=True)
    assert d.pools.get(A, "only-a").deleted is False


def test_the_pool_quota_names_the_tenant_and_counts_only_its_pools():
    dm = daemon(host_memory_bytes=0, quotas=Quotas({"team-a": Quota(pool_bytes=3 << 20)}))
    try:
        one = pool(dm, A, "p1", tokens=256)  # 4 layers x 256 tokens: about 0.8 MB
        per = one.pool.get_kv_size_bytes()
        n = (3 << 20) // per
        for i in range(2, n + 1):
            pool(dm, A, f"p{i}", tokens=256)
        with pytest.raises(ResourceExhausted, match=r"pool quota of tenant 'team-a'.*3145728-byte pool_bytes quota"):
            pool(dm, A, "one-too-many", tokens=256)
        pool(dm, B, "b", tokens=256)  # team-b has no quota
        dm.pools.delete(A, "p1")
        pool(dm, A, "fits-again", tokens=256)
    finally:
        dm.close()


def test_allocation_evicts_unpinned_prefix_cache_pages(d):
    """Regression (issue 8, defect 5): AllocateSlots and Restore answered RESOURCE_EXHAUSTED while the
    pool was full of unpinned prefix-cache pages. They now evict them (LRU, down the stack) as
    LoadPrefix does; pinned pages stay."""
    pool(d, A, "p", tokens=8 * PS)
    ks = keys(8)
    store_prefix(d, A, "p", ks[:4], seed=1)
    store_prefix(d, A, "p", ks[4:], seed=2)
    assert d.pools.get(A, "p").allocator.free_pages == 0
    slots, _ = fill(d, A, "p", 3 * PS, seed=3)  # three pages: the three least recently used cached pages go down
    assert d.tiers.where_is(A, "p", ks) == [["host"]] * 3 + [["device"]] * 5
    lease = d.tiers.load(A, "p", ks[3:8], None)  # pins the five cached pages
    with pytest.raises(ResourceExhausted, match="need 1 pages, 0 are free"):
        fill(d, A, "p", 1, seed=4)
    d.tiers.release(A, "p", lease.lease)
    from kvtier.server.daemon import kv_ops

    kv_ops.offload(d.pools, d.offload_store, A, "p", "copy", slots, free_slots=True)
    fill(d, A, "p", 3 * PS, seed=5)  # fills the three freed pages again
    back, _ = kv_ops.restore(d.pools, d.offload_store, A, "p", "copy", None, drop=True)  # evicts three cached pages
    assert back.numel() == 3 * PS and d.tiers.where_is(A, "p", ks[3:6]) == [["host"]] * 3


def test_deleting_a_pool_under_a_write_in_place_says_the_pages_cannot_be_freed_yet(d):
    """DeletePool without force while a WriteKV into named slots (page 1) is in flight: the refusal said
    "free them or force", yet freeing them is refused while the write claims them; it now counts the
    page as being written by a write still arriving, so the operator knows to wait or force."""
    from kvtier.server.daemon import kv_write
    from kvtier.server.daemon.errors import FailedPrecondition
    from kvtier.server.daemon.kv_ops import KVSelection

    pool(d, A)
    slots, _ = fill(d, A, "p", PS, seed=1)
    buf = kv_write.begin_write(d.pools, A, KVSelection("p", slots.tolist(), (0,), ()))
    assert buf.claimed
    with pytest.raises(FailedPrecondition, match=r"1 pages allocated \(1 of them being written in place by a "
                                                 r"WriteKV still arriving: wait for it to end\)"):
        d.delete_pool(A, "p")
    kv_write.abort_claimed(d.pools, A, buf)


def test_a_delete_whose_caller_gave_up_while_it_waited_deletes_nothing():
    """Attack pass 5, A5-7: a DeletePool(force) that passed its deadline while another call held the
    pool went on once the lock was free: the pool, and every writer's pages in it, were gone though
    its caller was told the call failed. Checked once the pool's lock is held, it changes nothing."""
    from kvtier.server.daemon import Daemon, DaemonConfig
    from kvtier.server.daemon.errors import Cancelled
    from kvtier.server.daemon.pools import PoolRequest
    from kvtier.server.daemon.tenants import Caller

    d = Daemon(DaemonConfig(device="cpu"))
    me = Caller.default()
    d.pools.create(me, PoolRequest(pool_id="p", preset="glm-5.2", num_layers=2, size_tokens=256))
    with d.pools.locked(me, "p", exclusive=True) as e:
        e.alloc(64)
    with pytest.raises(Cancelled, match="DeletePool .* while it waited; nothing was changed"):
        d.delete_pool(me, "p", force=True, wanted=lambda: False)
    assert d.pools.get(me, "p").allocator.used_pages == 1
    assert d.delete_pool(me, "p", force=True) > 0
    d.close()


@pytest.mark.parametrize("true_answers", [0, 1])
def test_a_create_whose_caller_gave_up_creates_nothing(d, true_answers):
    """Attack pass 7, A7-5: a CreatePool told DEADLINE_EXCEEDED still created its pool (with a random
    id, every retry of the "failed" call made one more, each holding memory and quota). The caller
    is checked under the registry's lock before the reservation (0: gone from the start) and right
    before the pool becomes visible (1: gone while the pool was allocated)."""
    from kvtier.server.daemon.errors import Cancelled

    answers = iter([True] * true_answers + [False] * 10)
    with pytest.raises(Cancelled, match="CreatePool .*cancelled or ran past its deadline"):
        d.pools.create(A, PoolRequest(pool_id="p", preset="glm-5.2", num_layers=2, size_tokens=256),
                       wanted=lambda: next(answers))
    assert d.pools.list() == [] and d.pools._reserved == {}
    with pytest.raises(NotFound):
        d.pools.get(A, "p")
    assert pool(d, A, "p").pool_id == "p"  # the id and its bytes are free again


_HF = '{"num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128, %s}'


@pytest.mark.parametrize(("field", "value", "words"), [
    *[(f, v, "is not a number an HF config may hold") for f in ("kv_lora_rank", "qk_rope_head_dim", "index_head_dim")
      for v in ("Infinity", "-Infinity", "NaN")],
    *[(f, v, f"{f} must be an integer in 1..65536, got {shown}")
      for f in ("kv_lora_rank", "qk_rope_head_dim", "index_head_dim")
      for v, shown in (("1e400", "inf"), ("-1e400", "-inf"), ("512.5", "512.5"), ("true", "True"), ('"8"', "'8'"),
                       ("-1", "-1"), ("99999999999999999999", "99999999999999999999"))],
    ("index_head_dim", "null", "index_head_dim must be an integer in 1..65536, got None"),
    ("kv_lora_rank", "null", "HF config lacks required field 'kv_lora_rank'"),
    ("index_topk_freq", "true", "index_topk_freq must be an integer in 1..4096, got True"),
    ("index_topk_freq", "99999999999999999999", "index_topk_freq must be an integer in 1..4096, got 99999999999999999999"),
    ("index_skip_topk_offset", "1.5", "index_skip_topk_offset must be an integer in 1..4096, got 1.5"),
    ("cli_factor", "true", "cli_factor must be an integer in 1..4096, got True"),
    ("model_type", "5", "model_type must be a string, got 5"),
    ("x", "1" + "0" * 5000, "Exceeds the limit (4300 digits)"),
])
def test_odd_numbers_in_an_hf_config_are_invalid_argument_naming_the_field(d, field, value, words):
    """Attack pass 7, A7-8: Infinity or 1e400 in an HF config gave INTERNAL (``int(inf)``: OverflowError,
    which ``build_model`` did not catch) and a traceback; a string size, ``true`` or 10^20 for
    ``index_topk_freq`` and any JSON value as ``model_type`` were taken; a 5001-digit number was a
    ValueError ``parse_hf_config`` did not catch. Each is INVALID_ARGUMENT naming the field, and no pool
    is made."""
    text = _HF % f'"{field}": {value}'
    with pytest.raises(InvalidArgument) as info:
        d.pools.create(A, PoolRequest(pool_id="x", hf_config=parse_hf_config(text), size_tokens=64))
    assert words in str(info.value) and "\n" not in str(info.value)
    assert d.pools.list() == []


def test_a_start_pool_from_a_config_json_with_infinity_is_a_one_line_error(tmp_path):
    """Attack pass 7, A7-8: a ``[[pools]]`` model naming a config.json with ``1e400`` ended the start in
    a traceback."""
    from kvtier.server.daemon import Daemon, DaemonConfig, PoolSpec

    path = tmp_path / "inf.json"
    path.write_text('{"num_hidden_layers": 4, "kv_lora_rank": 1e400, "qk_rope_head_dim": 64}')
    dm = Daemon(DaemonConfig(device="cpu", host_memory_bytes=8 << 20, pools=(PoolSpec(model=str(path), tokens=64),)))
    try:
        with pytest.raises(InvalidArgument, match=r"kv_lora_rank must be an integer in 1\.\.65536, got inf"):
            dm.create_configured_pools()
        assert dm.pools.list() == []
    finally:
        dm.close()


ESC = "\x1b]0;pwned\x07\x1b[2J\x1b[31mFAKE"


@pytest.mark.parametrize("req", [
    PoolRequest(pool_id="x", hf_config={"num_hidden_layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
                model_name=ESC, size_tokens=64),
    PoolRequest(pool_id="x", hf_config={"num_hidden_layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                        "model_type": ESC}, size_tokens=64),
    PoolRequest(pool_id="x", hf_config={"num_hidden_layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                        "model_type": "m" * 257}, size_tokens=64),
])
def test_a_model_name_with_control_characters_or_too_long_is_refused(d, req):
    """Attack pass 7, A7-9: a model name (ModelSpec.name, or an HF config's model_type) could hold
    terminal escapes, which ``kvtier status`` and ``kvtier pools`` printed raw; a model_type of any
    length was taken (only ModelSpec.name had the 256-character bound). The rule A6-10 gave pool ids."""
    with pytest.raises(InvalidArgument, match=r"model name .*(must be printable characters|at most 256 characters)"):
        d.pools.create(A, req)
    assert d.pools.list() == []
