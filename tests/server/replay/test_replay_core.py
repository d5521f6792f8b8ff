"""Replay core: trace reading, chained keys, deterministic fill, Belady's bound, and a real
in-process replay whose hit counts equal the simulation's exactly with 0 verification failures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.page_keys import page_keys
from kvtier.server.model_config import DSAModelConfig
from kvtier.server.replay.belady import belady_hits
from kvtier.server.replay.driver import InProcessBackend, belady_bound, replay
from kvtier.server.replay.fill import PageFill
from kvtier.server.replay.scale import ReplayScale
from kvtier.server.replay.trace import RequestKeys, TraceRequest, read_trace

TRACE = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "conversation_trace.jsonl"
MiB = 1 << 20


def test_trace_has_the_published_shape():
    reqs = read_trace(TRACE)
    assert len(reqs) == 12031
    assert reqs[0].hash_ids[:3] == (0, 1, 2) and reqs[0].input_length == 6758
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in reqs)


def test_bad_trace_line_names_the_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n{"nope": 1}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2"):
        read_trace(p)


def test_shared_prefix_blocks_get_the_same_page_keys():
    keys = RequestKeys(tokens_per_block=128, page_size=64)
    a, b = keys.pages((0, 1, 2)), keys.pages((0, 1, 9))
    assert [p.key for p in a[:4]] == [p.key for p in b[:4]]  # blocks 0, 1: 2 pages each
    assert a[4].key != b[4].key
    # the chain equals hashing the concatenated synthetic tokens from the root
    toks = np.concatenate([np.arange(h * 128, h * 128 + 128) for h in (0, 1, 2)])
    assert [p.key for p in a] == page_keys(toks, 64)
    # same block id after another parent is a different page
    assert keys.pages((5, 1))[2].key != a[2].key


def test_fill_depends_on_block_page_and_layer():
    m = DSAModelConfig.from_preset("glm-5.2", num_layers=4)
    f = PageFill(m, [True, True, True, False])
    lat, idx = f.expected([(7, 0), (7, 1), (8, 0)])
    assert lat.shape == (4, 3 * 64, 656) and idx.shape == (3, 3, 8448)
    assert not np.array_equal(lat[:, :64], lat[:, 64:128]) and not np.array_equal(lat[0], lat[1])
    lat2, idx2 = f.expected([(7, 0), (7, 1), (8, 0)])
    assert np.array_equal(lat, lat2) and np.array_equal(idx, idx2)
    assert f.count_bad_pages([(7, 0), (7, 1), (8, 0)], lat, idx) == 0
    idx[2, 1, 8447] ^= 1  # the last scale byte of page 1 on live layer 2
    assert f.count_bad_pages([(7, 0), (7, 1), (8, 0)], lat, idx) == 1


def test_belady_on_a_hand_worked_sequence():
    # capacity 2: a b c a b d a b -> MIN keeps a,b (c and d are never used again): hits a b a b = 4
    assert belady_hits(list("abcabdab"), 2) == 4
    # capacity 1: a b a b: best is to keep a: hit a once
    assert belady_hits(list("abab"), 1) == 1
    assert belady_hits(list("abab"), 0) == 0


def scripted_trace() -> list[TraceRequest]:
    """Eight 8-block conversations, then their second turns in an order that reaches back further
    and further: recent ones hit the device, older ones the host, the oldest the disk or nothing."""
    first = [tuple(range(100 * c, 100 * c + 8)) for c in range(8)]
    second = [first[c] + (100 * c + 50, 100 * c + 51) for c in (7, 6, 4, 2, 0, 1, 3, 5)]
    return [TraceRequest(i, i, 512 * len(h), 1, h) for i, h in enumerate(first + second)]


def small_scale() -> ReplayScale:
    # device 24 pages, host 16 pages, disk 8 MiB map with 75% for records (31 pages)
    return ReplayScale(device_tokens=24 * 64, host_bytes=16 * 194_048, disk_bytes=8 * MiB)


def test_replay_real_equals_simulation_with_every_byte_verified(tmp_path):
    reqs = scripted_trace()
    scale = small_scale()
    real_backend = InProcessBackend(scale, str(tmp_path / "real"))
    real = replay(reqs, real_backend, scale)
    sim = replay(reqs, InProcessBackend(scale, str(tmp_path / "sim"), simulate=True), scale)
    assert real.verify_failures == 0
    assert real.verified_pages == sum(real.hit_tokens.values()) // 64 > 0
    assert real.hit_tokens == sim.hit_tokens and real.miss_tokens == sim.miss_tokens
    # worked out by hand: 8 first turns of 8 blocks miss (64 pages); each second turn loads its 8
    # old blocks and misses its 2 new ones (16 pages)
    assert real.miss_tokens + sum(real.hit_tokens.values()) == (64 + 8 * 10) * 64
    assert real.miss_tokens >= (64 + 16) * 64
    assert all(real.hit_tokens[t] > 0 for t in ("device", "host", "disk"))
    assert real.moves == sim.moves and real.moves["disk->gone"]["count"] > 0
    total_pages = sum(len(r.hash_ids) for r in reqs)
    assert scale.capacity_pages() == {"device": 24, "host": 16, "disk": 31}
    assert real.tokens == total_pages * 64 == sum(real.hit_tokens.values()) + real.miss_tokens
    assert sum(real.hit_tokens.values()) <= belady_bound(reqs, scale)
    stats = real_backend.cache.stats()
    assert stats["device"]["pinned_pages"] == 0 and stats["device"]["open_leases"] == 0
    real_backend.close()
