"""Concurrent calls on one pool: independent requests stay intact; a read never sees half a write."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from kv_helpers import random_kv, verify_kv

from kvtier.client import KVTierClient


def test_parallel_requests_keep_their_bytes(daemon, pool):
    """Four workers write, read, offload and restore their own requests at the same time."""
    def worker(i: int) -> None:
        with KVTierClient(daemon.address, timeout=60) as c:
            for round_ in range(3):
                slots = c.allocate_slots(pool, 70)
                latent, index = random_kv(70, seed=100 * i + round_)
                c.write_kv(pool, slots, latent=latent, index=index)
                verify_kv(c.read_kv(pool, slots), latent, index)
                key = f"{pool}-w{i}-r{round_}"
                c.offload(pool, key, slots, free_slots=True)
                back = c.restore(pool, key, drop=True)
                verify_kv(c.read_kv(pool, back), latent, index)
                c.free_slots(pool, back)

    with ThreadPoolExecutor(4) as ex:
        for f in [ex.submit(worker, i) for i in range(4)]:
            f.result()


def test_reads_see_whole_writes(daemon, client, pool):
    """While one client rewrites 128 slots with uniform byte patterns, every concurrent read sees exactly one pattern."""
    slots = client.allocate_slots(pool, 128)
    layers = list(range(8))
    client.write_kv(pool, slots, latent={l: torch.zeros(128, 656, dtype=torch.uint8) for l in layers})
    stop = threading.Event()
    seen: list[set[int]] = []

    def writer() -> None:
        try:
            with KVTierClient(daemon.address, timeout=60) as c:
                for v in range(1, 21):
                    c.write_kv(pool, slots, latent={l: torch.full((128, 656), v, dtype=torch.uint8) for l in layers})
        finally:  # readers stop even when a write fails
            stop.set()

    def reader() -> None:
        with KVTierClient(daemon.address, timeout=60) as c:
            while not stop.is_set():
                kv = c.read_kv(pool, slots, index_layers=[])
                seen.append(set(torch.cat([kv.latent[l].reshape(-1) for l in layers]).unique().tolist()))

    threads = [threading.Thread(target=writer, daemon=True)] + [threading.Thread(target=reader, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert seen and all(len(s) == 1 for s in seen), [s for s in seen if len(s) != 1][:3]
    final = client.read_kv(pool, slots, index_layers=[])
    assert all(bool((final.latent[l] == 20).all()) for l in layers)


def test_offloads_racing_tier_stats_never_hang(tmp_path):
    """Regression (issue 8, defect 1), the issue's repro: one client offloads copies (dropping the one
    20 back) through a 1 MiB host tier that spills each older copy to LMDB while another polls
    GetTierStats. It hung after 6-23 offloads (the host tier's index lock and its counter lock were
    taken in opposite orders); afterwards AllocateSlots never returned and SIGTERM did not stop the
    daemon. Every call here has a 15 s deadline, so a hang fails the test instead of stalling it."""
    import signal

    from kvtier.client.spawn import DaemonProcess

    args = ["--device", "cpu", "--pool", "default=glm-5.2:4096", "--pool-layers", "4", "--host-memory", "1MiB",
            "--disk-path", str(tmp_path / "disk"), "--disk-size", "64MiB", "--log-level", "WARNING"]
    errors: list[BaseException] = []
    done = threading.Event()
    polls = [0]
    with DaemonProcess(extra_args=args) as d:
        def offloader() -> None:
            try:
                with KVTierClient(d.address, timeout=15, retries=0) as c:
                    slots = c.allocate_slots("default", 256)
                    for i in range(60):
                        c.offload("default", f"k{i}", slots)
                        if i >= 20:
                            c.drop(f"k{i - 20}")
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
            finally:
                done.set()

        def poller() -> None:
            try:
                with KVTierClient(d.address, timeout=15, retries=0) as c:
                    while not done.is_set():
                        c.tier_stats("")
                        polls[0] += 1
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=offloader, daemon=True), threading.Thread(target=poller, daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors and not any(t.is_alive() for t in threads), errors
        with KVTierClient(d.address, timeout=15, retries=0) as c:
            assert c.allocate_slots("default", 64).numel() == 64
            moves = c.tier_stats("").moves
            assert moves["device->host"]["count"] == 60 and moves["host->disk"]["count"] == 59 and polls[0] > 0
        d.signal(signal.SIGTERM)
        assert d.wait(60) == 0
