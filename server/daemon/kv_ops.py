"""KV operations on a daemon pool: slots, read, move, offload, restore, drop, buffer infos, and the
stream segments every KV stream is made of (writes: :mod:`kvtier.server.daemon.kv_write`).

Every operation checks all of its input before it changes anything.

KV streams are made of *segments*: one per (layer, component), holding that component's bytes for
every slot in slot order. Components: ``latent`` (``latent_row_bytes`` a token), ``index_k``
(``index_head_dim`` FP8 bytes a token) and ``index_scale`` (``index_head_dim // 128`` FP32 values a
token); the indexer components exist on live layers only. A data message carries at least
:data:`MIN_CHUNK_BYTES` unless it ends its segment, so a stream's message count stays bounded by its
bytes (a 1-byte-chunk stream cannot hold a worker for hours).

Every operation takes the :class:`~kvtier.server.daemon.tenants.Caller` explicitly: it sees only its
tenant's pools and copies. A caller in an attach session owns the slots it allocates; pages owned
by another session are never freed, written, moved onto or restored into (FAILED_PRECONDITION).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.server.pool.buffer_info import BufInfos
from kvtier.server.daemon.config import MIN_CHUNK_BYTES
from kvtier.server.daemon.errors import Cancelled, FailedPrecondition, InvalidArgument, always, still_wanted
from kvtier.server.daemon.offload_store import HostCopy, OffloadStore
from kvtier.server.daemon.pools import PoolEntry, PoolRegistry
from kvtier.server.daemon.tenants import Caller

LATENT, INDEX_K, INDEX_SCALE = "latent", "index_k", "index_scale"
COMPONENTS = (LATENT, INDEX_K, INDEX_SCALE)


@dataclass(frozen=True)
class Segment:
    """One (layer, component) part of a KV stream: ``nbytes`` = slots x bytes a token."""

    layer_id: int
    component: str
    nbytes: int


@dataclass(frozen=True)
class KVSelection:
    """Which KV a stream carries: ``slots`` of pool ``pool_id``, latent rows of ``latent_layers``,
    indexer keys and scales of ``index_layers``."""

    pool_id: str
    slots: Any
    latent_layers: tuple[int, ...]
    index_layers: tuple[int, ...]
    layout_digest: str = ""
    """If set, the layout the caller assumes: the pool's fingerprint digest must equal it."""


def chunk_size(requested: int, default: int, maximum: int) -> int:
    """Data bytes a streamed message may carry: ``requested`` (0: ``default``), checked.

    Raises:
        InvalidArgument: below :data:`MIN_CHUNK_BYTES` (a stream of tiny messages would hold a
            worker for hours) or above ``maximum`` (``max_message_bytes`` less the message overhead).
    """
    chunk = requested or default
    if chunk < MIN_CHUNK_BYTES:
        raise InvalidArgument(f"chunk_bytes {chunk} is below the minimum of {MIN_CHUNK_BYTES}")
    if chunk > maximum:
        raise InvalidArgument(f"chunk_bytes {chunk} exceeds {maximum} (max_message_bytes less room for the other fields)")
    return chunk


def token_bytes(entry: PoolEntry, component: str) -> int:
    """Bytes a token of ``component`` takes in ``entry``'s pool."""
    pool = entry.pool
    return {LATENT: pool.row_bytes, INDEX_K: pool.index_head_dim, INDEX_SCALE: pool.index_scale_bytes}[component]


