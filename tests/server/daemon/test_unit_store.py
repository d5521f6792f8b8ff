"""The unit store in process: a page's KV part and indexer part are one record, whatever order they come in.

Geometry: GLM-5.2's pipeline stage of layers 20-23 (fp8, 656-byte rows; layer 20 skips top-k, 22
runs it, so one live indexer layer of 8448 bytes a page). Expected bytes are built here from seeds,
and the record's layout is checked against an independent slice of the record format.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.server.daemon.errors import Cancelled, InvalidArgument
from kvtier.server.daemon.tenants import Caller
from kvtier.server.daemon.unit_settings import UnitSettings
from kvtier.server.daemon.unit_space import SpaceRequest
from kvtier.server.daemon.unit_store import UnitStore
from kvtier.server.model_config import DSAModelConfig
from kvtier.server.tiers import HostTierConfig, TierStack

PS = 64
MODEL = DSAModelConfig.from_preset("glm-5.2", start_layer=20, end_layer=24)
LIVE = [i for i, s in enumerate(MODEL.skip_topk_layers) if not s]
KV_BYTES = 4 * PS * 656
IDX_BYTES = len(LIVE) * 8448
ME, OTHER = Caller("team-a"), Caller("team-b")


def space_req(**over):
    fp = MODEL.fingerprint()
    fields = dict(model_name=fp["name"], num_layers=4, start_layer=20, kv_lora_rank=512, qk_rope_head_dim=64,
                  index_head_dim=128, kv_cache_dtype="fp8", page_size=PS, latent_row_bytes=656,
                  skip_mask=fp["skip_mask"], with_index=True, scope="")
    fields.update(over)
    return SpaceRequest(**fields)


def parts(seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (KV_BYTES,), dtype=torch.uint8, generator=g),
            torch.randint(0, 256, (IDX_BYTES,), dtype=torch.uint8, generator=g))


def store(host_pages: int = 16, **settings) -> UnitStore:
    page_rec = 4096 + KV_BYTES + IDX_BYTES + 8 * PS
    return UnitStore(TierStack.from_configs([HostTierConfig(capacity_bytes=host_pages * page_rec)]), UnitSettings(**settings))


def read_all(s, caller, space, keys, part):
    return {i: v.clone() for i, v in s.read(caller, space, keys, part)}


def test_parts_in_either_order_make_one_record_visible_only_when_whole():
    s = store()
    sp = s.space(space_req())
    assert MODEL.fingerprint()["skip_mask"] == "SSFS" and LIVE == [2]  # GLM-5.2 runs top-k on 22 only, of 20-23
    keys = [b"k0", b"k1", b"k2"]
    data = [parts(i) for i in range(3)]
    # k0: index first (as SGLang writes), k1: KV first, k2: both in one call
    r = s.put(ME, sp, keys[:2], "index", torch.cat([data[0][1], data[1][1]]))
    assert r.accepted == [True, True] and r.completed == 0 and r.pending == 2
    assert s.exists(ME, sp, keys) == 0 and read_all(s, ME, sp, keys, "both") == {}
    r = s.put(ME, sp, [b"k1", b"k0"], "kv", torch.cat([data[1][0], data[0][0]]))
    assert r.completed == 2 and r.pending == 0
    assert s.exists(ME, sp, keys) == 2
    s.put(ME, sp, [b"k2"], "both", torch.cat(data[2]))
    assert s.exists(ME, sp, keys) == 3
    got = read_all(s, ME, sp, keys, "both")
    for i in range(3):
        assert torch.equal(got[i], torch.cat(data[i]))
    assert torch.equal(read_all(s, ME, sp, [b"k1"], "index")[0], data[1][1])
    assert torch.equal(read_all(s, ME, sp, [b"k1"], "kv")[0], data[1][0])
    # the stored record is kvtier's one-page record: latent (layers, 64, 656) then index (live, 1, 8448)
    (tier,) = s.stack.tiers
    with tier.borrow([list(tier.index.keys())[0]]) as (rec,):
        latent, index, src = sp.codec.payload(rec, PS, 1)
        assert tuple(latent.shape) == (4, PS, 656) and tuple(index.shape) == (len(LIVE), 1, 8448)
        assert torch.equal(src, torch.arange(PS))


def test_other_tenant_and_other_stage_see_nothing():
    s = store()
    sp = s.space(space_req())
    s.put(ME, sp, [b"k"], "both", torch.cat(parts(1)))
    assert s.exists(ME, sp, [b"k"]) == 1
    assert s.exists(OTHER, sp, [b"k"]) == 0 and read_all(s, OTHER, sp, [b"k"], "both") == {}
    other_stage = s.space(space_req(start_layer=24, skip_mask=DSAModelConfig.from_preset(
        "glm-5.2", start_layer=24, end_layer=28).fingerprint()["skip_mask"]))
    assert s.exists(ME, other_stage, [b"k"]) == 0
    assert s.exists(ME, s.space(space_req(scope="tp1/2")), [b"k"]) == 0


def test_half_units_time_out_and_are_never_counted():
    s = store(pending_seconds=0.5)
    now = [0.0]
    s.pending._clock = lambda: now[0]
    sp = s.space(space_req())
    kv, idx = parts(3)
    s.put(ME, sp, [b"a"], "kv", kv)
    assert s.stats(ME)["parts_pending"] == 1
    now[0] = 1.0                      # past the timeout: the KV part is dropped
    s.put(ME, sp, [b"a"], "index", idx)
    assert s.exists(ME, sp, [b"a"]) == 0
    st = s.stats(ME)
    assert st["partial_expired"] == 1 and st["parts_pending"] == 1 and st["pending_bytes"] == IDX_BYTES


def test_pending_budget_drops_oldest():
    rec_bytes = UnitStore(TierStack([])).space(space_req()).codec.page_nbytes()
    s = store(pending_bytes=2 * rec_bytes + 3 * IDX_BYTES)  # two waiting KV parts (and index parts)
    sp = s.space(space_req())
    for k in (b"a", b"b", b"c"):
        s.put(ME, sp, [k], "kv", parts(0)[0])
    st = s.stats(ME)
    assert st["partial_evicted"] == 1 and st["parts_pending"] == 2
    s.put(ME, sp, [b"a", b"b", b"c"], "index", torch.cat([parts(0)[1]] * 3))
    assert [s.exists(ME, sp, [k]) for k in (b"a", b"b", b"c")] == [0, 1, 1]


def test_eviction_removes_both_parts():
    s = store(host_pages=2)
    sp = s.space(space_req())
    for k in (b"a", b"b", b"c"):   # the host tier holds two units: "a" is evicted (no tier below)
        s.put(ME, sp, [k], "both", torch.cat(parts(ord(k))))
    assert s.exists(ME, sp, [b"a"]) == 0 and read_all(s, ME, sp, [b"a"], "index") == {}
    assert read_all(s, ME, sp, [b"a"], "kv") == {}
    assert s.exists(ME, sp, [b"b", b"c"]) == 2


def test_bad_input_changes_nothing():
    s = store()
    sp = s.space(space_req())
    with pytest.raises(InvalidArgument):
        s.space(space_req(latent_row_bytes=576))
    with pytest.raises(InvalidArgument):
        s.space(space_req(skip_mask="FFF"))
    with pytest.raises(InvalidArgument):
        s.space(space_req(kv_cache_dtype="fp4"))
    with pytest.raises(InvalidArgument):
        s.put(ME, sp, [b"a"], "kv", torch.zeros(KV_BYTES + 1, dtype=torch.uint8))
    p = s.begin_put(ME, sp, [b"a"], "kv")
    p.add(torch.zeros(KV_BYTES - 1, dtype=torch.uint8))
    with pytest.raises(InvalidArgument):
        p.commit()
    for keys in ([b""], [b"x" * 257], [b"a", b"a"]):
        with pytest.raises(InvalidArgument):
            s.begin_put(ME, sp, keys, "kv")
    with pytest.raises(InvalidArgument):
        s.space(space_req(with_index=False)).check_part("index")
    assert s.stats(ME)["parts_pending"] == 0 and len(s.stack.tiers[0].index) == 0


def test_clear_removes_units_and_waiting_parts_of_one_space():
    s = store()
    sp, other = s.space(space_req()), s.space(space_req(scope="tp1/2"))
    s.put(ME, sp, [b"a"], "both", torch.cat(parts(1)))
    s.put(ME, sp, [b"b"], "kv", parts(2)[0])
    s.put(ME, other, [b"a"], "both", torch.cat(parts(1)))
    assert s.clear(ME, sp) == 2
    assert s.exists(ME, sp, [b"a"]) == 0 and s.exists(ME, other, [b"a"]) == 1


def test_a_put_whose_caller_is_gone_once_it_holds_the_clear_guard_stores_nothing():
    """Attack pass 6, A6-5: a PutUnits told DEADLINE_EXCEEDED while it waited behind a ClearUnits
    still stored its unit (and a lone part stayed waiting). The commit checks its caller once it
    holds the clear guard: a whole unit and a first part alike leave nothing behind, and the same
    puts with the caller there are stored."""
    s = store()
    sp = s.space(space_req())
    kv, idx = parts(5)
    for keys, part, data in (([b"whole"], "both", torch.cat((kv, idx))), ([b"half"], "kv", kv)):
        p = s.begin_put(ME, sp, keys, part)
        p.add(data)
        with pytest.raises(Cancelled):
            p.commit(lambda: False)
    assert s.exists(ME, sp, [b"whole"]) == 0 and s.stats(ME)["parts_pending"] == 0
    s.put(ME, sp, [b"whole"], "both", torch.cat((kv, idx)))
    s.put(ME, sp, [b"half"], "kv", kv)
    assert s.exists(ME, sp, [b"whole"]) == 1 and s.stats(ME)["parts_pending"] == 1


def test_a_put_whose_caller_left_while_its_tier_writes_ran_is_taken_back():
    """Attack pass 8, A8-11: with write-through and no write-behind a PutUnits commits to LMDB inside
    the put, after its caller check, so one told DEADLINE_EXCEEDED (4 of 4 in the attack) was stored.
    The commit checks its caller again once the tier writes are done: a caller gone by then is told
    Cancelled and the put is taken back. A whole unit is removed; a part that completed a unit with
    this writer's earlier part leaves that earlier part waiting again (a later put of the missing
    part completes the unit, byte-exact); a lone part is withdrawn. The same puts with the caller
    there are stored."""
    s = store()
    sp = s.space(space_req())
    kv, idx = parts(7)
    gone_after_writes = lambda: iter([True, False]).__next__  # noqa: E731 - checked before, then after the writes
    p = s.begin_put(ME, sp, [b"whole"], "both")
    p.add(torch.cat((kv, idx)))
    with pytest.raises(Cancelled):
        p.commit(gone_after_writes())
    assert s.exists(ME, sp, [b"whole"]) == 0 and s.stats(ME).get("units_stored", 0) == 0

    s.put(ME, sp, [b"pair"], "kv", kv)  # the earlier part, from the same writer
    p = s.begin_put(ME, sp, [b"pair"], "index")
    p.add(idx)
    with pytest.raises(Cancelled):
        p.commit(gone_after_writes())
    assert s.exists(ME, sp, [b"pair"]) == 0 and s.stats(ME)["parts_pending"] == 1  # the KV part waits again

    p = s.begin_put(ME, sp, [b"lone"], "kv")
    p.add(kv)
    with pytest.raises(Cancelled):
        p.commit(gone_after_writes())
    assert s.stats(ME)["parts_pending"] == 1  # only the pair's KV part: the lone part was withdrawn

    assert s.put(ME, sp, [b"pair"], "index", idx).completed == 1
    s.put(ME, sp, [b"whole"], "both", torch.cat((kv, idx)))
    assert s.exists(ME, sp, [b"whole"]) == 1 and s.exists(ME, sp, [b"pair"]) == 1
    for key in (b"whole", b"pair"):
        assert torch.equal(read_all(s, ME, sp, [key], "both")[0], torch.cat((kv, idx)))
    assert s.stats(ME)["parts_pending"] == 0


def test_a_unit_read_from_disk_comes_back_up_to_the_host_tier(tmp_path):
    from kvtier.server.tiers import DiskTierConfig

    page_rec = UnitStore(TierStack([])).space(space_req()).codec.page_nbytes()
    stack = TierStack.from_configs([HostTierConfig(capacity_bytes=2 * page_rec),
                                    DiskTierConfig(path=str(tmp_path / "d"), capacity_bytes=64 << 20)])
    for t in stack.tiers:
        if hasattr(t, "open"):
            t.open()
    try:
        s = UnitStore(stack)
        sp = s.space(space_req())
        units = {k: torch.cat(parts(i)) for i, k in enumerate((b"a", b"b", b"c"))}
        for k, v in units.items():
            s.put(ME, sp, [k], "both", v)
        tkey = s._space_prefix(ME, sp) + b"a"
        assert stack.where([tkey]) == [["disk"]]              # evicted from host to disk by b and c
        assert torch.equal(read_all(s, ME, sp, [b"a"], "both")[0], units[b"a"])
        assert "host" in stack.where([tkey])[0] and stack.moves["disk->host"]["count"] == 1
    finally:
        stack.close()


def test_a_full_pending_table_refuses_a_tenants_part_rather_than_drop_anothers():
    """Scenario (adversarial finding 16): the table's budget was shared oldest-first, so one tenant's
    new parts dropped another tenant's waiting ones. Now, with the table full of ME's waiting parts,
    OTHER's part is not accepted (nothing of ME's is dropped); OTHER's second part replaces nothing of
    ME's either; ME's units all complete."""
    rec_bytes = UnitStore(TierStack([])).space(space_req()).codec.page_nbytes()
    s = store(pending_bytes=3 * rec_bytes)
    sp = s.space(space_req())
    for k in (b"a", b"b", b"c"):
        assert s.put(ME, sp, [k], "kv", parts(1)[0]).accepted == [True]
    r = s.put(OTHER, sp, [b"x"], "kv", parts(2)[0])
    assert r.accepted == [False] and r.pending == 0
    assert s.stats(ME)["parts_pending"] == 3 and s.stats(OTHER)["parts_pending"] == 0
    assert s.put(ME, sp, [b"a", b"b", b"c"], "index", torch.cat([parts(1)[1]] * 3)).completed == 3
    assert s.put(OTHER, sp, [b"x"], "kv", parts(2)[0]).accepted == [True]   # room again once ME's left


def test_a_tenants_waiting_parts_stay_within_its_host_quota():
    """A tenant's waiting parts are capped by its ``host_bytes`` quota: past it the tenant's own
    oldest waiting part is dropped (another tenant's never)."""
    from kvtier.server.daemon.quotas import Quota, Quotas

    rec_bytes = UnitStore(TierStack([])).space(space_req()).codec.page_nbytes()
    stack = TierStack.from_configs([HostTierConfig(capacity_bytes=16 * (rec_bytes + 4096))])
    s = UnitStore(stack, UnitSettings(), Quotas({"team-b": Quota(host_bytes=2 * rec_bytes)}))
    sp = s.space(space_req())
    s.put(ME, sp, [b"m"], "index", parts(3)[1])
    for k in (b"x", b"y", b"z"):
        s.put(OTHER, sp, [k], "kv", parts(4)[0])
    assert s.stats(OTHER)["parts_pending"] == 2 and s.stats(OTHER)["pending_bytes"] == 2 * rec_bytes
    assert s.stats(ME)["parts_pending"] == 1
    assert s.put(OTHER, sp, [b"x"], "index", parts(4)[1]).completed == 0        # its oldest made room
    assert s.put(OTHER, sp, [b"z"], "index", parts(4)[1]).completed == 1
    assert s.put(ME, sp, [b"m"], "kv", parts(3)[0]).completed == 1


@pytest.fixture
def host_and_disk(tmp_path):
    """A unit store over a host tier of 2 units and a disk tier."""
    from kvtier.server.tiers import DiskTierConfig

    page_rec = UnitStore(TierStack([])).space(space_req()).codec.page_nbytes()
    stack = TierStack.from_configs([HostTierConfig(capacity_bytes=2 * page_rec),
                                    DiskTierConfig(path=str(tmp_path / "d"), capacity_bytes=64 << 20)])
    yield UnitStore(stack)
    stack.close()


def test_a_unit_cleared_while_a_read_takes_it_from_disk_does_not_come_back(host_and_disk):
    """Regression (attack pass F8): a GetUnits that had a unit from the disk tier in hand put it back
    into the host tier after handing it on -- after a ClearUnits that came meanwhile, so the cleared
    unit was found again (SGLang's flush_cache relies on the clear). The read is suspended with the
    unit in hand (a generator, as the stream is), the clear runs, the read goes on: nothing of the
    space is found afterwards, in any tier."""
    s = host_and_disk
    sp = s.space(space_req())
    for i, k in enumerate((b"a", b"b", b"c")):
        s.put(ME, sp, [k], "both", torch.cat(parts(i)))
    tkey = s._space_prefix(ME, sp) + b"a"
    assert s.stack.where([tkey]) == [["disk"]]
    reading = s.read(ME, sp, [b"a"], "both")
    i, view = next(reading)  # the unit, borrowed from disk; its promotion comes when the read goes on
    assert i == 0 and torch.equal(view, torch.cat(parts(0)))
    assert s.clear(ME, sp) == 3
    assert list(reading) == []
    assert s.exists(ME, sp, [b"a"]) == 0 and s.stack.where([tkey]) == [[]], "the cleared unit came back"
    assert read_all(s, ME, sp, [b"a"], "both") == {}


def test_a_put_whose_other_half_waited_before_a_clear_does_not_bring_it_back(host_and_disk, monkeypatch):
    """The sibling in PutUnits: the KV part of ``a`` waits (its indexer part to come) when a clear of
    the space begins; the indexer part's commit had taken the waiting part out of the table just
    before, and its write into the tiers is held. The clear must not end with a unit made of a part
    from before it: it waits for the commit and removes the unit, so nothing is found afterwards."""
    s = host_and_disk
    sp = s.space(space_req())
    kv, idx = parts(1)
    assert s.put(ME, sp, [b"a"], "kv", kv).pending == 1
    in_put, go = threading.Event(), threading.Event()
    put = s.stack.put

    def held_put(*a, **kw):
        in_put.set()
        assert go.wait(30)
        return put(*a, **kw)

    monkeypatch.setattr(s.stack, "put", held_put)
    committer = threading.Thread(target=lambda: s.put(ME, sp, [b"a"], "index", idx), daemon=True)
    committer.start()
    assert in_put.wait(30)  # the two parts are one record now, not yet in a tier
    cleared: list = []
    clearer = threading.Thread(target=lambda: cleared.append(s.clear(ME, sp)), daemon=True)
    clearer.start()
    clearer.join(0.5)  # waits for the commit (before: cleared nothing and answered)
    go.set()
    committer.join(30)
    clearer.join(30)
    assert not committer.is_alive() and not clearer.is_alive()
    assert s.exists(ME, sp, [b"a"]) == 0, "a unit made of a part from before the clear came back"
    assert cleared == [1]


def test_parts_pair_only_within_one_writer():
    """Attack pass 4, A4-8: two writers of one key (A's index, B's index, A's KV, B's KV, as two SGLang
    servers backing up one prefix write them) got A's KV joined with B's indexer rows, stored as one
    sealed unit and served whole. Parts now pair per writer: the unit is A's, whole."""
    s = store()
    sp = s.space(space_req())
    a, b = parts(1), parts(2)
    assert s.put(ME, sp, [b"k"], "index", a[1], writer=b"A").pending == 1
    assert s.put(ME, sp, [b"k"], "index", b[1], writer=b"B").pending == 1  # waits apart, not replacing A's
    r = s.put(ME, sp, [b"k"], "kv", a[0], writer=b"A")
    assert r.completed == 1 and r.pending == 0
    assert torch.equal(read_all(s, ME, sp, [b"k"], "both")[0], torch.cat(a))
    r = s.put(ME, sp, [b"k"], "kv", b[0], writer=b"B")  # the unit is there: B's KV changes nothing
    assert r.completed == 0 and r.accepted == [True]
    assert torch.equal(read_all(s, ME, sp, [b"k"], "both")[0], torch.cat(a))
    # a KV part of one writer never completes with another writer's index part
    s.put(ME, sp, [b"j"], "kv", a[0], writer=b"A")
    assert s.put(ME, sp, [b"j"], "index", b[1], writer=b"B").completed == 0
    assert s.exists(ME, sp, [b"j"]) == 0 and read_all(s, ME, sp, [b"j"], "both") == {}
    with pytest.raises(InvalidArgument, match="at most 64 bytes"):
        s.put(ME, sp, [b"x"], "kv", a[0], writer=b"w" * 65)


def test_a_clear_waits_for_no_disk_commit_while_it_holds_the_clear_guard(tmp_path):
    """Attack pass 9, A9-4: a ClearUnits drained the disk's write-behind once holding nothing (A7-7)
    and again, through the stack's removal, holding the unit store's clear guard exclusive, so every
    tenant's PutUnits waited up to one disk commit behind one tenant's clear. Here a commit is held
    (the test's slow-disk file) and a job is queued after the clear's first wait; the clear then takes
    the guard: the removal queues its deletes instead of waiting, so a put of another space completes
    while the commit is still held, and the clear answers once its deletes are committed."""
    import threading

    from kvtier.server.tiers import DiskTierConfig

    slow = tmp_path / "slow"
    page_rec = UnitStore(TierStack([])).space(space_req()).codec.page_nbytes()
    stack = TierStack.from_configs([HostTierConfig(capacity_bytes=2 * page_rec),
                                    DiskTierConfig(path=str(tmp_path / "d"), capacity_bytes=64 << 20,
                                                   write_behind=True, slow_file=str(slow))])
    for t in stack.tiers:
        if hasattr(t, "open"):
            t.open()
    try:
        s = UnitStore(stack)
        sp, other = s.space(space_req()), s.space(space_req(scope="other"))
        for i in range(4):  # two go down to the disk (committed: the file is absent)
            s.put(ME, sp, [b"u%d" % i], "both", torch.cat(parts(i)))
        real_quiesce = stack.quiesce
        entered: list[bool] = []

        def quiesce_then_queue(match):
            real_quiesce(match)
            if not entered:  # the clear's own wait is over: hold the disk and queue a write behind it
                entered.append(True)
                slow.write_text("")
                s.put(ME, other, [b"late"], "both", torch.cat(parts(9)))  # evicts to the held disk

        stack.quiesce = quiesce_then_queue
        cleared: list[int] = []
        clear = threading.Thread(target=lambda: cleared.append(s.clear(ME, sp)))
        clear.start()
        try:
            for _ in range(200):
                if entered:
                    break
                threading.Event().wait(0.01)
            done = threading.Event()
            put = threading.Thread(target=lambda: (s.put(ME, other, [b"free"], "both", torch.cat(parts(8))), done.set()))
            put.start()
            assert done.wait(3), "a put waited for the disk behind the clear's guard"
        finally:
            slow.unlink()
            clear.join(30)
            put.join(30)
        assert cleared == [4]
        assert s.exists(ME, sp, [b"u0", b"u1", b"u2", b"u3"]) == 0
        assert torch.equal(read_all(s, ME, other, [b"late"], "both")[0], torch.cat(parts(9)))
    finally:
        stack.close()
