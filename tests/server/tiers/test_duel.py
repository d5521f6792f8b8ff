"""``duel``: its ranked orders, its shadow referee and the policy, against hand-worked sequences."""

from __future__ import annotations

import pytest

from kvtier.server.tiers.duel import DuelPolicy
from kvtier.server.tiers.ranked import RankedLRU
from kvtier.server.tiers.referee import FREQUENCY, LEAVES_FIRST, ONCE_FIRST, RECENCY, ShadowReferee, rank
from kvtier.server.tiers.reuse import ReuseHistory


def test_ranked_lru_takes_the_oldest_of_the_lowest_rank():
    r = RankedLRU()
    assert r.put("a", 1) is False and r.put("b", 0) is False and r.put("c", 1) is False
    assert list(r) == ["b", "a", "c"] and r.lowest_rank() == 0
    assert r.put("a", 1) is True  # refiled: the newest of rank 1
    assert list(r) == ["b", "c", "a"]
    assert r.pop_oldest() == "b" and r.lowest_rank() == 1 and len(r) == 2
    r.discard("c")
    r.discard("missing")
    assert list(r) == ["a"] and "a" in r and "c" not in r
    r.pop_oldest()
    assert r.lowest_rank() is None
    with pytest.raises(KeyError):
        r.pop_oldest()


def test_ranks_of_each_order():
    # (uses, leaf) -> rank, per order: the table in kvtier.server.tiers.referee
    cases = {(1, True): (0, 0, 0, 0), (1, False): (0, 1, 1, 1), (2, False): (0, 1, 2, 2),
             (3, False): (0, 1, 2, 2), (4, False): (0, 1, 2, 3), (9, False): (0, 1, 2, 4)}
    for (uses, leaf), want in cases.items():
        assert tuple(rank(o, uses, leaf) for o in (RECENCY, LEAVES_FIRST, ONCE_FIRST, FREQUENCY)) == want


def test_referee_names_the_order_that_kept_a_leaf_out():
    ref = ShadowReferee(2)
    assert ref.leader == RECENCY  # cold: every score 0, the first order wins the tie
    ref.observe([("p", 1, False)])
    ref.observe([("q", 1, True)])  # q: a leaf
    ref.observe([("r", 1, False)])  # 3 keys, room for 2: recency drops p, every other order drops q
    ref.observe([("p", 2, False)])  # p hit in all but recency
    assert ref.scores == [0.0, 1.0, 1.0, 1.0] and ref.leader == LEAVES_FIRST


def test_referee_names_frequency_when_the_often_asked_page_comes_back():
    ref = ShadowReferee(2)
    ref.observe([("a", 4, False)])
    ref.observe([("b", 2, False)])
    ref.observe([("c", 2, False)])  # frequency drops b (rank 2 < a's 3); the others drop a, the oldest
    ref.observe([("a", 5, False)])
    assert ref.scores == [0.0, 0.0, 0.0, 1.0] and ref.leader == FREQUENCY
    ref.observe([("z", 1, False)])  # a miss everywhere: the scores decay, half-life 2 page requests
    assert ref.scores[FREQUENCY] == pytest.approx(0.5 ** 0.5)


def test_referee_counts_prefix_hits_only():
    ref = ShadowReferee(4)
    ref.observe([("a", 1, False), ("b", 1, False)])
    ref.observe([("x", 1, False), ("b", 2, False)])  # b is held, but the request missed x before it
    assert ref.scores == [0.0] * 4
    with pytest.raises(ValueError, match="pages must be a positive integer"):
        ShadowReferee(0)


def stack_policy(history: ReuseHistory, leader: int) -> DuelPolicy:
    p = DuelPolicy()
    p.bind(100)
    p.use_history(history)
    history.referee.leader = leader  # the referee's choice is tested above; here: what each choice does
    return p


def test_each_leader_orders_the_held_entries_its_way():
    h = ReuseHistory(max_keys=100)
    h.referee = ShadowReferee(8)
    h.observe(["x", "z"])  # z, y, w: each the last page of the one request that asked for it (leaves)
    h.observe(["x", "y"])
    h.observe(["x", "w"])  # x: asked for by 3 requests
    p = stack_policy(h, RECENCY)
    for k in ("x", "y", "z", "w"):
        p.insert(k, 1)
    h.observe(["v", "u"])  # v: asked for once, not a leaf
    p.insert("v", 1)
    assert p.referee is h.referee
    expected = {RECENCY: ["x", "y", "z", "w", "v"],
                LEAVES_FIRST: ["y", "z", "w", "x", "v"],
                ONCE_FIRST: ["y", "z", "w", "v", "x"],
                FREQUENCY: ["y", "z", "w", "v", "x"]}
    for leader, order in expected.items():
        h.referee.leader = leader
        assert p.order() == order, ORDER_NAMES[leader]
        assert p.victims(2, lambda k: True) == p.victims(2, lambda k: True) == order[:2]  # looking changes nothing
    h.referee.leader = RECENCY
    p.touch("x")
    assert p.order() == ["y", "z", "w", "v", "x"]


