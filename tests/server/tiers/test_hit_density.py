"""The hit-density policy (kvtier's default) and the prefix cache's reuse history, by hand-worked sequences."""

from __future__ import annotations

import pytest

from kvtier.server.tiers.hit_density import HitDensityPolicy
from kvtier.server.tiers.policy import LRUPolicy
from kvtier.server.tiers.reuse import INNER, LEAF, REUSED_MORE, REUSED_ONCE, ReuseHistory
from kvtier.server.tiers.sim import SimTier, SimTierConfig
from kvtier.server.tiers.stack import TierStack


def test_reuse_history_classes_from_requests():
    h = ReuseHistory(max_keys=4)
    h.observe(["a", "b", "c"])  # c is the request's leaf
    assert [h.class_of(k) for k in "abc"] == [INNER, INNER, LEAF]
    h.observe(["a", "b", "d"])
    assert [h.class_of(k) for k in "abcd"] == [REUSED_ONCE, REUSED_ONCE, LEAF, LEAF]
    h.observe(["a", "e"])  # five keys: c, the least recently asked for, is forgotten
    assert h.class_of("a") == REUSED_MORE and h.class_of("e") == LEAF
    assert len(h) == 4 and h.class_of("c") == INNER  # unknown: no evidence either way
    with pytest.raises(ValueError, match="max_keys must be a positive integer"):
        ReuseHistory(0)


def test_cold_policy_evicts_the_least_recently_used():
    p = HitDensityPolicy()
    p.bind(100)
    for k in "abc":
        p.insert(k, 10)
    p.touch("a")
    # no statistics yet: every density is 0, ties go to the oldest last use (b, then c, then a)
    assert p.victims(25, lambda k: True) == ["b", "c", "a"]


def trained(reconfigure: int = 8) -> tuple[HitDensityPolicy, ReuseHistory]:
    """A policy that has seen leaves end unused and inner pages come back, 8 of each."""
    h = ReuseHistory(max_keys=1000)
    p = HitDensityPolicy()
    p.RECONFIGURE = reconfigure
    p.bind(1000)
    p.use_history(h)
    for i in range(8):
        inner, leaf = f"in{i}", f"leaf{i}"
        h.observe([inner, leaf])
        p.insert(inner, 10)
        p.insert(leaf, 10)
        h.observe([inner])  # the next request asks for the inner page again
        p.touch(inner)
        p.evicted(leaf)  # the leaf leaves unused (an end)
        p.evicted(inner)  # so does the inner page, after its hit
    return p, h


def test_learned_densities_evict_a_newer_leaf_before_an_older_inner_page():
    p, h = trained()
    assert max(p.density[LEAF]) == 0.0 and max(p.density[INNER]) > 0.0  # leaves never hit, inner pages did
    h.observe(["old", "new"])  # old: inner, new: the leaf
    p.insert("old", 10)
    p.insert("new", 10)
    assert p.victims(10, lambda k: True) == ["new"]
    assert p.victims(10, lambda k: k != "new") == ["old"]


def test_admission_turns_away_a_leaf_and_remembers_it_as_a_ghost():
    p, h = trained()
    h.observe(["held", "its-leaf"])
    p.insert("held", 10)  # what a newcomer would replace: an inner page (hit chance > 0)
    h.observe(["x", "leafy"])
    assert p.admit("leafy", 10) is False
    assert "leafy" in p.ghost
    assert p.admit("x", 10) is True  # an inner page: the same chance as the one it replaces


def test_lru_admits_everything():
    assert LRUPolicy().admit("k", 10) is True


class _RefuseX(LRUPolicy):
    def admit(self, key, nbytes):
        return not key.startswith(b"x")


def test_stack_counts_what_the_disk_does_not_admit_and_passes_it_on():
    charge = 4352  # disk_charge(100): one LMDB page of record plus the index entry
    disk = SimTier(SimTierConfig(capacity_bytes=3 * charge, name="disk", lmdb_charge=True))
    disk.index.policy = _RefuseX()  # before any entry
    stack = TierStack([disk])
    assert stack.put_many([(b"a", 100), (b"b", 100), (b"xc", 100)], source="host") == [["disk"]] * 3  # they fit
    placed = stack.put_many([(b"xd", 100), (b"e", 100)], source="host")  # full: the policy is asked
    assert placed == [[], ["disk"]]
    assert stack.moves["host->disk(not admitted)"] == {"count": 1, "bytes": 0}
    assert disk.index.keys() == [b"b", b"xc", b"e"]  # e evicted a (LRU); xd was never written
