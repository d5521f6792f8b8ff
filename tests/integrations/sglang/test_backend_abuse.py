"""The backend under inputs SGLang's controller should never send: host indices outside the host
pools, off by a token, floats, shuffled, 2-D; ``None`` and garbage where lists of transfers belong.
Every one is ``False`` or a miss and one log line: nothing raises into SGLang, nothing is stored,
no host byte changes, and the SGLang process survives (the bad-index calls run in a child process,
whose exit status says whether it lived: a bad address read or written as a page is a SIGSEGV).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hosts import PS, HostPools, indexer, load, make_backend, page_keys, store
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult

from kvtier.client.spawn import DaemonProcess

TOKEN = "sglang-abuse-tenant-0123456789abcdef"
HERE = Path(__file__).resolve().parent

# host indices of 4 stored pages ``idx`` turned into what each case sends
BAD_INDICES = {
    "below the pool": "idx - 10**6",
    "far above the pool": "idx + 10**9",
    "one pool size above": "idx + pools.kv.size",
    "a token off the page": "idx + 1",
    "floats": "idx.float()",
    "shuffled within pages": "idx.flip(0)",
    "two-dimensional": "idx.reshape(4, PS)",
    "the last page past the end": "torch.arange(pools.kv.size - 3 * PS, pools.kv.size + PS)",
}

CHILD = r"""
import json, sys, torch
from hosts import PS, HostPools, indexer, make_backend, page_keys, store
from sglang.srt.mem_cache.hicache_storage import PoolName
address, token, cases, transport = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
pools = HostPools()
b = make_backend(pools, {"address": address, "token": token, "timeout_s": 30, "transport": transport})
keys = page_keys(4, salt=41)
idx = pools.alloc(4)
pools.fill(idx, seed=11)
store(b, keys, idx)
for n, (name, case) in enumerate(sorted(cases.items())):
    fresh = page_keys(4, salt=100 + n)
    bad = eval(case)
    before = (pools.kv.kv_buffer.view(torch.uint8).clone(), pools.index.index_k_with_scale_buffer.clone())
    out = {
        "set_v2": b.batch_set_v2(indexer(fresh, bad))[PoolName.INDEXER],
        "set_v1": b.batch_set_v1(fresh, bad),
        "get_v1": b.batch_get_v1(keys, bad),
        "get_v2": b.batch_get_v2(indexer(keys, bad))[PoolName.INDEXER],
    }
    out["fresh stored"] = b.batch_exists(fresh)
    out["host bytes unchanged"] = bool(torch.equal(before[0], pools.kv.kv_buffer.view(torch.uint8))
                                       and torch.equal(before[1], pools.index.index_k_with_scale_buffer))
    print("RESULT " + json.dumps([name, out]), flush=True)
"""


@pytest.fixture(scope="module", params=["shm", "grpc"])
def daemon(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("abuse")
    tokens = tmp / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN}" = "team-abuse"\n')
    os.chmod(tokens, 0o600)
    # a unix socket for either transport: a token goes over no plaintext TCP port (attack pass 6, A6-1)
    d = DaemonProcess(f"unix://{tmp}/kv.sock", extra_args=["--device", "cpu", "--auth-tokens", str(tokens), "--host-memory", "64MiB"])
    d.start()
    d.transport = "auto" if request.param == "shm" else "grpc"
    yield d
    d.stop()
    d.cleanup()


def test_host_indices_outside_whole_pages_are_false_and_the_process_lives(daemon):
    """Scenario (adversarial finding 07b): v1/v2 set and get with host indices outside the host pool
    (``idx - 10**6``, ``idx + 10**9``, ``idx + pool size``) crashed SGLang with SIGSEGV (raw addresses
    from ``get_page_buffer_meta`` viewed unchecked); ``idx + 1`` and float indices were stored as True.
    Now: in one SGLang-side process, every call of every case is all-False, nothing is stored, no
    host byte changes, and the process exits 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", CHILD, daemon.address, TOKEN, json.dumps(BAD_INDICES), daemon.transport], env=env,
                       capture_output=True, text=True, timeout=600)
    done = dict(json.loads(line[7:]) for line in r.stdout.splitlines() if line.startswith("RESULT "))
    assert r.returncode == 0, (f"the SGLang process died (exit {r.returncode}) after cases {sorted(done)}:\n"
                               f"{r.stderr[-3000:]}")
    want = {"set_v2": [False] * 4, "set_v1": [False] * 4, "get_v1": [False] * 4, "get_v2": [False] * 4,
            "fresh stored": 0, "host bytes unchanged": True}
    assert done == {name: want for name in BAD_INDICES}
    assert "kvtier backend:" in r.stderr      # the log lines saying why


