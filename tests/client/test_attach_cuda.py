"""Local attach on a CUDA device: a worker opens the daemon's pool arenas by CUDA IPC handle.

Marked ``cuda``: left out of the default run, selected with ``-m cuda`` on a machine with a GPU,
where a missing device makes them fail. The daemon runs with ``--device cuda``; the worker is
another process (``attach_worker.py``), so the handles really cross a process boundary.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess

pytestmark = pytest.mark.cuda

WORKER = Path(__file__).with_name("attach_worker.py")
ARGS = ["--device", "cuda", "--host-memory", "64MiB", "--log-level", "INFO", "--pool", "glm-5.2:1024", "--pool-layers", "4"]


@pytest.fixture(scope="module")
def daemon():
    assert torch.cuda.is_available(), "a cuda-marked test needs a CUDA device"
    with DaemonProcess(extra_args=ARGS) as d:
        yield d


def test_the_attached_pool_is_the_daemons_device_memory(daemon):
    with KVTierClient(daemon.address) as c, c.attach("default") as ap:
        assert ap.device == "cuda" and ap.kv_buffer[0].is_cuda and ap.index_k_with_scale_buffer[0].is_cuda
        slots = ap.allocate_slots(128)
        rows = torch.randint(0, 256, (128, 656), dtype=torch.uint8, device=ap.kv_buffer[0].device)
        ap.set_kv_buffer(2, slots.to(rows.device), rows)
        keys = torch.randint(0, 256, (128, 128), dtype=torch.uint8, device=rows.device)
        scales = torch.rand(128, device=rows.device)
        ap.set_index_k_scale_buffer(1, slots.to(rows.device), keys, scales)
        torch.cuda.synchronize()  # the ordering rule: the worker's writes are complete before the daemon reads
        kv = c.read_kv("default", slots, latent_layers=[2], index_layers=[1])
        assert torch.equal(kv.latent[2], rows.cpu()) and torch.equal(kv.index_k[1], keys.cpu())
        assert torch.equal(kv.index_scale[1], scales.cpu())
        ptrs, lens, _ = ap.get_contiguous_buf_infos()
        base = ap.pool.arena("latent").data_ptr()
        assert ptrs[0] == base and ptrs[1] == base + lens[0]


def test_offload_restore_on_attached_device_memory(daemon):
    with KVTierClient(daemon.address) as c, c.attach("default") as ap:
        slots = ap.allocate_slots(64)
        dev = ap.kv_buffer[0].device
        rows = torch.randint(0, 256, (64, 656), dtype=torch.uint8, device=dev)
        for layer in range(4):
            ap.kv_buffer[layer][slots.to(dev)] = rows.view(64, 1, 656)
        torch.cuda.synchronize()
        ap.offload("cuda-copy", slots, free_slots=True)
        back = ap.restore("cuda-copy", drop=True)
        for layer in range(4):
            assert torch.equal(ap.kv_buffer[layer][back.to(dev)].view(64, 656), rows)


def test_a_killed_cuda_worker_gives_its_slots_back(daemon):
    with KVTierClient(daemon.address) as c:
        used = c.describe_pool("default").used_pages
        p = subprocess.Popen([sys.executable, str(WORKER), daemon.address, "default", "hold",
                              json.dumps({"slots": 128, "keys": []})], stdout=subprocess.PIPE, text=True)
        try:
            assert json.loads(p.stdout.readline())["ready"]
            assert c.describe_pool("default").used_pages == used + 2
            p.send_signal(signal.SIGKILL)
            p.wait(30)
            deadline = time.monotonic() + 2.0
            while c.describe_pool("default").used_pages != used:
                assert time.monotonic() < deadline, "slots not back within 2 s"
                time.sleep(0.02)
        finally:
            p.kill()
            p.wait()
