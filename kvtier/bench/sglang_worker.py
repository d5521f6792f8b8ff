"""SGLang 0.5.23's own ``DSATokenToKVPool`` in a worker process, for ``kvtier bench``'s copy case.

Run by another interpreter (one whose environment imports SGLang; kvtier need not be installed
there): ``PYTHON sglang_worker.py``. It imports only torch and SGLang. Protocol, one JSON object a
line:

* stdin, first line: ``{"size", "page_size", "layers", "skip" (list of bool), "src", "dst" (slot
  lists), "threads", "seed"}``; stdout answers ``{"ready": true, "sglang": version, "torch": version,
  "nbytes": bytes of one copy}`` once the pool exists and is filled with random bytes;
* then ``"get"`` (time ``pool.get_cpu_copy(src)``; the copy is kept for ``load``), ``"load"`` (time
  ``pool.load_cpu_copy(copy, dst)``), ``"check"`` (whether ``dst`` now holds ``src``'s latent rows and
  indexer pages), ``"quit"``; each answered with ``{"seconds": s}`` or ``{"ok": bool}``.

On a machine without CUDA, SGLang's ``torch.cuda.synchronize()`` calls (which wait for nothing on a
CPU pool) are made no-ops, and its parallel context is told there is one decode-context-parallel
rank (``attn_dcp_size=1, attn_dcp_rank=0``), as a single-GPU server has.
"""

from __future__ import annotations

import json
import sys
import time


_OUT = sys.stdout


def main() -> None:
    sys.stdout = sys.stderr  # whatever SGLang prints on import must not mix with the replies
    import torch

    setup = json.loads(sys.stdin.readline())
    torch.set_num_threads(int(setup["threads"]))
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None  # CPU pool: nothing to wait for
    import sglang
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0)
    size, ps, layers = int(setup["size"]), int(setup["page_size"]), int(setup["layers"])
    pool = DSATokenToKVPool(
        size=size, page_size=ps, kv_lora_rank=512, dtype=torch.float8_e4m3fn, qk_rope_head_dim=64, layer_num=layers,
        device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=656, index_buf_size=size,
        skip_topk_layers=[bool(s) for s in setup["skip"]],
    )
    g = torch.Generator().manual_seed(int(setup["seed"]))
    for buf in list(pool.kv_buffer) + list(pool.index_k_with_scale_buffer):
        flat = buf.view(torch.uint8).reshape(-1)
        if flat.numel():
            flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=g))
    src = torch.tensor(setup["src"], dtype=torch.int64)
    dst = torch.tensor(setup["dst"], dtype=torch.int64)
    copy = pool.get_cpu_copy(src)
    nbytes = sum(c.nbytes for layer in copy["kv"] for c in layer) + sum(c.nbytes for layer in copy["index_k"] for c in layer)
    reply({"ready": True, "sglang": sglang.__version__, "torch": torch.__version__, "nbytes": nbytes})
    for line in sys.stdin:
        op = line.strip()
        if op == "get":
            copy = None  # the previous copy is dropped first, as a caller that offloads again would
            t = time.perf_counter()
            copy = pool.get_cpu_copy(src)
            reply({"seconds": time.perf_counter() - t})
        elif op == "load":
            t = time.perf_counter()
            pool.load_cpu_copy(copy, dst)
            reply({"seconds": time.perf_counter() - t})
        elif op == "check":
            ok = all(torch.equal(b[dst], b[src]) for b in pool.kv_buffer)
            sp, dp = src[::ps] // ps, dst[::ps] // ps
            ok = ok and all(torch.equal(b[dp], b[sp]) for b in pool.index_k_with_scale_buffer if b.numel())
            reply({"ok": bool(ok)})
        elif op == "quit":
            return
        else:
            reply({"error": f"unknown op {op!r}"})


def reply(obj: dict) -> None:
    _OUT.write(json.dumps(obj) + "\n")
    _OUT.flush()


if __name__ == "__main__":
    main()
