"""The ``duel`` policy (recency against frequency, refereed by regret) against hand-worked sequences."""

from __future__ import annotations

import math

import pytest

from kvtier.server.tiers.duel import FREQUENCY, RECENCY, DuelPolicy
from kvtier.server.tiers.reuse import ReuseHistory


def duel(capacity: int = 3, history: ReuseHistory | None = None) -> DuelPolicy:
    p = DuelPolicy()
    p.bind(capacity)
    if history is not None:
        p.use_history(history)
    return p


def test_cold_duel_evicts_by_recency_and_a_regretted_eviction_hands_the_lead_to_frequency():
    p = duel()
    for k in "abc":
        p.insert(k, 1)
    p.touch("a")
    p.touch("a")  # a: 3 uses (bucket 2); b, c: 1 use (bucket 1); recency order b, c, a
    assert p.leader == RECENCY and p.order() == ["b", "c", "a"]
    assert p.victims(1, lambda k: True) == p.victims(1, lambda k: True) == ["b"]  # looking changes nothing
    assert p.evict(1) == ["b"]
    p.insert("b", 1)  # b is back: recency's mistake, made 0 evictions ago (discount**0 = 1)
    w_rec = 0.5 * math.exp(-0.45)
    assert p.weights == pytest.approx([w_rec / (w_rec + 0.5), 0.5 / (w_rec + 0.5)])
    assert p.leader == FREQUENCY
    # frequency order: bucket 1 (c, then b: b is newer), then bucket 2 (a)
    assert p.order() == ["c", "b", "a"] and p.evict(1) == ["c"]
    assert "c" in p.ghosts[FREQUENCY] and "c" not in p.ghosts[RECENCY]


def test_an_old_mistake_costs_less_than_a_new_one():
    p = duel(capacity=10)
    for k in "abcdefgh":
        p.insert(k, 1)
    assert p.evict(1) == ["a"]  # eviction 1, by recency
    for _ in range(3):  # three more evictions before a returns
        p.evict(1)
    p.insert("a", 1)  # 4 entries held: discount = 0.005 ** (1/4); a left 3 evictions ago
    r = (0.005 ** (1 / 4)) ** 3
    w_rec = 0.5 * math.exp(-0.45 * r)
    assert p.weights[RECENCY] == pytest.approx(w_rec / (w_rec + 0.5))
    assert 0.5 * math.exp(-0.45) < w_rec < 0.5


def test_frequency_comes_from_the_request_history_when_there_is_one():
    h = ReuseHistory(max_keys=100)
    h.observe(["x", "y"])
    h.observe(["x"])
    h.observe(["x"])  # x asked for by 3 requests, y by 1, z never (counts as 1)
    p = duel(history=h)
    for k in "xyz":
        p.insert(k, 1)
    p.weights = [0.4, 0.6]  # frequency leads
    assert p.order() == ["y", "z", "x"] and p.bucket == {"x": 2, "y": 1, "z": 1}
    h.observe(["y"])
    h.observe(["y"])
    h.observe(["y"])  # y now asked for 4 times: a touch refiles it (bucket 3)
    p.touch("y")
    assert p.order() == ["z", "x", "y"]


def test_pinned_entries_are_skipped_and_an_impossible_eviction_changes_nothing():
    p = duel(capacity=10)
    for k in "abc":
        p.insert(k, 2)
    assert p.victims(3, lambda k: k != "a") == ["b", "c"]
    assert p.evict(7) is None and p.order() == ["a", "b", "c"]
    p.remove("b")  # an explicit removal leaves no ghost
    assert p.order() == ["a", "c"] and not p.ghosts[RECENCY] and not p.ghosts[FREQUENCY]


def test_admission_takes_pages_asked_for_as_often_as_the_least_asked_held_and_ghosts():
    h = ReuseHistory(max_keys=100)
    for _ in range(2):
        h.observe(["a", "b"])  # a, b: 2 requests (bucket 2)
    p = duel(capacity=10, history=h)
    assert p.admit("new", 1)  # empty: everything is admitted
    p.insert("a", 1)
    p.insert("b", 1)
    assert not p.admit("once", 1)  # 1 request (bucket 1) below the least asked held (bucket 2)
    h.observe(["twice"])
    h.observe(["twice"])
    assert p.admit("twice", 1)
    p.evict(1)  # a leaves as recency's ghost
    p.remove("b")
    p.insert("c", 1)
    h.observe(["c"] * 1)
    for _ in range(3):
        h.observe(["c"])
    p.touch("c")  # c: bucket 3, the least asked held
    assert p.admit("a", 1)  # a ghost: it came back once already
    assert not p.admit("twice", 1)


def test_ghosts_are_bounded_by_the_budget():
    p = duel(capacity=4)
    for i in range(10):
        p.insert(i, 2)
        if i >= 2:
            p.evict(2)
    assert p.ghost_bytes[RECENCY] <= 4 and list(p.ghosts[RECENCY]) == [6, 7]
