"""Unit spaces: which model stage a unit belongs to, what its two parts hold and how big they are.

A *unit* is one page of one pipeline stage, stored as one tier record (:mod:`kvtier.server.tiers.record`,
a one-page record: ``n_tokens = page_size``, ``n_pages = 1``, source slots ``0 .. page_size - 1``):

* KV part: ``(num_layers, page_size, latent_row_bytes)`` uint8, layer-major -- the record's latent
  payload, byte for byte (SGLang's ``page_first_direct`` MLA host page; its ``page_first`` page holds
  the same rows token-major and the adapter transposes them).
* index part: ``(live layers, index_page_bytes)`` uint8 -- the record's indexer payload for one page,
  the live (non-skip) layers in layer order (SGLang's compact ``DSAIndexerPoolHost`` page, 8448 bytes
  a layer). Absent (0 bytes) when the space has ``with_index`` False.

In the record the index part follows the KV part directly, so "both parts" is one run of bytes.

The space's digest (sha256 of the model fingerprint -- name, geometry, skip mask, layer range --,
``with_index`` and ``scope``) namespaces the unit keys: two stages, two models or two tensor-parallel
shards never share or probe each other's units.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from kvtier.server.daemon.errors import InvalidArgument
from kvtier.server.model_config import MAX_LAYERS, DSAModelConfig
from kvtier.server.tiers import RecordCodec

KV, INDEX, BOTH = "kv", "index", "both"
PARTS = (KV, INDEX, BOTH)
MAX_NAME_CHARS = 256
MAX_SCOPE_CHARS = 64


@dataclass(frozen=True)
class SpaceRequest:
    """A unit space as a client describes it (the wire's ``UnitSpace``), not yet checked."""

    model_name: str
    num_layers: int
    start_layer: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    kv_cache_dtype: str
    page_size: int
    latent_row_bytes: int
    skip_mask: str
    with_index: bool
    scope: str = ""


@dataclass(frozen=True)
class UnitSpace:
    """A checked unit space.

    Attributes:
        model: the stage's geometry (its fingerprint goes into every record header).
        codec: the record codec (layer mask: the live layers with ``with_index``, none without).
        with_index: units carry the index part.
        scope: the shard name ("" for rank-replicated MLA KV).
        digest: 16 bytes naming the space in tier keys.
        kv_nbytes: bytes of a KV part; index_nbytes: bytes of an index part (0 without index).
    """

    model: DSAModelConfig
    codec: RecordCodec
    with_index: bool
    scope: str
    digest: bytes
    kv_nbytes: int
    index_nbytes: int

    def part_nbytes(self, part: str) -> int:
        """Bytes of ``part`` (``kv``, ``index``, ``both``) of one unit."""
        return {KV: self.kv_nbytes, INDEX: self.index_nbytes, BOTH: self.kv_nbytes + self.index_nbytes}[part]

    def check_part(self, part: str) -> str:
        """``part`` if this space has it. Raises InvalidArgument (unknown part, index part without index)."""
        if part not in PARTS:
            raise InvalidArgument(f"unit part must be one of {PARTS}, got {part!r}")
        if part == INDEX and not self.with_index:
            raise InvalidArgument("this unit space holds no indexer part (with_index is false)")
        return part


def resolve_space(req: SpaceRequest) -> UnitSpace:
    """Check ``req`` completely and build its :class:`UnitSpace`.

    Raises:
        InvalidArgument: an empty or long name or scope, a skip mask that is not one 'S'/'F' per layer,
            a geometry DSAModelConfig refuses, or a ``latent_row_bytes`` that differs from the one the
            geometry gives (the client's pages would not be this model's rows).
    """
    if not req.model_name or len(req.model_name) > MAX_NAME_CHARS:
        raise InvalidArgument(f"unit space model_name must be 1..{MAX_NAME_CHARS} characters")
    if len(req.scope) > MAX_SCOPE_CHARS:
        raise InvalidArgument(f"unit space scope must be at most {MAX_SCOPE_CHARS} characters")
    if not 1 <= req.num_layers <= MAX_LAYERS or len(req.skip_mask) != req.num_layers or set(req.skip_mask) - {"S", "F"}:
        raise InvalidArgument(f"unit space skip_mask must hold one 'S' or 'F' per layer ({req.num_layers} layers, "
                              f"at most {MAX_LAYERS}), got {len(req.skip_mask)} characters")
    try:
        model = DSAModelConfig(
            name=req.model_name, num_layers=req.num_layers, kv_lora_rank=req.kv_lora_rank,
            qk_rope_head_dim=req.qk_rope_head_dim, index_head_dim=req.index_head_dim,
            kv_cache_dtype=req.kv_cache_dtype, page_size=req.page_size,
            skip_topk_layers=tuple(c == "S" for c in req.skip_mask), start_layer=req.start_layer)
    except ValueError as e:
        raise InvalidArgument(f"unit space: {e}") from None
    if req.latent_row_bytes != model.latent_row_bytes:
        raise InvalidArgument(f"unit space latent_row_bytes {req.latent_row_bytes} differs from the "
                              f"{model.latent_row_bytes} bytes a {model.kv_cache_dtype} row of this geometry has")
    if req.with_index and not model.live_indexer_layers:
        raise InvalidArgument("unit space with_index is true but every layer of the stage skips top-k (no indexer "
                              "rows to store); use with_index false")
    mask = tuple(not s for s in model.skip_topk_layers) if req.with_index else (False,) * model.num_layers
    codec = RecordCodec(model, mask)
    blob = json.dumps({"fp": model.fingerprint(), "with_index": req.with_index, "scope": req.scope}, sort_keys=True)
    return UnitSpace(model, codec, req.with_index, req.scope, hashlib.sha256(blob.encode()).digest()[:16],
                     codec.latent_nbytes(model.page_size), codec.index_nbytes(1))