ORDER_NAMES = {RECENCY: "recency", LEAVES_FIRST: "leaves first", ONCE_FIRST: "once first", FREQUENCY: "frequency"}


def test_admission_refuses_a_page_below_every_rank_held():
    h = ReuseHistory(max_keys=100)
    h.referee = ShadowReferee(8)
    for _ in range(2):
        h.observe(["a", "b"])  # a: 2 requests; b: 2 requests (a leaf no more)
    h.observe(["once", "leaf"])  # once: 1 request, not its last page; leaf: its last page
    h.observe(["twice"])
    h.observe(["twice", "c"])
    p = stack_policy(h, FREQUENCY)  # set after the observations: each one lets the referee choose again
    assert p.admit("once", 1)  # empty: everything is admitted
    p.insert("a", 1)
    assert not p.admit("once", 1)  # 1 request: rank 1, below a's rank 2
    assert p.admit("twice", 1)  # 2 requests: rank 2
    assert not p.admit("leaf", 1)  # rank 0
    h.referee.leader = RECENCY
    assert p.admit("once", 1) and p.admit("leaf", 1)  # recency admits everything, as LRU does
    h.referee.leader = LEAVES_FIRST
    assert not p.admit("leaf", 1) and p.admit("once", 1)  # leaf rank 0 below a's 1; once: rank 1


def test_without_a_history_the_policy_referees_its_own_stream():
    p = DuelPolicy()
    p.bind(3)
    for k in "abc":
        p.insert(k, 1)
    p.touch("a")
    p.touch("a")  # own counts: a asked for 3 times
    assert p.leader == RECENCY and p.order() == ["b", "c", "a"]
    assert p.evict(1) == ["b"] and p.referee.pages == 3
    p.insert("d", 1)
    assert p.evict(1) == ["c"]  # all shadows hit a twice: a tie, recency leads


def test_pinned_entries_are_skipped_and_an_impossible_eviction_changes_nothing():
    p = DuelPolicy()
    p.bind(10)
    for k in "abc":
        p.insert(k, 2)
    assert p.victims(3, lambda k: k != "a") == ["b", "c"]
    assert p.evict(7) is None and p.order() == ["a", "b", "c"]
    p.remove("b")
    assert p.order() == ["a", "c"] and all("b" not in o for o in p.orders)
    with pytest.raises(KeyError):
        p.insert("a", 1)


def test_a_record_no_request_asked_for_goes_after_the_prefix_pages_and_is_always_admitted():
    """Regression (attack pass 3, N4): an Offload copy or an SGLang unit (a key the prefix cache's
    history never saw) was ranked as a page asked for once: under every ranked order it went before
    reused prefix pages and was refused admission to a disk full of them (24 of 40 copies lost where
    LRU lost none). It is the caller's own request to keep it."""
    h = ReuseHistory(max_keys=100)
    h.referee = ShadowReferee(8)
    for _ in range(4):
        h.observe(["hot1", "hot2"])  # prefix pages asked for 4 times
    p = stack_policy(h, FREQUENCY)
    p.insert("hot1", 1)
    p.insert("copy", 1)  # never asked for by a request
    p.insert("hot2", 1)
    for leader in (LEAVES_FIRST, ONCE_FIRST, FREQUENCY):
        h.referee.leader = leader
        assert p.order() == ["hot1", "hot2", "copy"], ORDER_NAMES[leader]
        assert p.admit("another copy", 1)
    h.referee.leader = RECENCY
    assert p.order() == ["hot1", "copy", "hot2"]


def test_a_prefix_page_the_history_forgot_is_still_a_page():
    """Only keys outside every prefix cache's namespace are callers' records: a page the bounded history
    has forgotten keeps its place among pages (rank 1, asked for once) instead of jumping past them."""
    h = ReuseHistory(max_keys=2)
    h.referee = ShadowReferee(8)
    h.add_namespace(b"p:")
    h.observe([b"p:old"])
    h.observe([b"p:a", b"p:b"])  # 3 keys, 2 remembered: p:old is forgotten
    assert h.uses(b"p:old") == 0 and h.is_page(b"p:old") and not h.is_page(b"o:copy")
    p = stack_policy(h, ONCE_FIRST)
    for k in (b"o:copy", b"p:old", b"p:a"):
        p.insert(k, 1)
    assert p.order() == [b"p:old", b"p:a", b"o:copy"]


def test_a_tier_heading_its_own_cache_is_refereed_at_its_own_size():
    h = ReuseHistory(max_keys=100)
    h.referee = ShadowReferee(8)  # the stack's: device plus every cascade tier
    device, host = DuelPolicy(), DuelPolicy()
    device.bind(2)
    host.bind(100)
    device.use_history(h, own_pages=2)  # the device pool: 2 pages
    host.use_history(h)
    assert device.referee is h.referee_for(2) and device.referee.pages == 2 and host.referee is h.referee
    for _ in range(4):
        h.observe(["a"])  # a: 4 requests
    h.observe(["b"])
    h.observe(["b"])
    h.observe(["c"])  # a leaf: at 2 pages recency drops a, every other order drops c itself
    h.observe(["a"])  # a hits in 2 pages under every order but recency; in 8 pages under all
    assert device.leader == LEAVES_FIRST  # the first of the tied orders that kept a
    assert host.leader == RECENCY  # 8 pages hold everything: a tie, recency leads
    assert h.referee_for(2) is device.referee  # one referee per size, told every request


