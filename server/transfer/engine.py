"""The Mooncake Transfer Engine behind a small typed wrapper: register ranges once, run batches.

``mooncake.engine.TransferEngine`` (package ``mooncake-transfer-engine-non-cuda`` on CPU machines,
extra ``kvtier[mooncake]``; needs Debian's libibverbs1, librdmacm1, libnuma1) moves bytes between
registered memory of two processes. This wrapper

* starts one engine in peer-to-peer handshake mode and publishes ``"host:rpc_port"``;
* registers ranges derived from buffer infos (:func:`registration_ranges`: adjacent per-layer
  buffers merged, so a kvtier pool registers each component arena once), never an overlapping or
  zero-length range;
* runs a :class:`TransferPlan` batch by batch with ``batch_transfer_sync_read``, each range cut into
  engine requests of about :data:`MAX_REQUEST_BYTES` (:func:`engine_requests`), checks every return
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

#: A plan's ranges are handed to the engine in requests of at most this many bytes, cut evenly. A
#: GLM-5.2 request's 99 ranges (78 of 2.7 MB, 21 of 0.5 MB) go whole; the cap only cuts the layer
#: ranges of long requests (86 MB a layer at 128k tokens) so the TCP transport's lanes share them.
#: In ``kvtier bench --case pd`` (two shared cores), PullKV of that request ran 0.83-1.22x one
#: contiguous raw read (median 0.86x, 7 runs) in pieces of <= 1 MiB and 0.82-1.03x (median 0.91x,
#: 10 runs) with 4 MiB, 16 MiB or no cut; 1.96-2.17 GB/s vs 1.99-2.33 (BENCHMARKS.md, fix 21).
MAX_REQUEST_BYTES = 16 << 20

#: The most requests one engine call carries (the engine fails above ~2,000 queued a peer).
MAX_ENGINE_BATCH = 1024
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


def engine_requests(items: Sequence[Any], max_bytes: int) -> tuple[list[int], list[int], list[int]]:
    """``(dst_addrs, src_addrs, lengths)`` of the engine requests that move ``items`` (objects with
    ``dst_addr``, ``src_addr``, ``nbytes``): each item whole when it holds at most ``max_bytes``,
    else cut into at most ``ceil(nbytes / max_bytes)`` pieces of even size (rounded up to a multiple
    of 64 bytes where that stays within ``max_bytes``; the last one the rest), in order, every piece
    at most ``max_bytes``. ``max_bytes <= 0``: every item whole."""
    dsts: list[int] = []
    srcs: list[int] = []
    lens: list[int] = []
    for it in items:
        d, s, n = it.dst_addr, it.src_addr, it.nbytes
        if max_bytes <= 0 or n <= max_bytes:
            dsts.append(d)
            srcs.append(s)
            lens.append(n)
            continue
        k = -(-n // max_bytes)
        piece = -(-n // k)  # <= max_bytes
        if (piece + 63) // 64 * 64 <= max_bytes:  # a cap that is no multiple of 64 may leave no room to round
            piece = (piece + 63) // 64 * 64
        for off in range(0, n, piece):
            dsts.append(d + off)
            srcs.append(s + off)
            lens.append(min(piece, n - off))
    return dsts, srcs, lens


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
        host: address the engine publishes to peers (loopback by default). The engine's own
            listeners (its P2P handshake port and the TCP transport's data port) bind every
            interface whatever this says; Mooncake offers no setting for it.
        protocol: Mooncake transport; ``"tcp"`` works everywhere, ``"rdma"`` needs RDMA NICs.
        metadata: ``"P2PHANDSHAKE"`` (peers exchange segment metadata directly; no metadata server).
        fail_batch: fail the k-th (1-based) batch of every transfer on purpose (tests); None: never.
        max_request_bytes: ranges longer than this are read as several engine requests of even
            size (:data:`MAX_REQUEST_BYTES`; 0: every range one request).
    """

    host: str = "127.0.0.1"
    protocol: str = "tcp"
    metadata: str = "P2PHANDSHAKE"
    fail_batch: int | None = None
    max_request_bytes: int = MAX_REQUEST_BYTES


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

        Batches run in order, each as engine requests of at most ``max_request_bytes``
        (:func:`engine_requests`; :data:`MAX_ENGINE_BATCH` a call); the first failure stops the
        transfer (later batches never start).

        Raises:
            TransferError: a non-zero return code (naming the batch) or the injected failure;
                destination bytes are then undefined.
        """
        for b, batch in enumerate(plan.batches):
            check_injected_failure(self.config.fail_batch, b, "mooncake")
            dsts, srcs, lens = engine_requests(batch, self.config.max_request_bytes)
            for at in range(0, len(lens), MAX_ENGINE_BATCH):
                end = at + MAX_ENGINE_BATCH
                rc = self._engine.batch_transfer_sync_read(peer, dsts[at:end], srcs[at:end], lens[at:end])
                if rc != 0:
                    raise TransferError(
                        f"Mooncake batch_transfer_sync_read from {peer} failed with return code {rc} in batch "
                        f"{b + 1} of {len(plan.batches)} ({len(batch)} ranges, {sum(it.nbytes for it in batch)} bytes)",
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
