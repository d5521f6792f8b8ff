"""The mooncake case's two-daemon replay: requests alternate between the daemons.

Two in-process prefix caches (a real pool and host tier each) stand for the two daemons (no daemon, no store): the replay driver's
first call of a request (``load``; it asks no lookup since the attach transport) must pick the
next daemon, or every request reaches the last one and the case compares one daemon with the
two-daemon simulation."""

from __future__ import annotations

from kvtier.mooncake_bench import _Alternate
from kvtier.server.replay.driver import InProcessBackend, replay
from kvtier.server.replay.scale import ReplayScale
from kvtier.server.replay.trace import TraceRequest

PAGE_RECORD = 194_048  # one page record at the replay's default scale (4 layers of GLM-5.2)


def test_requests_alternate_between_the_daemons(tmp_path):
    # one device page and two host records a daemon; one 64-token block = one page a request
    scale = ReplayScale(device_tokens=64, host_bytes=2 * PAGE_RECORD, disk_bytes=0)
    backends = [InProcessBackend(scale, str(tmp_path / f"d{i}")) for i in range(2)]
    a, b, x = 1, 2, 3
    reqs = [TraceRequest(i, i, 64, 1, (h,)) for i, h in enumerate([a, x, b, x, a, x])]
    res = replay(reqs, _Alternate(backends), scale)
    # daemon 0 sees a, b, a: a miss, b miss (a down to the host tier), a from the host tier;
    # daemon 1 sees x, x, x: a miss, then two device hits
    assert [be.cache.counters["loads"] for be in backends] == [3, 3]
    assert backends[0].cache.counters["hit_pages_host"] == 1
    assert backends[1].cache.counters["hit_pages_device"] == 2
    assert res.hit_tokens == {"device": 128, "host": 64, "disk": 0}
    assert res.tokens == 6 * 64 and res.miss_tokens == 3 * 64
    assert res.verified_pages == 3 and res.verify_failures == 0
    for be in backends:
        be.close()
