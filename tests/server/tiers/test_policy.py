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