def test_whole_pages_at_the_pools_last_page_still_work(daemon):
    """The bounds are not off by one the other way: the host pool's last page stores and loads."""
    pools = HostPools()
    b = make_backend(pools, {"address": daemon.address, "token": TOKEN, "timeout_s": 30, "transport": daemon.transport})
    idx = torch.arange(pools.kv.size - 2 * PS, pools.kv.size)
    pools.fill(idx, seed=12)
    want = pools.snapshot(idx)
    keys = page_keys(2, salt=43)
    store(b, keys, idx)
    pools.zero(idx)
    assert load(b, keys, idx) == ([True, True], [True, True])
    for (kv, ix), (kv0, ix0) in zip(pools.snapshot(idx), want):
        assert torch.equal(kv, kv0) and torch.equal(ix, ix0)


def test_none_and_garbage_in_every_public_method_never_raise(daemon):
    """Scenario (adversarial finding 07): ``batch_get_v2(None)`` raised TypeError and
    ``batch_exists_v2(keys, ["x"])`` AttributeError into SGLang's controller. Every public method
    now answers a miss / False for None and garbage arguments, and good calls still work after."""
    pools = HostPools()
    b = make_backend(pools, {"address": daemon.address, "token": TOKEN, "timeout_s": 30, "transport": daemon.transport})
    keys = page_keys(2, salt=44)
    idx = pools.alloc(2)
    pools.fill(idx, seed=13)
    store(b, keys, idx)
    bad_transfer = PoolTransfer(name=PoolName.INDEXER, host_indices=None, keys=keys)
    for transfers in (None, ["x"], [None], 5, [bad_transfer]):
        assert b.batch_get_v2(transfers) in ({}, {PoolName.INDEXER: [False, False]})
        assert b.batch_set_v2(transfers) in ({}, {PoolName.INDEXER: [False, False]})
        r = b.batch_exists_v2(keys, transfers)
        assert isinstance(r, PoolTransferResult)
    assert b.batch_exists_v2(keys, ["x"]).kv_hit_pages == 0
    assert b.batch_exists_v2(None, None).kv_hit_pages == 0
    for keys_arg in (None, 5, [None, None]):
        assert b.batch_set_v1(keys_arg, idx) in ([], [False, False])
        assert b.batch_get_v1(keys_arg, idx) in ([], [False, False])
        assert b.batch_get(keys_arg, None) in ([], [None, None])
        assert b.batch_set(keys_arg, [torch.zeros(3)]) is False
        assert b.batch_exists(keys_arg) == 0
    assert b.get(None, None) is None and b.set(None, "abc") is False and b.exists(None) is False
    assert b.batch_set_v1(keys, None) == [False, False] and b.batch_get_v1(keys, idx.tolist()) == [False, False]
    hit = b.batch_exists_v2(keys, indexer(keys, None, hit_policy=PoolHitPolicy.ALL_PAGES))
    assert hit.kv_hit_pages == 2                                   # the good units are still there
    assert load(b, keys, pools.alloc(2)) == ([True, True], [True, True])
