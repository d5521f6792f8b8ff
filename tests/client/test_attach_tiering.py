"""Zero-copy tiering on attached memory: Offload, Restore and PullKV act on what a worker wrote
through its tensors, and what they bring back is read through the tensors; staging buffers; an
attached worker outliving a daemon killed with SIGKILL.

Each worker here is this test process, attached to daemons running as subprocesses; expected bytes
come from seeds (``kv_helpers``).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from kv_helpers import LAYERS4, LIVE4, PAGE_SIZE, random_kv

from kvtier.client import KVTierClient, ResourceExhaustedError, UnavailableError
from kvtier.client.spawn import DaemonProcess

ARGS = ["--device", "cpu", "--host-memory", "16MiB", "--log-level", "INFO", "--pool", "glm-5.2:512", "--pool-layers", "4"]


def write_through_tensors(ap, slots: torch.Tensor, seed: int) -> None:
    latent, index = random_kv(slots.numel(), seed, layers=LAYERS4, live=LIVE4)
    for layer, rows in latent.items():
        ap.kv_buffer[layer][slots] = rows.view(-1, 1, 656)
    for layer, (keys, scales) in index.items():
        ap.set_index_k_scale_buffer(layer, slots, keys, scales)


def assert_tensors_hold(ap, slots: torch.Tensor, seed: int) -> None:
    latent, index = random_kv(slots.numel(), seed, layers=LAYERS4, live=LIVE4)
    for layer, rows in latent.items():
        assert torch.equal(ap.kv_buffer[layer][slots].view(-1, 656), rows), f"latent layer {layer}"
    for layer, (keys, scales) in index.items():
        k, s = ap.get_index_k_scale(layer, slots)
        assert torch.equal(k, keys) and torch.equal(s, scales), f"indexer layer {layer}"


@pytest.fixture(scope="module")
def daemon():
    with DaemonProcess(extra_args=ARGS) as d:
        yield d


def test_offload_and_restore_move_what_the_tensors_hold(daemon):
    with KVTierClient(daemon.address) as c:
        with c.attach("default") as ap:
            slots = ap.allocate_slots(3 * PAGE_SIZE - 5)  # a partial last page too
            write_through_tensors(ap, slots, seed=11)
            r = ap.offload("req-1", slots, free_slots=True)
            assert r.freed_pages == 3 and r.num_tokens == 3 * PAGE_SIZE - 5
            for layer in LAYERS4:
                ap.kv_buffer[layer][slots] = 0  # the pages are free now; scribble (they are no longer ours)
            back = ap.restore("req-1", drop=True)  # fresh slots of this session, filled when it returns
            assert_tensors_hold(ap, back, seed=11)
            assert c.describe_pool("default").used_pages == 3
        deadline = time.monotonic() + 5
        while c.describe_pool("default").used_pages and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.describe_pool("default").used_pages == 0  # detach gave them back


def test_pullkv_moves_pages_a_worker_wrote_into_pages_another_worker_reads(tmp_path):
    """Prefill worker writes 2 pages through its tensors on daemon P; the decode worker on daemon D
    pulls them into its own session's pages (PullKV, gRPC transport) and reads them through its tensors."""
    # both on unix sockets (attach needs them): D lists P as a PD peer (--pd-peers), else it refuses the pull
    with DaemonProcess(extra_args=ARGS) as p, DaemonProcess(extra_args=[*ARGS, "--pd-peers", p.address]) as d:
        with KVTierClient(p.address) as pc, pc.attach("default") as prefill, \
                KVTierClient(d.address) as dc, dc.attach("default") as decode:
            src = prefill.allocate_slots(2 * PAGE_SIZE)
            write_through_tensors(prefill, src, seed=21)
            dst = decode.allocate_slots(2 * PAGE_SIZE)
            r = decode.client.pull_kv("default", p.address, "default", src_pages=(src[::PAGE_SIZE] // PAGE_SIZE).tolist(),
                                      dst_pages=(dst[::PAGE_SIZE] // PAGE_SIZE).tolist(), transport="grpc")
            assert r.index_bytes == len(LIVE4) * 2 * 8448
            assert_tensors_hold(decode, dst, seed=21)


def test_staging_buffers_are_shared_with_the_daemon_and_freed_with_the_session(tmp_path):
    config = tmp_path / "kvtier.toml"
    config.write_text('attach_staging_bytes = "2MiB"\n')
    with DaemonProcess(extra_args=[*ARGS, "--config", str(config)]) as d, KVTierClient(d.address) as c:
        pid = d.process.pid

        def daemon_staging_fds() -> int:
            return sum(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:kvtier-staging")
                       for fd in os.listdir(f"/proc/{pid}/fd") if os.path.exists(f"/proc/{pid}/fd/{fd}"))

        ap = c.attach("default")
        assert ap.staging_max_bytes == 2 << 20
        a, b = ap.staging_buffer(1 << 20), ap.staging_buffer(1 << 20)
        assert a.numel() == b.numel() == 1 << 20 and a.data_ptr() != b.data_ptr()
        a.fill_(1)
        assert int(b.sum()) == 0
        assert daemon_staging_fds() == 2
        assert "memfd:kvtier-staging" in open(f"/proc/{pid}/maps").read()
        with pytest.raises(ResourceExhaustedError, match="at most 2097152 bytes"):
            ap.staging_buffer(1)
        ap.detach()
        deadline = time.monotonic() + 5
        while daemon_staging_fds() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert daemon_staging_fds() == 0
        assert int(a.sum()) == 0  # revoked at detach like the pool's memory


def test_a_worker_outlives_a_daemon_killed_with_sigkill(tmp_path):
    """The daemon dies (kill -9) under an attached worker: nothing is left in /dev/shm, the worker's
    mapping stays readable (the memory lives as long as a mapping does), its calls fail UNAVAILABLE,
    and detach still works."""
    before = sorted(os.listdir("/dev/shm"))
    d = DaemonProcess(extra_args=ARGS)
    d.start()
    try:
        c = KVTierClient(d.address, timeout=5, retries=0)
        ap = c.attach("default")
        slots = ap.allocate_slots(PAGE_SIZE)
        write_through_tensors(ap, slots, seed=31)
        d.signal(signal.SIGKILL)
        d.wait(30)
        assert_tensors_hold(ap, slots, seed=31)
        with pytest.raises(UnavailableError):
            ap.allocate_slots(PAGE_SIZE)
        ap.detach()
        c.close()
    finally:
        d.stop()
        d.cleanup()
    assert sorted(os.listdir("/dev/shm")) == before
