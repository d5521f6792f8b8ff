"""The Mooncake Transfer Engine behind a small typed wrapper: register ranges once, run batches.

``mooncake.engine.TransferEngine`` (package ``mooncake-transfer-engine-non-cuda`` on CPU machines,
extra ``kvtier[mooncake]``; needs Debian's libibverbs1, librdmacm1, libnuma1) moves bytes between
registered memory of two processes. This wrapper

* starts one engine in peer-to-peer handshake mode and publishes ``"host:rpc_port"``;
* registers ranges derived from buffer infos (:func:`registration_ranges`: adjacent per-layer
  buffers merged, so a kvtier pool registers each component arena once), never an overlapping or
  zero-length range;
* runs a :class:`TransferPlan` batch by batch with ``batch_transfer_sync_read``, checks every return
  code (0 is success) and raises :class:`TransferError` otherwise;
* can fail the k-th batch of every transfer on purpose (``fail_batch``, or the environment
  variable ``KVTIER_TRANSFER_FAIL_BATCH``) so tests can check what a failure leaves behind.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.server.pool.buffer_info import BufInfos
from kvtier.server.transfer.errors import TransferEngineUnavailable, TransferError
from kvtier.server.transfer.plan import TransferPlan

FAIL_BATCH_ENV = "KVTIER_TRANSFER_FAIL_BATCH"
INSTALL_HINT = (
    "install it with `pip install 'kvtier[mooncake]'` (package mooncake-transfer-engine-non-cuda) "
    "and Debian's libibverbs1 librdmacm1 libnuma1"
)


def fail_batch_from_env() -> int | None:
    """``KVTIER_TRANSFER_FAIL_BATCH`` as a 1-based batch number, or None when unset/empty.

    Raises:
        ValueError: set to something other than a positive integer.
    """
    raw = os.environ.get(FAIL_BATCH_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{FAIL_BATCH_ENV} must be a positive integer (1-based batch), got {raw!r}")
    return int(raw)


def check_injected_failure(fail_batch: int | None, batch: int, transport: str) -> None:
    """Raise the injected :class:`TransferError` when ``batch`` (0-based) is the ``fail_batch``-th."""
    if fail_batch is not None and batch + 1 == fail_batch:
        raise TransferError(f"{transport}: injected failure in batch {batch + 1} ({FAIL_BATCH_ENV}/fail_batch)", batch=batch)


def registration_ranges(*infos: BufInfos) -> list[tuple[int, int]]:
    """Disjoint, non-empty ``(ptr, nbytes)`` ranges covering every buffer of ``infos``.

    Entries with zero length (skip layers) are dropped; touching or overlapping entries are merged,
    so per-layer views of one arena become one range.
    """
    spans = sorted((p, p + n) for ptrs, lens, _ in infos for p, n in zip(ptrs, lens) if n > 0)
    merged: list[list[int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b - a) for a, b in merged]


@dataclass(frozen=True)
class TransferEngineConfig:
    """Settings of the Mooncake Transfer Engine.

    Attributes:
        host: address the engine binds and publishes (loopback by default).
        protocol: Mooncake transport; ``"tcp"`` works everywhere, ``"rdma"`` needs RDMA NICs.
        metadata: ``"P2PHANDSHAKE"`` (peers exchange segment metadata directly; no metadata server).
        fail_batch: fail the k-th (1-based) batch of every transfer on purpose (tests); None: never.
    """

    host: str = "127.0.0.1"
    protocol: str = "tcp"
    metadata: str = "P2PHANDSHAKE"
    fail_batch: int | None = None


def _load_engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # no wheel, or its shared libraries (libibverbs.so.1, ...) are missing
        reason = " ".join(str(e).split())
        raise TransferEngineUnavailable(f"the Mooncake Transfer Engine is not available ({reason}); {INSTALL_HINT}") from None
    return TransferEngine


def check_engine_available() -> None:
    """Import the Mooncake Transfer Engine now (the daemon does, before it allocates any pool).

    Raises:
        TransferEngineUnavailable: the wheel or one of its Debian libraries is missing (one line that
            names what is missing and how to install it).
    """
    _load_engine_class()


class MooncakeTransferEngine:
    """One Mooncake Transfer Engine: registered ranges, an endpoint, checked batched reads.

    Args:
        config: :class:`TransferEngineConfig`.

    Raises:
        TransferEngineUnavailable: the package is missing or ``initialize`` failed.
    """

    name = "mooncake"

    def __init__(self, config: TransferEngineConfig | None = None) -> None:
        self.config = config or TransferEngineConfig()
        engine_cls = _load_engine_class()
        self._engine = engine_cls()
        c = self.config
        rc = self._engine.initialize(c.host, c.metadata, c.protocol, "")
        if rc != 0:
            raise TransferEngineUnavailable(f"Mooncake TransferEngine.initialize({c.host!r}, {c.metadata!r}, {c.protocol!r}) returned {rc}")
        self.endpoint = f"{c.host}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def registered(self) -> list[tuple[int, int]]:
        """``(ptr, nbytes)`` ranges registered now, sorted."""
        with self._lock:
            return sorted(self._registered.items())

    def register(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Register ``(ptr, nbytes)`` ranges, all or none.

        Raises:
            ValueError: a range of length <= 0, or one overlapping another (given or registered).
            TransferError: the engine refused a range (those registered by this call are undone).
        """
        new = sorted((int(p), int(n)) for p, n in ranges)
        with self._lock:
            for p, n in new:
                if n <= 0 or p <= 0:
                    raise ValueError(f"cannot register range ({p:#x}, {n}): empty or null")
            spans = sorted(new + list(self._registered.items()))
            for (p0, n0), (p1, _) in zip(spans, spans[1:]):
                if p0 + n0 > p1:
                    raise ValueError(f"range ({p1:#x}) overlaps a registered range ({p0:#x}, {n0} bytes)")
            done: list[int] = []
            for p, n in new:
                rc = self._engine.register_memory(p, n)
                if rc != 0:
                    for q in done:  # undo this call's registrations; the original error is what matters
                        self._engine.unregister_memory(q)
                        del self._registered[q]
                    raise TransferError(f"Mooncake register_memory({p:#x}, {n}) returned {rc}", return_code=rc)
                self._registered[p] = n
                done.append(p)

    def unregister(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Unregister ranges registered by :meth:`register` (unknown ones are ignored).

        Every range is tried; they are forgotten here either way.

        Raises:
            TransferError: the engine returned non-zero for some range (naming the first).
        """
        failed: list[tuple[int, int]] = []
        with self._lock:
            for p, _ in ranges:
                if self._registered.pop(int(p), None) is not None:
                    rc = self._engine.unregister_memory(int(p))
                    if rc != 0:
                        failed.append((int(p), rc))
        if failed:
            p, rc = failed[0]
            raise TransferError(f"Mooncake unregister_memory({p:#x}) returned {rc} ({len(failed)} ranges failed)", return_code=rc)

    def read(self, peer: str, plan: TransferPlan) -> None:
        """Pull every item of ``plan`` from ``peer`` (its ``src_addr``) to local ``dst_addr``.

        Batches run in order; the first failure stops the transfer (later batches never start).

        Raises:
            TransferError: a non-zero return code (naming the batch) or the injected failure;
                destination bytes are then undefined.
        """
        for b, batch in enumerate(plan.batches):
            check_injected_failure(self.config.fail_batch, b, "mooncake")
            rc = self._engine.batch_transfer_sync_read(
                peer, [it.dst_addr for it in batch], [it.src_addr for it in batch], [it.nbytes for it in batch]
            )
            if rc != 0:
                raise TransferError(
                    f"Mooncake batch_transfer_sync_read from {peer} failed with return code {rc} in batch "
                    f"{b + 1} of {len(plan.batches)} ({len(batch)} ranges, {sum(i.nbytes for i in batch)} bytes)",
                    batch=b, return_code=rc,
                )

    def read_raw(self, peer: str, local_addr: int, remote_addr: int, nbytes: int) -> None:
        """One ``transfer_sync_read`` (the benchmark's baseline). Raises TransferError on rc != 0."""
        rc = self._engine.transfer_sync_read(peer, local_addr, remote_addr, nbytes)
        if rc != 0:
            raise TransferError(f"Mooncake transfer_sync_read from {peer} returned {rc}", return_code=rc)

    def read_ranges(self, peer: str, local: Sequence[int], remote: Sequence[int], lengths: Sequence[int]) -> None:
        """One ``batch_transfer_sync_read`` of parallel lists. Raises TransferError on rc != 0."""
        rc = self._engine.batch_transfer_sync_read(peer, list(local), list(remote), list(lengths))
        if rc != 0:
            raise TransferError(f"Mooncake batch_transfer_sync_read from {peer} returned {rc}", return_code=rc)
