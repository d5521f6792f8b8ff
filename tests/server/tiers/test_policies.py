"""S3-FIFO and ARC against hand-worked sequences; the registry of policy names."""

from __future__ import annotations

import pytest

from kvtier.server.tiers.policies import ARCPolicy, S3FIFOPolicy, make_policy, policy_names, resolve_policy
from kvtier.server.tiers.policy import LRUPolicy, TierIndex


def s3fifo(capacity: int = 100) -> S3FIFOPolicy:
    p = S3FIFOPolicy()
    p.bind(capacity)
    return p


def test_s3fifo_promotes_used_probationers_and_ghosts_the_unused():
    p = s3fifo()  # 10-byte entries: the small queue's share is 10 bytes
    for k in "abcde":
        p.insert(k, 10)
    p.touch("a")
    p.touch("c")
    p.touch("c")
    # S = a b c d e: a was used -> moves to M; b was not -> the victim
    assert p.victims(10, lambda k: True) == ["b"]
    assert p.victims(10, lambda k: True) == ["b"]  # looking again: same answer
    assert p.order() == ["b", "c", "d", "e", "a"]
    p.evicted("b")
    assert list(p.ghost) == ["b"]
    # S = c d e (30 bytes > 10): c used -> M; d chosen; S is down to its share -> M's oldest, a (its use was spent)
    assert p.victims(20, lambda k: True) == ["d", "a"]
    p.evicted("d")
    p.evicted("a")
    assert list(p.ghost) == ["b", "d"]  # a left M: no ghost
    assert (list(p.small), list(p.main)) == (["e"], ["c"])


def test_s3fifo_ghost_returns_to_main_and_main_gives_second_chances():
    p = s3fifo()
    for k in "ab":
        p.insert(k, 10)
    p.evicted("a")  # left S unused: a ghost
    p.insert("a", 10)  # back while remembered: straight to M
    assert (list(p.small), list(p.main), list(p.ghost)) == (["b"], ["a"], [])
    p.insert("c", 10)
    p.touch("a")
    # S = b c (20 bytes > 10): b chosen; then S = c (10 bytes, its share) -> M: a used once -> back of M,
    # use spent; a again, now unused -> chosen
    assert p.victims(20, lambda k: True) == ["b", "a"]
    assert p.freq["a"] == 0


def test_s3fifo_skips_pinned_and_refuses_when_impossible():
    p = s3fifo()
    for k in "abc":
        p.insert(k, 10)
    assert p.victims(10, lambda k: k != "a") == ["b"]
    assert p.victims(40, lambda k: True) is None
    assert p.order() == ["a", "b", "c"]


def arc(capacity: int = 40) -> ARCPolicy:
    p = ARCPolicy()
    p.bind(capacity)
    return p


def test_arc_adapts_its_target_to_ghost_hits():
    p = arc()  # four 10-byte entries
    for k in "abcd":
        p.insert(k, 10)
    p.touch("a")
    p.touch("b")
    assert (list(p.t1), list(p.t2)) == (["c", "d"], ["a", "b"])
    assert p.victims(10, lambda k: True) == ["c"]  # T1 (20 bytes) is over p = 0
    p.evicted("c")
    p.insert("e", 10)
    assert p.victims(10, lambda k: True) == ["d"]
    p.evicted("d")
    assert list(p.b1) == ["c", "d"]
    p.insert("c", 10)  # a B1 ghost hit: p grows by max(|B2|/|B1|, 1) * 10 = 10; c goes to T2
    assert p.p == 10 and list(p.t2) == ["a", "b", "c"] and list(p.b1) == ["d"]
    assert p.victims(10, lambda k: True) == ["a"]  # T1 = e (10 bytes) is not over p: T2's LRU
    p.evicted("a")
    p.insert("a", 10)  # a B2 ghost hit: p shrinks by max(|B1|/|B2|, 1) * 10 = 10
    assert p.p == 0 and list(p.t2) == ["b", "c", "a"]
    assert p.victims(10, lambda k: True) == ["e"]


def test_arc_explicit_removal_leaves_no_ghost():
    p = arc()
    p.insert("a", 10)
    p.remove("a")
    assert not p.b1 and not p.b2 and p.order() == []


def test_registry_names_and_errors():
    assert set(policy_names()) >= {"default", "lru", "s3fifo", "arc"}
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert resolve_policy("default") in policy_names()
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'; known: default, lru"):
        make_policy("mru")


@pytest.mark.parametrize("name", ["lru", "s3fifo", "arc", "duel", "default"])
def test_index_with_each_policy_stays_in_budget_and_evicts_unpinned(name):
    ix = TierIndex(50, make_policy(name))
    for i in range(20):
        key = f"k{i}"
        with ix.pinned([f"k{i - 1}"]):
            victims = ix.plan_insert(key, 10)
            assert f"k{i - 1}" not in victims
            ix.commit_insert(key, 10, victims)
        if i % 3 == 0:
            ix.touch(f"k{i}")
        assert ix.used <= 50 and len(ix.keys()) == len(ix)
    assert len(ix) == 5
