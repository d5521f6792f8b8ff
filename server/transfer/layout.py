"""Pool layout descriptors and the compatibility check PD peers run before moving a byte.

A :class:`PoolLayout` is everything a peer needs to address another pool's pages: the model
fingerprint, page size, row bytes, the pool's skip mask, and its buffer infos (latent = contiguous
infos, indexer = state infos, one entry per layer, ``(0, 0, 0)`` on skip layers), plus the transfer
engine endpoint and the ranges it registered. It is plain data: the transfer plan is derived from
it alone, so a peer whose buffers have SGLang's shapes interoperates by page ids.

:func:`layout_mismatch` returns a precise reason when two layouts cannot exchange bytes;
:func:`check_compatible` raises :class:`LayoutMismatchError` with it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.server.pool.buffer_info import BufInfos
from kvtier.server.transfer.errors import LayoutMismatchError

COMPONENTS: tuple[str, ...] = ("latent", "index_k")


def mask_string(mask: Sequence[bool]) -> str:
    """``"S"`` for a skip-topk layer, ``"F"`` for a full one, one character a layer."""
    return "".join("S" if s else "F" for s in mask)


def _as_infos(infos: Any, what: str) -> BufInfos:
    if not isinstance(infos, Sequence) or len(infos) != 3:
        raise ValueError(f"{what} must be a (data_ptrs, data_lens, item_lens) triple")
    ptrs, lens, items = (tuple(int(x) for x in part) for part in infos)
    if not len(ptrs) == len(lens) == len(items):
        raise ValueError(f"{what}: data_ptrs, data_lens and item_lens differ in length")
    if any(x < 0 for x in (*ptrs, *lens, *items)):
        raise ValueError(f"{what}: negative pointer or length")
    return ptrs, lens, items  # type: ignore[return-value]


@dataclass(frozen=True)
class PoolLayout:
    """What a peer publishes about one pool for PD transfer.

    Attributes:
        page_size: tokens per page.
        latent_row_bytes: bytes of one latent row (one token, one layer): 656 fp8, 1152 bf16.
        index_page_bytes: bytes of one indexer page row on a live layer (8448 for DSA).
        skip_mask: ``(num_layers,)`` True where the pool has no indexer buffer on that layer.
        latent: contiguous buffer infos ``(data_ptrs, data_lens, item_lens)``, one entry a layer,
            ``item_len = latent_row_bytes * page_size``.
        index: state buffer infos, one entry a layer, ``(0, 0, 0)`` on skip layers.
        fingerprint: the model fingerprint (:meth:`DSAModelConfig.fingerprint`); empty when the peer
            has none (e.g. SGLang), then only the geometry is compared.
        endpoint: the transfer engine's ``"host:port"``; ``""`` without an engine.
        registered: ``((ptr, nbytes), ...)`` ranges the peer's engine registered (disjoint, non-empty).

    Raises:
        ValueError: infos of the wrong shape, or a mask whose length differs from the infos.
    """

    page_size: int
    latent_row_bytes: int
    index_page_bytes: int
    skip_mask: tuple[bool, ...]
    latent: BufInfos
    index: BufInfos
    fingerprint: Mapping[str, Any] = field(default_factory=dict)
    endpoint: str = ""
    registered: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "skip_mask", tuple(bool(s) for s in self.skip_mask))
        object.__setattr__(self, "latent", _as_infos(self.latent, "latent buffer infos"))
        object.__setattr__(self, "index", _as_infos(self.index, "indexer buffer infos"))
        object.__setattr__(self, "registered", tuple((int(p), int(n)) for p, n in self.registered))
        object.__setattr__(self, "fingerprint", dict(self.fingerprint))
        n = len(self.skip_mask)
        if len(self.latent[0]) != n or len(self.index[0]) != n:
            raise ValueError(
                f"skip mask has {n} layers but the buffer infos have {len(self.latent[0])} (latent) "
                f"and {len(self.index[0])} (indexer)"
            )

    @property
    def num_layers(self) -> int:
        """Layers (entries of each buffer info list)."""
        return len(self.skip_mask)

    @property
    def live_layers(self) -> tuple[int, ...]:
        """Positions (in buffer-info order) of the layers that own an indexer buffer."""
        return tuple(i for i, s in enumerate(self.skip_mask) if not s)

    @property
    def start_layer(self) -> int:
        """Model layer id of entry 0 (a pipeline stage's first layer; 0 when the fingerprint says none)."""
        return int(self.fingerprint.get("start_layer", 0))

    def infos(self, component: str) -> BufInfos:
        """Buffer infos of ``"latent"`` or ``"index_k"``."""
        if component == "latent":
            return self.latent
        if component == "index_k":
            return self.index
        raise ValueError(f"component must be one of {COMPONENTS}, got {component!r}")

    def digest(self) -> str:
        """A digest of every field (32 hex characters): two layouts with equal digests are equal, so a
        peer that still publishes the digest a caller holds need not send the layout again."""
        canon = json.dumps([self.page_size, self.latent_row_bytes, self.index_page_bytes, self.skip_mask,
                            self.latent, self.index, sorted(self.fingerprint.items()), self.endpoint,
                            self.registered], separators=(",", ":"), default=str)
        return hashlib.sha256(canon.encode()).hexdigest()[:32]

    def with_engine(self, endpoint: str, registered: Sequence[tuple[int, int]]) -> PoolLayout:
        """A copy naming the engine endpoint and the ranges it registered."""
        return PoolLayout(
            self.page_size, self.latent_row_bytes, self.index_page_bytes, self.skip_mask, self.latent,
            self.index, self.fingerprint, endpoint, tuple(registered),
        )


def pool_layout(pool: Any, fingerprint: Mapping[str, Any] | None = None) -> PoolLayout:
    """The layout of a :class:`DSATokenToKVPool` (or any pool with the same buffer-info API).

    Args:
        pool: has ``page_size``, ``row_bytes``, ``index_page_bytes``, ``skip_topk_layers``,
            ``get_contiguous_buf_infos()`` and ``get_state_buf_infos()``.
        fingerprint: the model's :meth:`DSAModelConfig.fingerprint` (the pool's own skip mask is
            carried separately, so a draft pool of a model differs from its target pool).
    """
    return PoolLayout(
        page_size=pool.page_size,
        latent_row_bytes=pool.row_bytes,
        index_page_bytes=pool.index_page_bytes,
        skip_mask=tuple(pool.skip_topk_layers),
        latent=pool.get_contiguous_buf_infos(),
        index=pool.get_state_buf_infos(),
        fingerprint=fingerprint or {},
    )


def _layers(ids: Sequence[int]) -> str:
    shown = ", ".join(map(str, ids[:12]))
    return f"[{shown}{', ...' if len(ids) > 12 else ''}] ({len(ids)})"


def _self_check(layout: PoolLayout, side: str) -> str | None:
    """Reason why one layout is inconsistent in itself (item lengths vs mask and row bytes)."""
    lat_item = layout.latent_row_bytes * layout.page_size
    for layer, (n, item) in enumerate(zip(layout.latent[1], layout.latent[2])):
        if item != lat_item or n <= 0 or n % item:
            return (f"{side} latent buffer of layer {layer} has item_len {item} and {n} bytes; expected "
                    f"item_len {lat_item} (latent_row_bytes {layout.latent_row_bytes} x page_size "
                    f"{layout.page_size}) and a whole number of pages")
    for layer, (skip, n, item) in enumerate(zip(layout.skip_mask, layout.index[1], layout.index[2])):
        if skip and (n or item):
            return f"{side} layer {layer} skips top-k but reports an indexer buffer of {n} bytes (item_len {item})"
        if not skip and (item != layout.index_page_bytes or n <= 0 or n % item):
            return (f"{side} layer {layer} owns an indexer buffer but reports item_len {item} and {n} bytes; "
                    f"expected item_len {layout.index_page_bytes} and a whole number of pages")
    return None


def layout_mismatch(local: PoolLayout, remote: PoolLayout) -> str | None:
    """Why ``remote``'s pages cannot be copied onto ``local``'s by page id; None when they can.

    Compared in this order (the first difference is reported): layer range (count and first model
    layer), page size, latent row bytes, indexer page bytes, skip mask, model fingerprint (when both
    have one), then each side's item lengths against its own geometry (zero exactly on skip layers).
    """
    if local.num_layers != remote.num_layers or local.start_layer != remote.start_layer:
        return (f"layer ranges differ: model layers {local.start_layer}-{local.start_layer + local.num_layers - 1} here, "
                f"{remote.start_layer}-{remote.start_layer + remote.num_layers - 1} on the peer")
    if local.page_size != remote.page_size:
        return f"page sizes differ: {local.page_size} tokens here, {remote.page_size} on the peer"
    if local.latent_row_bytes != remote.latent_row_bytes:
        return f"latent row bytes differ: {local.latent_row_bytes} here, {remote.latent_row_bytes} on the peer"
    if local.index_page_bytes != remote.index_page_bytes:
        return f"indexer page bytes differ: {local.index_page_bytes} here, {remote.index_page_bytes} on the peer"
    if local.skip_mask != remote.skip_mask:
        first = local.start_layer
        only_remote = [first + i for i, (a, b) in enumerate(zip(local.skip_mask, remote.skip_mask)) if a and not b]
        only_local = [first + i for i, (a, b) in enumerate(zip(local.skip_mask, remote.skip_mask)) if b and not a]
        parts = []
        if only_remote:
            parts.append(f"layers {_layers(only_remote)} own an indexer buffer on the peer but skip top-k here")
        if only_local:
            parts.append(f"layers {_layers(only_local)} own an indexer buffer here but skip top-k on the peer")
        return "skip masks differ: " + "; ".join(parts)
    if local.fingerprint and remote.fingerprint and local.fingerprint != remote.fingerprint:
        keys = sorted(set(local.fingerprint) | set(remote.fingerprint))
        diffs = [
            f"{k} {local.fingerprint.get(k)!r} here vs {remote.fingerprint.get(k)!r} on the peer"
            for k in keys if local.fingerprint.get(k) != remote.fingerprint.get(k)
        ]
        return "model fingerprints differ: " + "; ".join(diffs)
    return _self_check(local, "local") or _self_check(remote, "peer")


def check_compatible(local: PoolLayout, remote: PoolLayout) -> None:
    """Raise :class:`LayoutMismatchError` with :func:`layout_mismatch`'s reason, if any."""
    reason = layout_mismatch(local, remote)
    if reason is not None:
        raise LayoutMismatchError(f"peer pool layout is incompatible: {reason}")