def plan_segments(entry: PoolEntry, sel: KVSelection, n_slots: int) -> list[Segment]:
    """The segments of ``sel`` in stream order (latent layers, then per index layer keys then scales).
    Layers are model layer ids (a pipeline stage's pool holds ``[start_layer, end_layer)``).

    Raises:
        InvalidArgument: a layer out of range or repeated, or nothing selected.
        FailedPrecondition: indexer data asked of a skip-topk layer (it owns no indexer buffer), or
            ``sel.layout_digest`` differs from the pool's.
    """
    if sel.layout_digest and sel.layout_digest != entry.model.fingerprint_digest():
        raise FailedPrecondition(
            f"pool {entry.pool_id!r} has layout {entry.model.fingerprint_digest()}, not the {sel.layout_digest} the "
            f"request assumes (was the pool re-created?)")
    pool = entry.pool
    start, end = pool.start_layer, pool.end_layer
    for what, layers in (("latent_layers", sel.latent_layers), ("index_layers", sel.index_layers)):
        bad = [x for x in layers if not start <= x < end]
        if bad:
            raise InvalidArgument(f"{what} has layer {bad[0]} outside the pool's layers [{start}, {end})")
        if len(set(layers)) != len(layers):
            raise InvalidArgument(f"{what} repeats a layer")
    skipped = [x for x in sel.index_layers if pool.skip_topk_layers[x - start]]
    if skipped:
        raise FailedPrecondition(
            f"layer {skipped[0]} skips top-k in pool {entry.pool_id!r} and owns no indexer buffer "
            f"(live layers: {[start + i for i in pool.live_layers]})")
    if not sel.latent_layers and not sel.index_layers:
        raise InvalidArgument("select at least one latent or index layer")
    segs = [Segment(x, LATENT, n_slots * token_bytes(entry, LATENT)) for x in sel.latent_layers]
    for x in sel.index_layers:
        segs.append(Segment(x, INDEX_K, n_slots * token_bytes(entry, INDEX_K)))
        segs.append(Segment(x, INDEX_SCALE, n_slots * token_bytes(entry, INDEX_SCALE)))
    return segs


def allocate_slots(registry: PoolRegistry, caller: Caller, pool_id: str, num_tokens: int,
                   wanted: Callable[[], bool] = always) -> tuple[torch.Tensor, int]:
    """Allocate whole pages for ``num_tokens`` (owned by the caller's attach session, if any);
    returns ``(slots (num_tokens,) int64, page_size)``. ``wanted``: whether the caller is still
    there (:func:`still_wanted`; the same for every call below that changes the pool).

    Raises:
        NotFound: unknown pool, or the caller's session ended. ResourceExhausted: too few free pages.
        Cancelled: the caller gave up while the call waited for the pool, or while the prefix cache
            made room (its pages written down to a slow disk): the pages are freed again (attack
            pass 7, A7-4: they were left allocated to no one).
    """
    with registry.locked(caller, pool_id, exclusive=True) as entry:
        still_wanted(wanted, "AllocateSlots")
        owner = entry.owner_of(caller)
        t = entry.alloc(num_tokens, owner)
        try:
            still_wanted(wanted, "AllocateSlots")
        except Cancelled:
            entry.free(t, owner)
            raise
        return t, entry.page_size


def free_slots(registry: PoolRegistry, caller: Caller, pool_id: str, slots: Any,
               wanted: Callable[[], bool] = always) -> int:
    """Free every page ``slots`` touch; returns the pages freed.

    Raises:
        InvalidArgument: bad or unallocated slots. FailedPrecondition: a page of the prefix cache or
            of another attach session.
    """
    with registry.locked(caller, pool_id, exclusive=True) as entry:
        still_wanted(wanted, "FreeSlots")
        return entry.free(entry.slots(slots), entry.owner_of(caller))


def read_kv(registry: PoolRegistry, caller: Caller, sel: KVSelection) -> list[tuple[Segment, np.ndarray]]:
    """Gather the selected KV under the pool's shared lock (a consistent snapshot).

    Returns:
        ``[(segment, bytes (nbytes,) uint8 host array)]`` in stream order.

    Raises:
        NotFound, InvalidArgument, FailedPrecondition: see :func:`plan_segments`, :meth:`PoolEntry.slots`.
    """
    with registry.locked(caller, sel.pool_id, exclusive=False) as entry:
        slots, segs = _plan_read(entry, sel)
        return list(_gather(entry, sel, slots, segs))


def _plan_read(entry: PoolEntry, sel: KVSelection) -> tuple[torch.Tensor, list[Segment]]:
    slots = entry.slots(sel.slots)
    if slots.numel() == 0:
        raise InvalidArgument("a KV read needs at least one slot")
    return slots, plan_segments(entry, sel, slots.numel())


