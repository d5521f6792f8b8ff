"""Faults injected while the soak runs (``test_soak.py``), each checked against what the daemon promises.

One fault thread in the test's process loops, for the soak's whole length:

* **a cancelled write**: slots written with content A, then a WriteKV of content B whose request
  stream stalls after its header and first chunk and is cancelled by the client: the call ends
  CANCELLED and the slots still hold A, byte for byte (all or nothing);
* **a cancelled write that allocates**: WriteKV with ``allocate_tokens`` stalled after its first
  chunk and cancelled: CANCELLED, and its pages go back (the soak's end state, equal to its start);
* **an abandoned read**: a ReadKV of a whole page run taken one 4 KiB message and cancelled (the
  daemon's hold watch lets the pool's lock go);
* **a write past its deadline**: a WriteKV of B with a 1 ms deadline: DEADLINE_EXCEEDED or done, and
  the slots then hold A or B whole, never a mix;

and once in each soak two processes die by SIGKILL:

* **a writer killed mid-stream** (``stalled_writer.py``): its WriteKV has sent a header and one chunk;
  its slots (the fault thread's) still hold A afterwards;
* **an attached worker killed holding slots and a lease** (``attach_worker.py hold``): its session's
  pages and pins come back (the soak's end state, equal to its start, checks it).

A call a fault makes may fail only with the status the fault causes (CANCELLED, DEADLINE_EXCEEDED);
any other error, or bytes that differ, is recorded and fails the soak, as does any error of the
ordinary workers running beside it.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from pathlib import Path

import grpc
import torch

from kvtier.client import DeadlineExceededError, KVTierClient, UnavailableError
from kvtier.client.pool import slot_list
from kvtier.client.wire import encode_write_chunk
from kvtier.v1 import pool_pb2

PS = 64
LAYERS = 2
POOL = "soak"
HERE = Path(__file__).parent
STALLED_WRITER = HERE / "stalled_writer.py"
ATTACH_WORKER = HERE / "attach_worker.py"


def latent_content(seed: int, n: int) -> dict[int, torch.Tensor]:
    """Seeded latent rows ``{layer: (n, 656) uint8}`` for layers 0..LAYERS-1."""
    g = torch.Generator().manual_seed(seed)
    return {x: torch.randint(0, 256, (n, 656), dtype=torch.uint8, generator=g) for x in range(LAYERS)}


def stalled_requests(c: KVTierClient, pool_id: str, slots: torch.Tensor | None, latent: dict[int, torch.Tensor],
                     sent: threading.Event, gate: threading.Event):
    """WriteKV's serialized requests for ``latent`` on ``slots`` (None: allocating pages for its
    rows): the header and the first 4 KiB of layer 0, then nothing until ``gate`` is set (the
    stream never completes)."""
    header = pool_pb2.KVHeader(pool_id=pool_id, slots=[] if slots is None else slot_list(slots), latent_layers=list(latent),
                               layout_digest=c.layout(pool_id).fingerprint_digest)
    n = len(latent[0]) if slots is None else 0
    yield encode_write_chunk(0, 0, 0, [], header=header.SerializeToString(), allocate_tokens=n)
    rows = memoryview(latent[0].numpy()).cast("B")
    yield encode_write_chunk(0, pool_pb2.COMPONENT_LATENT, 0, [rows[:4096]])
    sent.set()
    gate.wait(60)


def once_written(fn, bound_s: float = 30.0):
    """``fn()`` once no write still arriving holds the slots it names. A write this thread cancelled,
    let run past its deadline or killed ends on the daemon's own thread a moment after its client gave
    up; until then the daemon refuses its slots UNAVAILABLE "changed nothing" (a write into named slots
    claims their pages), which is safe to retry. Any other error, or a claim past ``bound_s``, raises."""
    end = time.monotonic() + bound_s
    while True:
        try:
            return fn()
        except UnavailableError as e:
            if not e.unchanged or time.monotonic() > end:
                raise
            time.sleep(0.02)


def holds(c: KVTierClient, slots: torch.Tensor, latent: dict[int, torch.Tensor], *, settle: bool = True) -> bool:
    """Whether ``slots`` hold ``latent``; ``settle``: read once no write that a fault broke off holds them
    (:func:`once_written`)."""
    read = lambda: c.read_kv(POOL, slots, latent_layers=list(latent), index_layers=[])  # noqa: E731
    kv = once_written(read) if settle else read()
    return all(torch.equal(kv.latent[x], latent[x]) for x in latent)


class Faults:
    """The fault thread's state: counts of each fault made and every broken promise seen."""

    def __init__(self, address: str, seconds: float, seed: int = 7) -> None:
        self.address, self.seconds = address, seconds
        self.rng = random.Random(seed)
        self.ops: Counter[str] = Counter()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.errors.append("the fault thread did not finish")

    # ----- the loop -----------------------------------------------------------------------------
    def _run(self) -> None:
        end = time.monotonic() + self.seconds
        kills = [self.killed_writer, self.killed_attached_worker]
        kill_at = sorted(self.rng.uniform(0.2, 0.6) * self.seconds for _ in kills)
        start = time.monotonic()
        with KVTierClient(self.address, timeout=60, retries=0, chunk_bytes=4096) as c:
            while time.monotonic() < end or kills:  # every kill runs, even when a loaded machine ran out of time
                faults = [self.cancelled_write, self.cancelled_new_write, self.abandoned_read, self.deadline_write]
                if kills and time.monotonic() - start >= kill_at[0]:
                    kill_at.pop(0)
                    faults = [kills.pop(0)]
                for fault in faults:
                    try:
                        fault(c)
                        self.ops[fault.__name__] += 1
                    except Exception as e:  # noqa: BLE001 - every broken promise is reported
                        self.errors.append(f"{fault.__name__}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")

    # ----- faults in this process ---------------------------------------------------------------
    def _stall_and_cancel(self, c: KVTierClient, slots: torch.Tensor | None, latent: dict[int, torch.Tensor], what: str) -> None:
        """A WriteKV of ``latent`` (on ``slots``; None: allocating) stalled after its first chunk and
        cancelled: it must end CANCELLED (or INVALID_ARGUMENT, had the stream's end won the race)."""
        sent, gate = threading.Event(), threading.Event()
        call = c._write_kv_raw.future(stalled_requests(c, POOL, slots, latent, sent, gate), timeout=30)
        try:
            if not sent.wait(30):
                raise AssertionError(f"the stalled {what} never sent its first chunk")
            time.sleep(self.rng.uniform(0, 0.05))
            call.cancel()
        finally:
            gate.set()
        try:
            call.result(30)
            raise AssertionError(f"a cancelled {what} succeeded")
        except grpc.FutureCancelledError:
            pass
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.INVALID_ARGUMENT):
                raise AssertionError(f"a cancelled {what} ended {e.code().name}: {e.details()}") from None

    def cancelled_write(self, c: KVTierClient) -> None:
        n = self.rng.randint(1, 3) * PS
        slots = c.allocate_slots(POOL, n)
        try:
            a, b = latent_content(self.rng.getrandbits(31), n), latent_content(self.rng.getrandbits(31), n)
            c.write_kv(POOL, slots, latent=a)
            self._stall_and_cancel(c, slots, b, "write")
            if not holds(c, slots, a):
                raise AssertionError("a cancelled write changed the slots it named")
        finally:
            once_written(lambda: c.free_slots(POOL, slots))

    def cancelled_new_write(self, c: KVTierClient) -> None:
        n = self.rng.randint(1, 3) * PS
        self._stall_and_cancel(c, None, latent_content(self.rng.getrandbits(31), n), "write that allocates")

    def abandoned_read(self, c: KVTierClient) -> None:
        n = 4 * PS
        slots = c.allocate_slots(POOL, n)
        try:
            a = latent_content(self.rng.getrandbits(31), n)
            c.write_kv(POOL, slots, latent=a)
            header = pool_pb2.KVHeader(pool_id=POOL, slots=slot_list(slots), latent_layers=list(a),
                                       layout_digest=c.layout(POOL).fingerprint_digest)
            stream = c._read_kv_raw(pool_pb2.ReadKVRequest(header=header, chunk_bytes=4096, packed=True), timeout=30)
            next(stream)
            stream.cancel()
            if not holds(c, slots, a, settle=False):  # the pool still serves this client (and everyone else) at once
                raise AssertionError("slots read back differ after an abandoned read")
        finally:
            once_written(lambda: c.free_slots(POOL, slots))

    def deadline_write(self, c: KVTierClient) -> None:
        n = self.rng.randint(1, 3) * PS
        slots = c.allocate_slots(POOL, n)
        try:
            a, b = latent_content(self.rng.getrandbits(31), n), latent_content(self.rng.getrandbits(31), n)
            c.write_kv(POOL, slots, latent=a)
            try:
                c.write_kv(POOL, slots, latent=b, timeout=0.001)
            except DeadlineExceededError:
                self.ops["deadline_write_timed_out"] += 1
            if not (holds(c, slots, a) or holds(c, slots, b)):
                raise AssertionError("a write past its deadline left a mix of old and new bytes")
        finally:
            once_written(lambda: c.free_slots(POOL, slots))

    # ----- processes killed with SIGKILL --------------------------------------------------------
    @staticmethod
    def _start_then_kill(argv: list[str], started) -> None:
        """Run ``argv``, wait for its first line to satisfy ``started``, then SIGKILL it."""
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            if not line or not started(line):
                raise AssertionError(f"{Path(argv[1]).name} did not start: {line!r} {proc.stderr.read()[-2000:]}")
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def killed_writer(self, c: KVTierClient) -> None:
        n = 2 * PS
        slots = c.allocate_slots(POOL, n)
        try:
            seed_a, seed_b = self.rng.getrandbits(31), self.rng.getrandbits(31)
            a = latent_content(seed_a, n)
            c.write_kv(POOL, slots, latent=a)
            self._start_then_kill([sys.executable, str(STALLED_WRITER), self.address, POOL, json.dumps(slots.tolist()),
                                   str(seed_b)], lambda line: line.strip() == "sent")
            if not holds(c, slots, a):
                raise AssertionError("a writer killed mid-stream changed the slots it named")
        finally:
            once_written(lambda: c.free_slots(POOL, slots))

    def killed_attached_worker(self, c: KVTierClient) -> None:
        keys = [uuid.uuid4().bytes]
        self._start_then_kill([sys.executable, str(ATTACH_WORKER), self.address, "soak-pfx", "hold",
                               json.dumps({"slots": PS, "keys": [k.hex() for k in keys]})],
                              lambda line: bool(json.loads(line).get("ready")))
