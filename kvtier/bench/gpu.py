"""The GPU benchmarks and checks ``scripts/gpu-check`` runs (``python -m kvtier.bench.gpu``).

Each function takes the device to run on: ``"cuda"`` on a GPU machine; ``"cpu"`` runs the same code
where torch allows (the "link" is then a host memcpy, nothing is page-locked), which is how this
module is tested on a machine without a GPU.

* :func:`link_copies`: ``get_cpu_copy`` / ``load_cpu_copy`` of one GLM-5.2 request as SGLang calls
  them (device pool -> page-locked host and back), against a plain ``copy_`` of the same bytes
  between one device buffer and one reused page-locked host buffer (the link's limit), interleaved,
  as ratios (targets 0.8x); the loaded slots are checked byte for byte.
* :func:`planned_pool`: a pool of the exact plan's tokens for a byte budget allocates exactly the
  planned bytes (the pool's arenas; on CUDA also the allocator's count, which rounds each block up
  to 512 bytes).
* :func:`served_planned_pool`: the same through ``kvtier serve --device D --pool glm-5.2:TOKENS``
  (the daemon's own pool listing).
* :func:`gpu_document` / :func:`failures`: the ``results.json`` object and what in it failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.case import Comparison, Figure, interleaved, throughput
from kvtier.bench.copies import fill_random, scattered_pages
from kvtier.private_writes import private_dirs, write_private_file
from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import create_pool, slots_of_pages
from kvtier.server.pool_configurator import exact_pool_bytes, max_total_num_tokens

GET_TARGET = LOAD_TARGET = 0.8
"""Issue 26: ``get_cpu_copy`` and ``load_cpu_copy`` at least 0.8x the plain copy over the same link."""

CUDA_ALLOC_ROUND = 512
"""torch's CUDA caching allocator rounds every block up to a multiple of this many bytes."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def link_copies(device: str = "cuda", *, pool_tokens: int = 32768, request_tokens: int = 4096, reps: int = 15,
                warmup: int = 2, seed: int = 0) -> dict[str, Any]:
    """Time a request's host copy both ways against the link's plain copy of the same bytes.

    Args:
        device: the pool's device (``"cuda"``, ``"cuda:1"``, or ``"cpu"``).
        pool_tokens: the GLM-5.2 fp8 pool's tokens (78 layers, 656-byte rows, 21 indexer layers).
        request_tokens: the request's tokens, on whole pages scattered over the pool.
        reps, warmup: timed and untimed interleaved rounds.

    Returns:
        ``{"comparisons": [Comparison], "figures": {...}, "checks": {name: {"ok": bool, ...}}}``:
        comparisons ``gpu.get_cpu_copy_vs_link`` and ``gpu.load_cpu_copy_vs_link`` (GB/s, 1e9 bytes
        a second, ratios > 1: kvtier faster); checks ``copy_byte_exact`` and, on CUDA,
        ``host_copy_page_locked``.

    Raises:
        ValueError: a request that does not fit the pool twice over.
    """
    dev = torch.device(device)
    model = DSAModelConfig.from_preset("glm-5.2")
    ps = model.page_size
    pool = create_pool(model, pool_tokens, role="target", device=dev)
    fill_random(pool, 1) if dev.type == "cpu" else _fill_device(pool, seed + 1)
    src_pages, dst_pages = scattered_pages(pool.num_slots // ps, request_tokens // ps, seed)
    src, dst = slots_of_pages(src_pages, ps).to(dev), slots_of_pages(dst_pages, ps).to(dev)
    nbytes = pool.cpu_copy_nbytes(src)
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    host_buf.fill_(0)  # faulted once, reused by every call
    kept = pool.get_cpu_copy(src)
    _sync(dev)

    def plain_get() -> None:
        host_buf.copy_(dev_buf)
        _sync(dev)

    def plain_load() -> None:
        dev_buf.copy_(host_buf)
        _sync(dev)

    def kvtier_load() -> None:
        pool.load_cpu_copy(kept, dst)
        _sync(dev)

    t = interleaved({"kvtier_get": lambda: pool.get_cpu_copy(src), "plain_get": plain_get,
                     "kvtier_load": kvtier_load, "plain_load": plain_load}, reps, warmup=warmup)
    exact = all(torch.equal(b[dst], b[src]) for b in pool.kv_buffer) and all(
        torch.equal(b[dst[::ps] // ps], b[src[::ps] // ps]) for b in pool.index_k_with_scale_buffer if b.numel())
    checks: dict[str, dict[str, Any]] = {"copy_byte_exact": {"ok": bool(exact), "what": "load_cpu_copy left the source slots' bytes at the target slots"}}
    if dev.type == "cuda":
        checks["host_copy_page_locked"] = {"ok": bool(kept["kv"][0][0].is_pinned()),
                                           "what": "get_cpu_copy's chunks lie in page-locked host memory"}
    link = "device -> page-locked host" if dev.type == "cuda" else "host memcpy (no device)"
    comparisons = [
        Comparison("gpu.get_cpu_copy_vs_link", f"get_cpu_copy(indices) as SGLang calls it vs one plain copy_ of the same bytes, {link}",
                   "GB/s", throughput("kvtier get_cpu_copy(indices)", nbytes, t["kvtier_get"]),
                   throughput(f"plain copy_, {link}", nbytes, t["plain_get"]), target=GET_TARGET),
        Comparison("gpu.load_cpu_copy_vs_link", "load_cpu_copy(copy, indices) vs one plain copy_ of the same bytes back",
                   "GB/s", throughput("kvtier load_cpu_copy(copy, indices)", nbytes, t["kvtier_load"]),
                   throughput("plain copy_, back", nbytes, t["plain_load"]), target=LOAD_TARGET),
    ]
    figures = {"bytes": nbytes, "pool_tokens": pool_tokens, "request_tokens": request_tokens, "reps": reps, "warmup": warmup,
               "seconds": t}
    del kept
    return {"comparisons": comparisons, "figures": figures, "checks": checks}


def _fill_device(pool: Any, seed: int) -> None:
    """Every byte of a device pool's buffers from a seeded device generator."""
    g = torch.Generator(device=pool.device).manual_seed(seed)
    bufs = [b.view(torch.uint8).reshape(-1) for b in pool.kv_buffer] + [b.reshape(-1) for b in pool.index_k_with_scale_buffer]
    for buf in bufs:
        if buf.numel():
            buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8, device=pool.device, generator=g))


def planned_pool(device: str = "cuda", available_bytes: int = 4 << 30) -> dict[str, Any]:
    """Create the GLM-5.2 pool the exact plan fits in ``available_bytes`` on ``device``; check that
    its arenas hold exactly the planned bytes (and, on CUDA, that the allocator's count grew by those
    bytes, each arena rounded up to :data:`CUDA_ALLOC_ROUND`).

    Returns:
        ``{"ok": bool, "tokens", "planned_bytes", "pool_bytes", "cuda_allocated_delta"}`` (the last
        None off CUDA).
    """
    dev = torch.device(device)
    model = DSAModelConfig.from_preset("glm-5.2")
    tokens = max_total_num_tokens(model, available_bytes, skip_aware=True, accounting="exact")
    planned = exact_pool_bytes(model, tokens)
    _sync(dev)
    before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
    pool = create_pool(model, tokens, role="target", device=dev)
    _sync(dev)
    arenas = pool.arena_nbytes()
    pool_bytes = sum(arenas.values())
    delta = None if before is None else torch.cuda.memory_allocated(dev) - before
    ok = pool_bytes == planned and planned <= available_bytes
    if delta is not None:
        ok = ok and planned <= delta < planned + CUDA_ALLOC_ROUND * max(len(arenas), 1)
    del pool
    return {"ok": bool(ok), "tokens": tokens, "available_bytes": available_bytes, "planned_bytes": planned,
            "pool_bytes": pool_bytes, "cuda_allocated_delta": delta}


def served_planned_pool(device: str = "cuda", available_bytes: int = 4 << 30) -> dict[str, Any]:
    """``kvtier serve --device DEVICE --pool gpu=glm-5.2:TOKENS`` with the exact plan's tokens for
    ``available_bytes``: the daemon's pool listing reports exactly the planned bytes on that device.

    Returns:
        ``{"ok": bool, "tokens", "planned_bytes", "served_bytes", "served_device"}``.

    Raises:
        RuntimeError: the daemon did not start (the message holds its log's tail).
    """
    from kvtier.client import KVTierClient
    from kvtier.client.spawn import DaemonProcess

    model = DSAModelConfig.from_preset("glm-5.2")
    tokens = max_total_num_tokens(model, available_bytes, skip_aware=True, accounting="exact")
    planned = exact_pool_bytes(model, tokens)
    args = ["--device", device.split(":")[0], "--pool", f"gpu=glm-5.2:{tokens}", "--host-memory", "64MiB", "--log-level", "WARNING"]
    with DaemonProcess(extra_args=args, startup_timeout=180) as d, KVTierClient(d.address) as c:
        info = next(p for p in c.list_pools() if p.pool_id == "gpu")
    served_device = info.device
    ok = info.kv_size_bytes == planned and served_device.startswith(device.split(":")[0])
    return {"ok": bool(ok), "tokens": tokens, "planned_bytes": planned, "served_bytes": int(info.kv_size_bytes),
            "served_device": served_device}


def gpu_document(device: str, *, copies: dict[str, Any] | None, checks: dict[str, dict[str, Any]],
                 tests: dict[str, Any] | None = None, started: float | None = None) -> dict[str, Any]:
    """The ``results.json`` object of a GPU check.

    Args:
        device: what ran (``"cuda"`` or ``"cpu"``).
        copies: :func:`link_copies`' result (None: not run).
        checks: name -> ``{"ok": bool, ...}`` (planned pools, test outcomes, ...).
        tests: the pytest summary (``{"passed", "failed", "errors", "skipped", "exit_code"}``), None if not run.

    Returns:
        ``{"kvtier_gpu_check": 1, "device", "machine", "tests", "checks", "comparisons", "figures",
        "ok"}``; ``ok`` is False when a test failed, a check is not ok, or a comparison missed its
        target (:func:`failures` names them).
    """
    from kvtier.bench.report import machine_info

    m = machine_info()
    if device.startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.device(device))
        m["gpu"] = {"name": p.name, "memory_bytes": p.total_memory, "torch_cuda": torch.version.cuda}
    all_checks = dict(checks)
    comparisons = []
    figures: dict[str, Any] = {}
    if copies is not None:
        all_checks.update(copies["checks"])
        comparisons = [c.to_dict() for c in copies["comparisons"]]
        figures["copies"] = copies["figures"]
    doc = {"kvtier_gpu_check": 1, "device": device, "started": started or time.time(), "machine": m, "tests": tests,
           "checks": all_checks, "comparisons": comparisons, "figures": figures}
    doc["ok"] = not failures(doc)
    return doc


def failures(doc: dict[str, Any]) -> list[str]:
    """What failed in a :func:`gpu_document`: ``tests`` (any failed or errored test, or pytest's exit
    status), each check not ok, each comparison below its target."""
    bad = []
    t = doc.get("tests")
    if t is not None and (t.get("failed") or t.get("errors") or t.get("exit_code") not in (0, None)):
        bad.append(f"tests ({t.get('failed', 0)} failed, {t.get('errors', 0)} errors, exit {t.get('exit_code')})")
    bad += [f"check {name}" for name, c in doc["checks"].items() if not c.get("ok")]
    bad += [f"{c['key']} {c['ratio']:.2f}x < {c['target']:g}x" for c in doc["comparisons"] if c.get("meets_target") is False]
    return bad


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtier.bench.gpu --out DIR [--device cuda] [--quick] [--tests JSON]``: run the
    benchmarks and checks, write ``DIR/results.json``, print one line a figure; exit 1 when
    :func:`failures` names anything."""
    ap = argparse.ArgumentParser(prog="python -m kvtier.bench.gpu", description=main.__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="a small pool and few rounds (for tests)")
    ap.add_argument("--tests", type=Path, default=None, help="a JSON file: {'summary': {...}, 'checks': {...}} from the test run")
    a = ap.parse_args(argv)
    started = time.time()
    tests, checks = None, {}
    if a.tests is not None:
        given = json.loads(a.tests.read_text())
        tests, checks = given.get("summary"), dict(given.get("checks", {}))
    sizes = dict(pool_tokens=4096, request_tokens=1024, reps=3, warmup=1) if a.quick else {}
    budget = (64 << 20) if a.quick else (4 << 30)
    copies = link_copies(a.device, **sizes)
    checks["planned_pool"] = planned_pool(a.device, budget)
    checks["served_planned_pool"] = served_planned_pool(a.device, budget)
    doc = gpu_document(a.device, copies=copies, checks=checks, tests=tests, started=started)
    private_dirs(a.out)
    write_private_file(a.out / "results.json", json.dumps(doc, indent=1, default=str) + "\n")
    for c in doc["comparisons"]:
        print(f"{c['key']}: kvtier {c['kvtier']['value']:.2f} GB/s, link {c['baseline']['value']:.2f} GB/s, "
              f"ratio {c['ratio']:.2f}x (target {c['target']:g}x)")
    for name, c in doc["checks"].items():
        print(f"check {name}: {'ok' if c.get('ok') else 'FAILED'}")
    bad = failures(doc)
    print("gpu-check: all passed" if not bad else "gpu-check: FAILED: " + "; ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("GLOG_minloglevel", "2")
    sys.exit(main())
