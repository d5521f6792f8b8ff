"""Shipped model presets: the HF ``config.json`` fields kvtier reads, as the models publish them.

Numbers from the published configs (DeepSeek-V3.2, GLM-5.2); ``tests/server/test_model_config.py``
checks them against the copies in ``../shared/data/models/``. GLM-5.2 states its skip pattern twice
(``indexer_types`` and ``index_topk_freq``/``index_skip_topk_offset``); rule 1 wins and both agree.
"""

from __future__ import annotations

from typing import Any

_GLM52_INDEXER_TYPES = ["full", "full", "full"] + (["shared", "shared", "shared", "full"] * 19)[:75]

PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v3.2": {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "num_hidden_layers": 61,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "q_lora_rank": 1536,
        "index_head_dim": 128,
        "index_n_heads": 64,
        "index_topk": 2048,
        "first_k_dense_replace": 3,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 163840,
    },
    "glm-5.2": {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "num_hidden_layers": 78,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 192,
        "v_head_dim": 256,
        "q_lora_rank": 2048,
        "index_head_dim": 128,
        "index_n_heads": 32,
        "index_topk": 2048,
        "index_topk_freq": 4,
        "index_skip_topk_offset": 3,
        "index_topk_pattern": None,
        "indexer_types": _GLM52_INDEXER_TYPES,
        "num_nextn_predict_layers": 1,
    },
}


def preset_names() -> list[str]:
    """Names accepted by ``--model`` and ``DSAModelConfig.from_preset``."""
    return sorted(PRESETS)


def get_preset(name: str) -> dict[str, Any]:
    """Return a fresh copy of preset ``name``'s HF config fields.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    key = name.strip().lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(preset_names())}")
    cfg = dict(PRESETS[key])
    if "indexer_types" in cfg:
        cfg["indexer_types"] = list(cfg["indexer_types"])
    return cfg
