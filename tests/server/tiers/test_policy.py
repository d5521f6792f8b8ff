"""LRU policy and the byte-budget index: order, all-or-nothing eviction, pins that return to zero."""

from __future__ import annotations

import pytest

from kvtier.server.tiers import LRUPolicy, TierFullError, TierIndex


def test_lru_evicts_least_recently_used_first():
    p = LRUPolicy()
    for k in "abcd":
        p.insert(k, 10)
    p.touch("a")
    assert p.order() == ["b", "c", "d", "a"]
    assert p.evict(15) == ["b", "c"]
    assert p.order() == ["d", "a"]


def test_evict_either_frees_enough_or_changes_nothing():
    p = LRUPolicy()
    for k in "abc":
        p.insert(k, 10)
    assert p.evict(25, can_evict=lambda k: k != "b") is None  # a + c = 20 < 25
    assert p.order() == ["a", "b", "c"]
    assert p.evict(20, can_evict=lambda k: k != "b") == ["a", "c"]
    assert p.order() == ["b"]


def test_index_plans_victims_without_changing_anything():
    ix = TierIndex(100)
    for k in "abcd":
        ix.commit_insert(k, 25)
    victims = ix.plan_insert("e", 30)
    assert victims == ["a", "b"]
    assert ix.keys() == ["a", "b", "c", "d"] and ix.used == 100
    ix.commit_insert("e", 30, victims)
    assert ix.keys() == ["c", "d", "e"] and ix.used == 80


def test_pinned_entries_are_never_victims_and_pins_return_to_zero_on_errors():
    ix = TierIndex(50)
    ix.commit_insert("a", 25)
    ix.commit_insert("b", 25)
    with pytest.raises(RuntimeError):
        with ix.pinned(["a", "b", "missing"]) as got:
            assert got == ["a", "b"]
            with pytest.raises(TierFullError):
                ix.plan_insert("c", 10)
            raise RuntimeError("caller failed half way")
    assert ix.total_pins == 0
    assert ix.plan_insert("c", 10) == ["a"]


def test_record_larger_than_budget_is_refused():
    ix = TierIndex(10)
    with pytest.raises(TierFullError, match="exceeds"):
        ix.plan_insert("x", 11)


def _grouped(capacity: int, quotas: dict[str, int]) -> TierIndex:
    ix = TierIndex(capacity)
    ix.set_groups(lambda k: k[0] if k[0] in "AB" else None, quotas.get)
    return ix


def test_a_group_over_its_quota_evicts_its_own_lru_entries_not_others():
    """A(quota 40) holds a1, a2; B holds B1 (older than both): A's third entry evicts a1, never B1."""
    ix = _grouped(200, {"A": 40})
    for k in ("B1", "A1", "A2"):
        ix.commit_insert(k, 20)
    assert (ix.group_used("A"), ix.group_used("B")) == (40, 20)
    victims = ix.plan_insert("A3", 20)
    assert victims == ["A1"]
    ix.commit_insert("A3", 20, victims)
    assert ix.keys() == ["B1", "A2", "A3"] and ix.group_used("A") == 40 and ix.used == 60


def test_the_shared_budget_still_evicts_lru_across_groups_after_the_groups_own():
    """Budget 60, A quota 40: A3 first evicts A1 for the quota; the shared budget then needs no more."""
    ix = _grouped(60, {"A": 40})
    for k in ("B1", "A1", "A2"):
        ix.commit_insert(k, 20)
    assert ix.plan_insert("A3", 20) == ["A1"]
    assert ix.plan_insert("B2", 20) == ["B1"]  # B has no quota: plain LRU over everything


def test_group_quota_refusals_change_nothing():
    ix = _grouped(200, {"A": 30})
    ix.commit_insert("A1", 20)
    with pytest.raises(TierFullError, match="exceeds its group's quota of 30"):
        ix.plan_insert("A2", 31)
    with ix.pinned(["A1"]):
        with pytest.raises(TierFullError, match="within its group's quota"):
            ix.plan_insert("A2", 20)
    assert ix.keys() == ["A1"] and ix.group_used("A") == 20
    ix.remove("A1")
    assert ix.group_used("A") == 0 and ix.used == 0


def test_deferred_touches_are_applied_in_order_before_the_order_is_used():
    """A read path records uses with touch_later (no lock); the next method that reads or changes
    the order applies them first, in order, skipping keys gone by then, and tells on_touch."""
    ix = TierIndex(40)
    told: list[list[str]] = []
    ix.on_touch = told.append
    for k in "abcd":
        ix.commit_insert(k, 10)
    ix.touch_later(["a", "x", "b"])  # x was never there
    assert ix.policy.order() == ["a", "b", "c", "d"]  # not applied yet: the policy alone does not know
    assert ix.keys() == ["c", "d", "a", "b"] and told == [["a", "b"]]
    ix.touch_later(["c"])
    assert ix.plan_insert("e", 10) == ["d"]  # c's use counted before the victim is chosen
    ix.touch_later(["d"])
    ix.remove("d")
    ix.apply_touches()
    assert ix.keys() == ["a", "b", "c"] and told == [["a", "b"], ["c"], ["d"]]  # d used, then removed


def test_deferred_touches_stay_bounded_without_writes(monkeypatch):
    """A stretch of reads with no write never lets the deferred uses pile up: past TOUCH_LATER_MAX
    the recording call applies them itself."""
    from kvtier.server.tiers import policy
    monkeypatch.setattr(policy, "TOUCH_LATER_MAX", 3)
    ix = TierIndex(30)
    for k in "abc":
        ix.commit_insert(k, 10)
    ix.touch_later(["a", "b"])
    ix.touch_later(["a"])
    assert ix.policy.order() == ["a", "b", "c"]  # three waiting: not past the bound yet
    ix.touch_later(["b"])  # four: applied now, in order a b a b
    assert ix.policy.order() == ["c", "a", "b"] and len(ix._later) == 0