def _gather(entry: PoolEntry, sel: KVSelection, slots: torch.Tensor, segs: list[Segment]) -> Iterator[tuple[Segment, np.ndarray]]:
    """Each segment's bytes, gathered in stream order (the pool's lock is held by the caller)."""
    pool = entry.pool
    index_data: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    lat_bytes = slots.numel() * pool.row_bytes
    lat_flat = pool.host_block(lat_bytes * len(sel.latent_layers))  # one block, faulted in already
    done = 0
    for seg in segs:
        if seg.component == LATENT:
            start = done * lat_bytes  # latent segments come first, in order
            done += 1
            t = pool.get_kv_buffer_rows(seg.layer_id, slots, out=lat_flat[start:start + lat_bytes])
        else:
            if seg.layer_id not in index_data:
                index_data[seg.layer_id] = pool.get_index_k_scale(seg.layer_id, slots)
            keys, scales = index_data[seg.layer_id]
            t = keys if seg.component == INDEX_K else scales
        yield seg, t.cpu().contiguous().view(torch.uint8).reshape(-1).numpy()


def move_kv(registry: PoolRegistry, caller: Caller, pool_id: str, tgt: Any, src: Any,
            wanted: Callable[[], bool] = always) -> int:
    """Copy the KV of ``src`` slots onto ``tgt`` slots (every layer, latent and indexer); returns the count.

    Raises:
        InvalidArgument: bad, unallocated or duplicate target slots, or unequal lengths.
    """
    with registry.locked(caller, pool_id, exclusive=True) as entry:
        still_wanted(wanted, "MoveKV")
        t = entry.slots(tgt, "tgt_slots", unique=True)
        s = entry.slots(src, "src_slots")
        if t.numel() != s.numel():
            raise InvalidArgument(f"tgt_slots has {t.numel()} slots but src_slots has {s.numel()}")
        entry.check_writable(t // entry.page_size, entry.owner_of(caller), "tgt_slots")
        entry.changed(torch.unique(t // entry.page_size))
        entry.pool.move_kv_cache(t, s)
        return t.numel()


@dataclass(frozen=True)
class OffloadResult:
    """What :func:`offload` did: bytes stored, tokens copied, pages freed, and whether the copy is
    durable (committed to the disk tier's LMDB before the call returned)."""

    nbytes: int
    num_tokens: int
    freed_pages: int
    durable: bool = False


def offload(registry: PoolRegistry, store: OffloadStore, caller: Caller, pool_id: str, key: str, slots: Any, *,
            free_slots: bool, wanted: Callable[[], bool] = always) -> OffloadResult:
    """Copy ``slots`` (latent + live-layer indexer) into ``store`` under ``caller``'s ``key``; optionally free them.

    Raises:
        InvalidArgument: bad, unallocated, duplicate or no slots; empty key.
        AlreadyExists: the tenant's ``key`` is taken. ResourceExhausted: no tier (within the tenant's
            quotas) can take the copy. FailedPrecondition: ``free_slots`` with slots on pages the prefix cache holds.
    """
    store.check_key(key)
    with registry.locked(caller, pool_id, exclusive=free_slots) as entry:
        still_wanted(wanted, "Offload")
        t = entry.slots(slots, unique=True)
        if t.numel() == 0:
            raise InvalidArgument("offload needs at least one slot")
        owner = entry.owner_of(caller)
        if free_slots:  # checked before anything is stored, so a refusal leaves no copy behind
            entry.check_client_owned(torch.unique(t // entry.page_size), "offload slots")
            entry.check_owner(torch.unique(t // entry.page_size), owner, "offload slots")
        nbytes = entry.pool.cpu_copy_nbytes(t)
        store.check_room(caller, key, nbytes)
        copy = entry.pool.get_cpu_copy(t)
        durable = bool(store.put(caller, key, HostCopy(copy, nbytes, t.numel(), entry.model.fingerprint(),
                                                       entry.model.fingerprint_digest(), entry.pool_id), wanted=wanted))
        freed = entry.free(t, owner) if free_slots else 0
        return OffloadResult(nbytes, t.numel(), freed, durable)


def _layout_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return ", ".join(f"{k}: copy {a.get(k)!r} vs pool {b.get(k)!r}" for k in keys)


def restore(registry: PoolRegistry, store: OffloadStore, caller: Caller, pool_id: str, key: str,
            slots: Sequence[int] | None, *, drop: bool, wanted: Callable[[], bool] = always) -> tuple[torch.Tensor, int]:
    """Load ``caller``'s copy under ``key`` into ``slots`` (or newly allocated slots when None/empty;
    unpinned prefix-cache pages are evicted to make room, as LoadPrefix does). With ``drop`` the
    copy is taken (:meth:`OffloadStore.taking`): of two concurrent Restores with drop one gets it,
    the other is NOT_FOUND.

    Returns:
        ``(slots (n,) int64, nbytes)``.

    Raises:
        NotFound: no copy under ``key`` (or another tenant's). FailedPrecondition: the copy's layout differs from the pool's.
        InvalidArgument: bad slots or a count other than the copy's. ResourceExhausted: no free pages.
        Cancelled: the caller gave up while the call waited for the pool, while the copy was
            loaded, or (with ``drop``) while the drop waited for the tiers' locks: fresh pages are
            freed again (attack pass 7, A7-3), named slots get their old rows back (attack pass 8,
            A8-3), the copy is kept. The same for any other failure after the load.

    With ``drop`` nothing is written into the slots until every wait is over and the caller was
    checked: the long waits (records in flight, the disk's write-behind: :meth:`OffloadStore.quiesce_key`)
    come first, holding nothing; then, holding the pool's lock, the key's lock and every tier's index
    lock (the daemon's order), the caller is checked, the copy loaded and dropped, with no wait
    between. So a caller told its deadline passed never finds its slots changed, and there is no
    undo to run later: an undo after the pool's lock was let go (A8-3's first fix) wrote old rows
    over what an attached worker, told the call failed, had written since, and over pages it had
    stored in the prefix cache (attack pass 9, A9-2). Named slots keep undo rows (for a load that
    fails part way, or a caller gone while a Restore without drop loads) only when written since
    their allocation (:meth:`PoolEntry.unwritten`): fresh slots hold nothing to put back.
    """
    registry.get(caller, pool_id)  # an unknown pool is NOT_FOUND before the copy is decoded
    with store.taking(caller, key) if drop else nullcontext(store.get(caller, key)) as hc:
        if drop:
            store.quiesce_key(caller, key)  # the long waits, holding nothing (A7-3)
        with registry.locked(caller, pool_id, exclusive=True) as entry:
            still_wanted(wanted, "Restore")
            if hc.layout_digest != entry.model.fingerprint_digest():
                raise FailedPrecondition(
                    f"copy {key!r} has another layout than pool {pool_id!r}: "
                    f"{_layout_difference(dict(hc.layout), entry.model.fingerprint())}")
            owner = entry.owner_of(caller)
            fresh = slots is None or len(slots) == 0
            old = None
            if fresh:
                t = entry.alloc(hc.num_tokens, owner)
            else:
                t = entry.slots(slots, unique=True)
                if t.numel() != hc.num_tokens:
                    raise InvalidArgument(f"copy {key!r} holds {hc.num_tokens} tokens but {t.numel()} slots were given")
                entry.check_writable(t // entry.page_size, owner)
                # the rows the load replaces, written back if the Restore fails or its caller leaves (A8-3)
                old = None if entry.unwritten(t // entry.page_size) else entry.pool.get_cpu_copy(t)
            pages = torch.unique(t // entry.page_size)

            written: list[bool] = []

            def load() -> None:
                written.append(True)
                entry.changed(pages)
                entry.pool.load_cpu_copy(hc.copy, t)

            try:
                if drop:  # load, then drop the copy it took (never a newer one), all after the last check
                    def ready() -> None:  # under every tier's index lock, the waits done
                        still_wanted(wanted, "Restore")
                        load()
                    if not store.drop_taken(caller, key, hc.nbytes, ready=ready, quiesced=True):
                        still_wanted(wanted, "Restore")  # a newer copy was put under the key meanwhile: it is
                        load()                           # kept, and the one taken is restored
                else:
                    load()
                    still_wanted(wanted, "Restore")  # gone while loading: fresh pages go back, named ones get their rows
            except BaseException:
                if fresh:
                    entry.free(t, owner)
                elif old is not None and written:
                    entry.pool.load_cpu_copy(old, t)
                    entry.changed(pages)
                raise
        if drop:
            store.settle_drop(wanted)  # its delete committed (or queued, its deadline near) before the answer
    return t, hc.nbytes


def buffer_infos(registry: PoolRegistry, caller: Caller, pool_id: str) -> tuple[PoolEntry, BufInfos, BufInfos]:
    """``(entry, state buffer infos (indexer), contiguous buffer infos (latent))``, one entry a layer.
    Raw addresses: only the pool's own tenant gets them (another tenant's pool is NOT_FOUND)."""
    with registry.locked(caller, pool_id, exclusive=False) as entry:
        return entry, entry.pool.get_state_buf_infos(), entry.pool.get_contiguous_buf_infos()
