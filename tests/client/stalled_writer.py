"""A WriteKV that never finishes, for the soak's faults: ``python stalled_writer.py ADDRESS POOL SLOTS_JSON SEED``.

Sends the header and the first chunk of seeded latent rows for SLOTS, prints ``sent`` and waits to be
killed (SIGKILL: the daemon sees the connection drop mid-stream).
"""

from __future__ import annotations

import json
import sys
import threading

import torch
from soak_faults import latent_content, stalled_requests

from kvtier.client import KVTierClient


def main() -> None:
    address, pool_id, slots, seed = sys.argv[1], sys.argv[2], torch.tensor(json.loads(sys.argv[3])), int(sys.argv[4])
    sent, never = threading.Event(), threading.Event()
    with KVTierClient(address, timeout=600, retries=0, chunk_bytes=4096) as c:
        call = c._write_kv_raw.future(stalled_requests(c, pool_id, slots, latent_content(seed, slots.numel()), sent, never),
                                      timeout=600)
        if not sent.wait(60):
            raise SystemExit(f"the first chunk was not sent: {call}")
        print("sent", flush=True)
        never.wait()


if __name__ == "__main__":
    main()
