"""DSA model geometry and the layer-skip rules that decide which layers own an indexer buffer.

A DeepSeek-sparse-attention layer either runs the top-k indexer (it reads and writes the indexer
key cache) or *skips* it and reuses the previous layer's top-k ("skip-topk", "shared" or
"indexShare" layers). Skip layers need no indexer key cache; kvtier allocates none for them.

The rules (DESIGN.md, "Layer-skip rules"), first that applies, from the model's HF ``config.json``:

1. ``indexer_types`` list: a layer skips iff its entry is ``"shared"`` (layer ids past the end of
   the list, e.g. next-n/MTP layers, do not skip).
2. ``cli_factor > 1``: a layer skips iff ``layer_id % cli_factor != 0``.
3. ``index_topk_pattern`` string: a layer skips iff ``pattern[layer_id] == "S"`` (``"F"`` = full;
   any other character is an error; ids past the end do not skip).
4. ``index_topk_freq`` (default 1) with ``index_skip_topk_offset`` (must be > 0 if given): skips iff
   ``max(layer_id - offset + 1, 0) % freq != 0``; without an offset ``max(layer_id - 1, 0) % freq != 0``.

Layer 0 can never skip (there is no earlier top-k to reuse): a config that makes it skip is invalid.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvtier.server.presets import get_preset

KVCacheDType = Literal["bf16", "fp8"]
KV_CACHE_DTYPES: tuple[str, ...] = ("bf16", "fp8")
INDEX_QUANT_BLOCK = 128  # FP8 indexer keys carry one FP32 scale per 128 values
DEFAULT_PAGE_SIZE = 64
MAX_LAYERS = 4096  # far above any DSA model (DeepSeek-V3.2: 61, GLM-5.2: 78); checked before any per-layer loop
MAX_DIM = 1 << 16  # kv_lora_rank, qk_rope_head_dim, index_head_dim and page_size stay below this

_INDEXER_TYPES = ("full", "shared")
_PATTERN_CHARS = ("S", "F")


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number an HF config may hold")


def load_hf_config_text(text: str | bytes, where: str = "HF config") -> dict[str, Any]:
    """Parse the text of an HF ``config.json`` into a dict. ``NaN``, ``Infinity`` and ``-Infinity``
    (which ``json`` takes by default) are refused, as is a number of more than 4300 digits.

    Raises:
        ValueError: one line naming ``where``: not JSON, nested too deeply, not an object.
    """
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError(f"{where} nests too deeply to be an HF config") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, the int digit limit, _no_constant
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{where} is not JSON: {first}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object")
    return data


def _hf_int(data: Mapping[str, Any], key: str, default: int | None = None, *, lo: int = 1, hi: int = 0) -> int:
    """Field ``key`` of an HF config, an integer in ``lo..hi`` (``hi`` 0: :data:`MAX_DIM`). A float
    (``1e400`` is infinity, ``512.5``), a bool, a string or null is refused naming the field: ``int()``
    of an infinite float raised OverflowError (INTERNAL over gRPC; attack pass 7, A7-8)."""
    v = data.get(key, default)
    hi = hi or MAX_DIM
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"HF config field {key} must be an integer in {lo}..{hi}, got {v!r}")
    return v


def validate_skip_config(config: Any) -> None:
    """Check the skip-related fields of an HF config (a mapping or an object with attributes).

    Raises:
        ValueError: naming the field: ``indexer_types`` with an entry other than "full"/"shared" or a
            length other than ``num_hidden_layers``; ``cli_factor`` < 1; ``index_topk_pattern`` with a
            character other than "S"/"F" or a length other than ``num_hidden_layers``;
            ``index_topk_freq`` <= 0; ``index_skip_topk_offset`` <= 0; any rule making layer 0 skip.
    """
    num_layers = _get(config, "num_hidden_layers")
    indexer_types = _get(config, "indexer_types")
    if indexer_types is not None:
        if isinstance(indexer_types, (str, bytes)) or not hasattr(indexer_types, "__len__"):
            raise ValueError("indexer_types must be a list of 'full'/'shared' strings")
        bad = [t for t in indexer_types if t not in _INDEXER_TYPES]
        if bad:
            raise ValueError(f"indexer_types has entries {sorted(set(map(str, bad)))!r}; allowed: 'full', 'shared'")
        if num_layers is not None and len(indexer_types) != num_layers:
            raise ValueError(
                f"indexer_types has {len(indexer_types)} entries but num_hidden_layers is {num_layers}"
            )
    for name in ("cli_factor", "index_topk_freq", "index_skip_topk_offset"):  # true and 10^20 were taken (A7-8)
        v = _get(config, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_LAYERS):
            raise ValueError(f"{name} must be an integer in 1..{MAX_LAYERS}, got {v!r}")
    pattern = _get(config, "index_topk_pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise ValueError(f"index_topk_pattern must be a string of 'S'/'F', got {type(pattern).__name__}")
        bad_chars = sorted(set(pattern) - set(_PATTERN_CHARS))
        if bad_chars:
            raise ValueError(f"index_topk_pattern has characters {bad_chars!r}; allowed: 'S' (skip), 'F' (full)")
        if num_layers is not None and len(pattern) != num_layers:
            raise ValueError(f"index_topk_pattern has {len(pattern)} characters but num_hidden_layers is {num_layers}")
    if _skips_unchecked(config, 0):
        field_name = _deciding_field(config)
        raise ValueError(f"{field_name} makes layer 0 skip top-k, but layer 0 has no earlier top-k to reuse")


def _deciding_field(config: Any) -> str:
    if _get(config, "indexer_types") is not None:
        return "indexer_types"
    cli_factor = _get(config, "cli_factor")
    if cli_factor is not None and cli_factor > 1:
        return "cli_factor"
    if _get(config, "index_topk_pattern") is not None:
        return "index_topk_pattern"
    return "index_topk_freq"


def _skips_unchecked(config: Any, layer_id: int) -> bool:
    indexer_types = _get(config, "indexer_types")
    if indexer_types is not None:
        return layer_id < len(indexer_types) and indexer_types[layer_id] == "shared"
    cli_factor = _get(config, "cli_factor")
    if cli_factor is not None and cli_factor > 1:
        return layer_id % cli_factor != 0
    pattern = _get(config, "index_topk_pattern")
    if pattern is not None:
        return layer_id < len(pattern) and pattern[layer_id] == "S"
    freq = _get(config, "index_topk_freq") or 1
    offset = _get(config, "index_skip_topk_offset")
    if offset is not None:
        return max(layer_id - offset + 1, 0) % freq != 0
    return max(layer_id - 1, 0) % freq != 0


def dsa_layer_skips_topk(config: Any, layer_id: int) -> bool:
    """Whether layer ``layer_id`` skips the top-k indexer (and so owns no indexer key cache).

    Args:
        config: HF config fields, a mapping (parsed ``config.json``) or an object with attributes.
        layer_id: 0-based layer index; ids past ``num_hidden_layers`` (next-n layers) are allowed.

    Raises:
        ValueError: the config is invalid (see :func:`validate_skip_config`) or ``layer_id`` < 0.
    """
    if not isinstance(layer_id, int) or layer_id < 0:
        raise ValueError(f"layer_id must be a non-negative integer, got {layer_id!r}")
    validate_skip_config(config)
    return _skips_unchecked(config, layer_id)


def skip_topk_mask(config: Any, num_layers: int | None = None) -> tuple[bool, ...]:
    """``(num_layers,)`` tuple: True where the layer skips top-k. Validates the config once."""
    validate_skip_config(config)
    n = num_layers if num_layers is not None else _get(config, "num_hidden_layers")
    if n is None:
        raise ValueError("num_hidden_layers is missing")
    return tuple(_skips_unchecked(config, i) for i in range(n))


def latent_row_bytes(kv_lora_rank: int, qk_rope_head_dim: int, kv_cache_dtype: str) -> int:
    """Bytes of one MLA latent row (one token, one layer).

    bf16: ``(kv_lora_rank + qk_rope_head_dim) * 2`` (1152 for DeepSeek).
    fp8 DSA: ``kv_lora_rank`` fp8 bytes + ``kv_lora_rank // 128`` fp32 scales + ``qk_rope_head_dim``
    bf16 values (512 + 16 + 128 = 656 for DeepSeek).
    """
    if kv_cache_dtype == "bf16":
        return (kv_lora_rank + qk_rope_head_dim) * 2
    if kv_cache_dtype == "fp8":
        return kv_lora_rank + kv_lora_rank // INDEX_QUANT_BLOCK * 4 + qk_rope_head_dim * 2
    raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def index_token_bytes(index_head_dim: int) -> int:
    """Indexer bytes per token per live layer: FP8 keys plus one FP32 scale per 128 (132 for 128)."""
    return index_head_dim + index_head_dim // INDEX_QUANT_BLOCK * 4


def layer_range(model_layers: int, *, start_layer: int = 0, end_layer: int | None = None,
                num_layers: int | None = None) -> tuple[int, int]:
    """The layer range ``[start, end)`` a pool covers, checked against the model's ``model_layers``.

    Args:
        model_layers: the model's ``num_hidden_layers``.
        start_layer: first model layer (0: the model's first).
        end_layer: one past the last (None: the model's last, or ``start_layer + num_layers``).
        num_layers: keep this many layers from ``start_layer`` (exclusive with ``end_layer``).

    Raises:
        ValueError: non-integers, an empty range, or one that runs past the model's layers.
    """
    for what, v in (("num_hidden_layers", model_layers), ("start_layer", start_layer)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if what == "num_hidden_layers" else 0):
            raise ValueError(f"{what} must be a {'positive' if what == 'num_hidden_layers' else 'non-negative'} integer, got {v!r}")
    if num_layers is not None and end_layer is not None:
        raise ValueError("give num_layers or end_layer, not both")
    if num_layers is not None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
        end = start_layer + num_layers
    else:
        end = model_layers if end_layer is None else end_layer
        if isinstance(end, bool) or not isinstance(end, int):
            raise ValueError(f"end_layer must be an integer, got {end_layer!r}")
    if not start_layer < end:
        raise ValueError(f"layer range [{start_layer}, {end}) is empty")
    if num_layers is not None and end > model_layers:
        raise ValueError(f"num_layers {num_layers} exceeds the model's {model_layers} layers"
                         + (f" from layer {start_layer}" if start_layer else ""))
    if end > model_layers:
        raise ValueError(f"layer range [{start_layer}, {end}) runs past the model's {model_layers} layers")
    return start_layer, end


def pp_layer_range(num_hidden_layers: int, pp_rank: int, pp_size: int,
                   partition: tuple[int, ...] | None = None) -> tuple[int, int]:
    """Layers ``[start, end)`` of pipeline stage ``pp_rank`` of ``pp_size``, split as SGLang splits them
    (``get_pp_indices``): evenly, the last ``num_hidden_layers % pp_size`` stages one layer more; or by an
    explicit ``partition`` (layers per stage, SGLang's ``SGLANG_PP_LAYER_PARTITION``).

    Raises:
        ValueError: a bad rank or size, more stages than layers, or a partition that does not add up.
    """
    if isinstance(pp_size, bool) or not isinstance(pp_size, int) or pp_size < 1:
        raise ValueError(f"pp_size must be a positive integer, got {pp_size!r}")
    if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must lie in [0, {pp_size}), got {pp_rank!r}")
    if partition is not None and pp_size > 1:
        parts = tuple(int(p) for p in partition)
        if len(parts) != pp_size or sum(parts) != num_hidden_layers or min(parts) < 1:
            raise ValueError(f"partition {list(parts)} must give {pp_size} positive layer counts adding up to "
                             f"{num_hidden_layers}")
        start = sum(parts[:pp_rank])
        return start, start + parts[pp_rank]
    if pp_size > num_hidden_layers:
        raise ValueError(f"{pp_size} pipeline stages for {num_hidden_layers} layers leave a stage without a layer")
    base, extra = divmod(num_hidden_layers, pp_size)
    if pp_rank >= pp_size - extra:
        start = pp_rank * (base + 1) - (pp_size - extra)
        return start, start + base + 1
    return pp_rank * base, (pp_rank + 1) * base


@dataclass(frozen=True)
class DSAModelConfig:
    """Geometry of a DSA model's KV cache, as kvtier needs it.

    Attributes:
        name: model name (preset name or the HF ``model_type``).
        num_layers: attention layers with a KV cache (``num_hidden_layers``).
        kv_lora_rank: latent width (512 for DeepSeek/GLM).
        qk_rope_head_dim: rope width (64).
        index_head_dim: indexer key width in FP8 values (128).
        kv_cache_dtype: ``"bf16"`` or ``"fp8"`` (the 656-byte DSA row).
        page_size: tokens per page (DSA uses 64).
        skip_topk_layers: ``(num_layers,)`` True where the layer skips top-k (position ``i`` is
            model layer ``start_layer + i``).
        start_layer: model layer id of the first layer this geometry covers: 0 for a whole model (or
            its first N layers), ``s`` for a pipeline-parallel stage of layers ``[s, s + num_layers)``.
            A stage's first layer may skip top-k (its top-k comes from the previous stage); only the
            model's own layer 0 never can.
    """

    name: str
    num_layers: int
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    index_head_dim: int = 128
    kv_cache_dtype: str = "fp8"
    page_size: int = DEFAULT_PAGE_SIZE
    skip_topk_layers: tuple[bool, ...] = field(default=())
    start_layer: int = 0

    def __post_init__(self) -> None:
        for attr in ("num_layers", "kv_lora_rank", "qk_rope_head_dim", "index_head_dim", "page_size"):
            value = getattr(self, attr)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{attr} must be a positive integer, got {value!r}")
            limit = MAX_LAYERS if attr == "num_layers" else MAX_DIM
            if value > limit:
                raise ValueError(f"{attr} must be at most {limit}, got {value}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.index_head_dim % INDEX_QUANT_BLOCK:
            raise ValueError(f"index_head_dim must be a multiple of {INDEX_QUANT_BLOCK}, got {self.index_head_dim}")
        if self.kv_cache_dtype == "fp8" and self.kv_lora_rank % INDEX_QUANT_BLOCK:
            raise ValueError(f"fp8 kv cache needs kv_lora_rank divisible by 128, got {self.kv_lora_rank}")
        if not isinstance(self.start_layer, int) or isinstance(self.start_layer, bool) or self.start_layer < 0:
            raise ValueError(f"start_layer must be a non-negative integer, got {self.start_layer!r}")
        mask = tuple(bool(x) for x in self.skip_topk_layers) if self.skip_topk_layers else (False,) * self.num_layers
        if len(mask) != self.num_layers:
            raise ValueError(f"skip_topk_layers has {len(mask)} entries but num_layers is {self.num_layers}")
        if mask[0] and self.start_layer == 0:
            raise ValueError("skip_topk_layers marks layer 0 as skip, but layer 0 has no earlier top-k to reuse")
        object.__setattr__(self, "skip_topk_layers", mask)

    # ----- construction -------------------------------------------------------------------------
    @classmethod
    def from_hf_config(
        cls,
        config: str | Path | Mapping[str, Any],
        *,
        name: str | None = None,
        kv_cache_dtype: str = "fp8",
        page_size: int = DEFAULT_PAGE_SIZE,
        num_layers: int | None = None,
        start_layer: int = 0,
        end_layer: int | None = None,
    ) -> DSAModelConfig:
        """Build from an HF ``config.json`` (path or parsed mapping), for model layers
        ``[start_layer, end_layer)``.

        Args:
            num_layers: keep ``num_layers`` layers from ``start_layer`` (scaled-down replays: the
                model's first N layers); exclusive with ``end_layer``.
            start_layer, end_layer: a pipeline-parallel stage's layer range (SGLang's
                ``start_layer``/``end_layer``, end exclusive; default: to the model's last layer).
                The skip mask is the model's own for those layers, with the same rules.

        Raises:
            ValueError: a required field is missing or invalid, ``num_hidden_layers`` above
                :data:`MAX_LAYERS`, or a layer range that is empty or runs past the model's layers
                (the message names it). Every size is checked before any per-layer loop.
            FileNotFoundError: the path does not exist.
        """
        if isinstance(config, (str, Path)):
            path = Path(config)
            data: Mapping[str, Any] = load_hf_config_text(path.read_bytes(), str(path))
            name = name or path.stem
        else:
            data = config
        if not isinstance(data, Mapping):
            raise ValueError(f"HF config must be a JSON object (a mapping), got {type(data).__name__}")
        for key in ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim"):
            if data.get(key) is None:
                raise ValueError(f"HF config lacks required field {key!r}")
        total = data["num_hidden_layers"]
        if isinstance(total, bool) or not isinstance(total, int) or not 0 < total <= MAX_LAYERS:
            raise ValueError(f"num_hidden_layers must be an integer in 1..{MAX_LAYERS}, got {total!r}")
        start, end = layer_range(total, start_layer=start_layer, end_layer=end_layer, num_layers=num_layers)
        validate_skip_config(data)
        mask = tuple(_skips_unchecked(data, i) for i in range(start, end))
        kv_lora_rank = _hf_int(data, "kv_lora_rank")
        qk_rope_head_dim = _hf_int(data, "qk_rope_head_dim")
        index_head_dim = _hf_int(data, "index_head_dim", 128)
        if name is None:
            name = data.get("model_type", "dsa-model")
            if not isinstance(name, str):  # any JSON value became the name (A7-8)
                raise ValueError(f"HF config field model_type must be a string, got {name!r}")
        return cls(
            name=name or "dsa-model",
            num_layers=end - start,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            index_head_dim=index_head_dim,
            kv_cache_dtype=kv_cache_dtype,
            page_size=page_size,
            skip_topk_layers=mask,
            start_layer=start,
        )

    @classmethod
    def from_preset(
        cls, name: str, *, kv_cache_dtype: str = "fp8", page_size: int = DEFAULT_PAGE_SIZE, num_layers: int | None = None,
        start_layer: int = 0, end_layer: int | None = None,
    ) -> DSAModelConfig:
        """Build from a shipped preset (``deepseek-v3.2``, ``glm-5.2``), for layers ``[start_layer,
        end_layer)`` as :meth:`from_hf_config`. Raises ValueError if unknown."""
        return cls.from_hf_config(
            get_preset(name), name=name.strip().lower(), kv_cache_dtype=kv_cache_dtype,
            page_size=page_size, num_layers=num_layers, start_layer=start_layer, end_layer=end_layer,
        )

    # ----- derived geometry ---------------------------------------------------------------------
    @property
    def end_layer(self) -> int:
        """Model layer id one past the last layer covered (``start_layer + num_layers``)."""
        return self.start_layer + self.num_layers

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Model layer ids covered, in buffer order (``start_layer .. end_layer - 1``)."""
        return tuple(range(self.start_layer, self.end_layer))

    @property
    def kv_cache_dim(self) -> int:
        """Elements of a latent row: 576 (bf16 values) or 656 (uint8 bytes, fp8 DSA layout)."""
        if self.kv_cache_dtype == "bf16":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return self.latent_row_bytes

    @property
    def latent_row_bytes(self) -> int:
        """Bytes of one latent row (one token, one layer): 1152 (bf16) or 656 (fp8)."""
        return latent_row_bytes(self.kv_lora_rank, self.qk_rope_head_dim, self.kv_cache_dtype)

    @property
    def index_token_bytes(self) -> int:
        """Indexer bytes per token per live layer (132)."""
        return index_token_bytes(self.index_head_dim)

    @property
    def index_page_bytes(self) -> int:
        """Bytes of one indexer page row: ``page_size * index_token_bytes`` (8448)."""
        return self.page_size * self.index_token_bytes

    @property
    def live_indexer_layers(self) -> tuple[int, ...]:
        """Positions (0-based within :attr:`layer_ids`) of the layers that run the indexer and own an
        indexer buffer; model layer ids are ``start_layer +`` these."""
        return tuple(i for i, s in enumerate(self.skip_topk_layers) if not s)

    @property
    def skipped_layers(self) -> tuple[int, ...]:
        """Positions of the skip-topk layers (no indexer buffer)."""
        return tuple(i for i, s in enumerate(self.skip_topk_layers) if s)

    def fingerprint(self) -> dict[str, Any]:
        """What two peers (or a record and a pool) must agree on for their bytes to be interchangeable
        (geometry, skip mask and layer range: records of two pipeline stages never mix)."""
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "index_head_dim": self.index_head_dim,
            "kv_cache_dtype": self.kv_cache_dtype,
            "page_size": self.page_size,
            "latent_row_bytes": self.latent_row_bytes,
            "skip_mask": "".join("S" if s else "F" for s in self.skip_topk_layers),
            "start_layer": self.start_layer,
        }

    def fingerprint_digest(self) -> str:
        """Short stable hex digest of :meth:`fingerprint` (16 hex chars)."""
        blob = json.dumps(self.fingerprint(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