def test_copies_a_faster_tier_holds_go_first():
    h = ReuseHistory(max_keys=100)
    h.referee = ShadowReferee(8)
    p = stack_policy(h, RECENCY)
    above = {"b"}
    p.watch_above(above.__contains__)
    for k in "abcd":
        p.insert(k, 1)
    p.copied_up("c")  # c's copy went up and is gone again: it keeps its place
    p.copied_up("b")
    p.copied_up("zz")  # not held here: ignored
    assert p.order() == ["b", "a", "c", "d"]
    assert p.victims(2, lambda k: True) == ["b", "a"]
    assert p.victims(1, lambda k: k != "b") == ["a"]  # a pinned copy is skipped
    above.discard("b")  # the faster tier dropped its copy: b is back in the leader's order
    assert p.order() == ["a", "b", "c", "d"] and p.evict(1) == ["a"]
    p.copied_up("d")
    above.add("d")
    p.remove("d")
    assert p.order() == ["b", "c"]


def test_a_policy_not_below_another_tier_ignores_copies():
    h = ReuseHistory(max_keys=100)
    h.referee = ShadowReferee(8)
    p = stack_policy(h, RECENCY)  # no watch_above: the device, the host
    for k in "ab":
        p.insert(k, 1)
    p.copied_up("b")
    assert p.order() == ["a", "b"]


def test_the_disk_evicts_its_copy_of_a_device_page_first():
    from kvtier.server.tiers.sim import SimTierConfig
    from kvtier.server.tiers.stack import TierStack

    stack = TierStack.from_configs([SimTierConfig(capacity_bytes=20, name="host", policy="duel"),
                                    SimTierConfig(capacity_bytes=30, name="disk", policy="duel")], simulate=True)
    host, disk = stack.cascade
    assert host.index.policy._above is None and disk.index.policy._above is not None
    on_device: set[bytes] = set()
    stack.add_device(on_device.__contains__)
    for k in (b"a", b"b", b"c", b"d", b"e"):
        stack.put(k, 10, source="device")  # host keeps d, e; a, b, c went down to the disk
    assert stack.where([b"a", b"b", b"c", b"d"]) == [["disk"], ["disk"], ["disk"], ["host"]]
    on_device.add(b"b")  # a load copied b up to a device
    stack.copied_up([b"b", b"d"])  # d: not on the disk, nothing to tell it
    stack.put(b"f", 10, source="device")  # host evicts d to the disk, which makes room: b goes, not a
    assert stack.where([b"a", b"b", b"c", b"d"]) == [["disk"], [], ["disk"], ["disk"]]
    on_device.clear()
    stack.copied_up([b"c"])  # told, but no faster tier holds c: the disk's own order again
    stack.put(b"g", 10, source="device")  # host evicts e: the disk drops a, its least recently used
    assert stack.where([b"a", b"c", b"e"]) == [[], ["disk"], ["disk"]]


def test_telling_a_tier_of_a_copy_up_never_waits_for_its_index_lock():
    """Attack pass 8, A8-4: a StorePrefix told the disk tier of its pages' copies up under the disk's
    index lock, after its caller check and holding its pool and cache, so a slow disk commit held it
    6 s. Now the tier records the copies without the lock (as deferred uses) and its next operation
    applies them: with the disk's lock held by another thread, ``copied_up`` returns at once, and
    the eviction that follows still takes the copy first, as the test above."""
    import threading

    from tierkit import HeldLock

    from kvtier.server.tiers.sim import SimTierConfig
    from kvtier.server.tiers.stack import TierStack

    stack = TierStack.from_configs([SimTierConfig(capacity_bytes=20, name="host", policy="duel"),
                                    SimTierConfig(capacity_bytes=30, name="disk", policy="duel")], simulate=True)
    disk = stack.cascade[1]
    on_device: set[bytes] = set()
    stack.add_device(on_device.__contains__)
    for k in (b"a", b"b", b"c", b"d", b"e"):
        stack.put(k, 10, source="device")
    on_device.add(b"b")
    with HeldLock(disk.index.lock):
        told = threading.Thread(target=lambda: stack.copied_up([b"b", b"d"]))
        told.start()
        told.join(2)
        returned = not told.is_alive()
    told.join(5)
    assert returned  # it did not wait for the lock the other thread held
    stack.put(b"f", 10, source="device")  # the disk makes room: its copy of b goes first, not a
    assert stack.where([b"a", b"b", b"c", b"d"]) == [["disk"], [], ["disk"], ["disk"]]
