"""Synthetic trace shapes: deterministic, chained hash ids, the shape each promises."""

from __future__ import annotations

import pytest

from kvtier.server.replay.generate import SHAPES, generate


@pytest.mark.parametrize("shape", SHAPES)
def test_same_seed_same_trace_in_arrival_order(shape):
    a, b = generate(shape, 60, seed=3), generate(shape, 60, seed=3)
    assert a == b and len(a) == 60
    assert [r.timestamp_ms for r in a] == sorted(r.timestamp_ms for r in a)
    assert [r.index for r in a] == list(range(60))
    for r in a:  # the input ends half-way through its last 512-token block
        assert r.input_length == (len(r.hash_ids) - 1) * 512 + 256


def test_long_documents_share_no_block():
    reqs = generate("long_documents", 20)
    ids = [i for r in reqs for i in r.hash_ids]
    assert len(ids) == len(set(ids)) and all(64 <= len(r.hash_ids) <= 200 for r in reqs)


def test_a_chat_turn_extends_the_previous_turn_without_its_leaf():
    reqs = generate("chats", 200)
    by_first_new = {}
    extended = 0
    for r in reqs:
        body = r.hash_ids[:-1]  # without the leaf
        for other in by_first_new.values():
            if len(other) < len(body) and body[:len(other)] == other:
                extended += 1
                break
        by_first_new[r.hash_ids] = body
    assert extended > 0
    leaves = [r.hash_ids[-1] for r in reqs]
    assert len(set(leaves)) == len(leaves)  # a leaf block is never asked for again
    assert all(r.hash_ids[-1] not in q.hash_ids[:-1] for r in reqs for q in reqs)


def test_rereads_ask_for_whole_documents_again_leaves_included():
    reqs = generate("rereads", 400, seed=1)
    assert all(4 <= len(r.hash_ids) <= 40 for r in reqs)
    docs = {r.hash_ids for r in reqs}
    assert len(docs) < len(reqs)  # popular documents come back whole
    leaves = [r.hash_ids[-1] for r in reqs]
    assert len(set(leaves)) < len(leaves)  # and with them their last page
    firsts = {}
    for d in docs:  # documents share no block: a block belongs to one document
        for b in d:
            assert firsts.setdefault(b, d) == d


def test_unknown_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown trace shape 'scan'; known: shared_prompts"):
        generate("scan", 5)
