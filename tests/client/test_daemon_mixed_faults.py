"""Every kind of call at once while the disk fills up and a writer is SIGKILLed mid-stream.

One real daemon (device, a host tier of three page copies, LMDB with a 3 MiB budget on an 8 MiB tmpfs -- or, where mounting
is not allowed, the injected EIO of ``KVTIER_DISK_FAULT_FILE``) serves four client threads at once --
KV write/read round trips, offload + restore, prefix requests that evict down the stack, monitoring
(stats, tier stats, health, pools, ``kvtier status --json`` as a user runs it) -- while a fault thread
fills the disk's filesystem until the disk tier turns unhealthy, frees it and waits for the tier to
come back, and SIGKILLs a WriteKV stalled after its first chunk (``stalled_writer.py``).

Asserted, worked out from the contract (README "Run the daemon", "Tiers"), not read back from kvtier:
every call either succeeds with exactly the bytes written or fails with the status the fault causes --
a restore whose copy is on the unhealthy disk is UNAVAILABLE, one whose copy the full disk made the
host tier drop is NOT_FOUND -- and nothing else (no INTERNAL, no UNKNOWN, no other code); the daemon
stays SERVING throughout; the disk tier is seen unhealthy and then SERVING again; the killed writer's
slots hold their old bytes; afterwards the pool's free pages are back at their start and the daemon
exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import torch
from kv_helpers import LAYERS4, LIVE4, PAGE_SIZE, offload_page, put_prefix_pages, random_kv, verify_kv
from small_fs import small_tmpfs, write_ballast
from soak_faults import Faults

from kvtier.client import KVTierClient
from kvtier.client.errors import NotFoundError, UnavailableError
from kvtier.client.spawn import DaemonProcess
from kvtier.page_keys import page_keys

POOL = "default"
RECORD = 64 * (4 * 656 + 3 * 132)  # bytes of one page copy of GLM-5.2's first 4 layers (+ a small header)
STALLED_WRITER = Path(__file__).with_name("stalled_writer.py")
LOAD_SECONDS_AFTER_FAULTS = 2.0


class Mix:
    """The client threads' shared record: what ran, what failed as allowed, what broke a promise."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.ops: Counter[str] = Counter()
        self.errors: list[str] = []
        self.disk_health: list[str] = []

    def loop(self, name: str, step) -> None:
        i = 0
        with KVTierClient(self.address, timeout=60) as c:
            while not self.stop.is_set():
                try:
                    outcome = step(c, i)
                    with self.lock:
                        self.ops[f"{name}:{outcome}"] += 1
                except Exception as e:  # noqa: BLE001 - every broken promise is reported
                    with self.lock:
                        self.errors.append(f"{name}: {type(e).__name__}: {e}")
                i += 1

    # ----- the four kinds of client work --------------------------------------------------------
    @staticmethod
    def kv_round_trip(c: KVTierClient, i: int) -> str:
        slots = c.allocate_slots(POOL, PAGE_SIZE)
        try:
            latent, index = random_kv(PAGE_SIZE, 10_000 + i, layers=LAYERS4, live=LIVE4)
            c.write_kv(POOL, slots, latent=latent, index=index)
            verify_kv(c.read_kv(POOL, slots), latent, index)
        finally:
            c.free_slots(POOL, slots)
        return "ok"

    @staticmethod
    def offload_restore(c: KVTierClient, i: int) -> str:
        key, seed = f"mix-{uuid.uuid4().hex}", 20_000 + i
        offload_page(c, POOL, key, seed)
        try:
            slots = c.restore(POOL, key)
        except UnavailableError as e:  # the copy went down to the disk, which is unhealthy now
            assert "disk tier is unhealthy" in str(e), e
            return "unavailable"
        except NotFoundError:  # the full disk made the host tier drop it (counted as gone)
            return "gone"
        finally:
            c.drop(key)
        try:
            verify_kv(c.read_kv(POOL, slots), *random_kv(PAGE_SIZE, seed, layers=LAYERS4, live=LIVE4))
        finally:
            c.free_slots(POOL, slots)
        return "restored"

    @staticmethod
    def prefix(c: KVTierClient, i: int) -> str:
        keys = page_keys(list(range((i % 40 + 4) * PAGE_SIZE)), PAGE_SIZE)[-4:]  # 4 pages, 40 prefixes in turn
        put_prefix_pages(c, "px", keys, seed=30_000 + i)
        return "ok"

    def monitor(self, c: KVTierClient, i: int) -> str:
        c.stats()
        c.tier_stats()
        c.list_pools()
        assert c.health("") == "SERVING", "the daemon left SERVING"
        disk = c.health("kvtier.tier.disk")
        with self.lock:
            self.disk_health.append(disk)
        if i % 5 == 0:
            r = subprocess.run([sys.executable, "-m", "kvtier.cli", "status", "--server", self.address, "--json"],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["health"] == "SERVING"
        return "ok"


def wait_for(pred, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def killed_writer(c: KVTierClient, address: str) -> None:
    """A WriteKV stalled after its first chunk and SIGKILLed: the slots it named keep their old bytes."""
    slots = c.allocate_slots(POOL, 2 * PAGE_SIZE)
    try:
        old = random_kv(2 * PAGE_SIZE, 99, layers=LAYERS4, live=LIVE4)
        c.write_kv(POOL, slots, latent=old[0], index=old[1])
        Faults._start_then_kill([sys.executable, str(STALLED_WRITER), address, POOL, json.dumps(slots.tolist()), "7"],
                                lambda line: line.strip() == "sent")

        def holds_old() -> bool:
            try:
                verify_kv(c.read_kv(POOL, slots), *old)
                return True
            except UnavailableError:  # the killed write's claim is still being given up
                return False

        wait_for(holds_old, "the killed writer's slots to be readable")
    finally:
        wait_for(lambda: _free(c, slots), "the killed writer's slots to be freed")


def _free(c: KVTierClient, slots: torch.Tensor) -> bool:
    try:
        c.free_slots(POOL, slots)
        return True
    except UnavailableError:
        return False


def test_every_kind_of_call_while_the_disk_fills_and_a_writer_is_killed(tmp_path):
    fs = tmp_path / "fs"
    with small_tmpfs(fs, "8m") as mounted:
        fault_file = tmp_path / "fault"
        config = tmp_path / "kvtier.toml"
        config.write_text("[tiers]\ndisk_probe_backoff_max_seconds = 2\n")
        args = ["--config", str(config), "--device", "cpu", "--log-level", "WARNING", "--pool", f"{POOL}=glm-5.2:2048",
                "--pool-layers", "4", "--host-memory", str(3 * RECORD + 4096), "--disk-path", str(fs / "lmdb"),
                "--disk-size", "3MiB", "--workers", "32"]  # the tier's budget fits the filesystem: only the ballast fills it
        env = {"KVTIER_DISK_FAULT_FILE": str(fault_file)} if not mounted else {}
        with DaemonProcess(extra_args=args, env=env) as d, KVTierClient(d.address, timeout=60) as c:
            c.create_pool("glm-5.2", num_layers=4, size_tokens=8 * PAGE_SIZE, pool_id="px")
            free_at_start = {p.pool_id: p.free_pages for p in c.list_pools()}[POOL]
            mix = Mix(d.address)
            work = [("kv", mix.kv_round_trip), ("offload", mix.offload_restore), ("offload", mix.offload_restore),
                    ("prefix", mix.prefix), ("monitor", mix.monitor)]
            threads = [threading.Thread(target=mix.loop, args=w, daemon=True) for w in work]
            for t in threads:
                t.start()
            try:
                wait_for(lambda: "SERVING" in mix.disk_health, "the monitor to see the disk serving")
                # the disk fills (a ballast file takes the tmpfs; or the injected EIO) until its tier fails
                if mounted:
                    write_ballast(fs / "ballast", leave_free=64 << 10)
                else:
                    fault_file.touch()
                wait_for(lambda: c.health("kvtier.tier.disk") != "SERVING", "the disk tier to turn unhealthy")
                killed_writer(c, d.address)  # while the disk is down
                wait_for(lambda: "NOT_SERVING" in mix.disk_health, "the monitor to see the disk unhealthy")
                if mounted:
                    os.remove(fs / "ballast")
                else:
                    fault_file.unlink()
                wait_for(lambda: c.health("kvtier.tier.disk") == "SERVING", "the disk tier to come back")
                wait_for(lambda: mix.disk_health[-1] == "SERVING", "the monitor to see the disk serving again")
                time.sleep(LOAD_SECONDS_AFTER_FAULTS)
            finally:
                mix.stop.set()
                for t in threads:
                    t.join(120)
            print(f"mixed faults ({'tmpfs' if mounted else 'injected EIO'}): {dict(mix.ops)}, "
                  f"disk health seen {Counter(mix.disk_health)}")
            assert not any(t.is_alive() for t in threads)
            assert mix.errors == [], mix.errors[:5]
            for kind in ("kv:ok", "offload:restored", "prefix:ok", "monitor:ok"):
                assert mix.ops[kind] > 0, (kind, mix.ops)
            seen = mix.disk_health
            assert seen[0] == "SERVING" and "NOT_SERVING" in seen and seen[-1] == "SERVING", seen
            assert {p.pool_id: p.free_pages for p in c.list_pools()}[POOL] == free_at_start
        assert d.returncode == 0, d.log_tail()
