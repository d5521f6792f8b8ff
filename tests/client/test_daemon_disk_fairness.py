"""One tenant's disk writes do not hold up another tenant's durable calls (attack pass 8, A8-5).

A durable Offload waits for its copy's commit, and a Drop, a Restore(drop=True) and a ClearUnits
wait for the writes queued before them. Before the fix they waited until the disk tier's
write-behind queue was *empty*: while tenant B wrote units faster than the disk committed, the queue
never emptied, and every durable Offload of tenant A was told DEADLINE_EXCEEDED (and taken back), its
Drop too. Now a wait is for the jobs queued before it, and the writer commits what waits in one
transaction (group commit), so a backlog costs one commit, not one a job.

The disk is made slow on purpose (the test-only hook: 0.2 s before every commit), and B's writer
keeps putting write-through units, each answered at once, for the whole test.
"""

from __future__ import annotations

import os
import threading
import time

import torch

from kvtier.client import KVTierClient
from kvtier.client.spawn import DaemonProcess
from kvtier.client.storage import UnitSpaceSpec

TOKEN_A = "fair-tenant-a-0123456789abcdef"
TOKEN_B = "fair-tenant-b-0123456789abcdef"
SPACE = UnitSpaceSpec("glm-5.2", num_layers=4, start_layer=0, kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128,
                      kv_cache_dtype="fp8", page_size=64, latent_row_bytes=656, skip_mask="FFFS")


def test_a_tenants_durable_calls_are_not_starved_by_another_tenants_steady_disk_writes(tmp_path):
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = "team-a"\n"{TOKEN_B}" = "team-b"\n')
    os.chmod(tokens, 0o600)
    slow = tmp_path / "slow"
    args = ["--device", "cpu", "--auth-tokens", str(tokens), "--disk-path", str(tmp_path / "disk"),
            "--disk-size", "1GiB", "--host-memory", "64MiB", "--write-through", "--workers", "8"]
    nb = SPACE.part_nbytes("both")
    with DaemonProcess(extra_args=args, env={"KVTIER_TEST_DISK_SLOW_FILE": str(slow)}) as d, \
            KVTierClient(d.address, timeout=60, token=TOKEN_A) as a, \
            KVTierClient(d.address, timeout=60, token=TOKEN_B) as b:
        a.create_pool("glm-5.2", num_layers=4, size_tokens=1024, pool_id="ap")
        slots = a.allocate_slots("ap", 64)
        a.write_kv("ap", slots, latent={l: torch.full((64, 656), 0x41 + l, dtype=torch.uint8) for l in range(4)})
        want = a.read_kv("ap", slots)
        assert a.offload("ap", "before", slots).durable
        slow.write_text("0.2")  # every disk commit now takes 0.2 s; B's units come every ~10 ms
        stop, put = threading.Event(), [0]

        def b_writes() -> None:
            while not stop.is_set():
                b.put_units(SPACE, [b"b-%d" % put[0]], "both", torch.full((nb,), put[0] % 251, dtype=torch.uint8))
                put[0] += 1
                time.sleep(0.01)

        writer = threading.Thread(target=b_writes)
        writer.start()
        try:
            time.sleep(1.0)  # B's backlog builds: its units come faster than the disk commits them
            with KVTierClient(d.address, timeout=5, retries=0, token=TOKEN_A) as late:
                durable = [late.offload("ap", f"k{i}", slots).durable for i in range(3)]
                assert late.drop("before") > 0
                got = late.restore("ap", "k0", drop=True)
                cleared = late.clear_units(SPACE)  # A's own space: none of B's units
            still_writing = writer.is_alive()
        finally:
            stop.set()
            writer.join(60)
            slow.unlink()
        assert durable == [True, True, True]
        assert still_writing and put[0] > 50  # B wrote all along
        assert cleared == 0
        back = a.read_kv("ap", got)
        assert all(torch.equal(back.latent[l], want.latent[l]) for l in want.latent)
        out = torch.zeros(nb, dtype=torch.uint8)
        assert b.get_units(SPACE, [b"b-7"], "both", out) == [True]  # B's units are B's, whole
        assert torch.equal(out, torch.full((nb,), 7, dtype=torch.uint8))
