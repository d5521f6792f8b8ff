"""DSA model geometry, the four layer-skip rules and the shipped presets (DESIGN.md "Layer-skip rules")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.server.model_config import DSAModelConfig, dsa_layer_skips_topk, skip_topk_mask, validate_skip_config
from kvtier.server.presets import get_preset, preset_names

MODELS_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "models"

GLM52_LIVE = [0, 1, 2] + list(range(6, 75, 4))


def shipped(name: str) -> dict:
    """The published config excerpt in ../shared/data/models/, without its ``_note``."""
    data = json.loads((MODELS_DIR / f"{name}.json").read_text())
    data.pop("_note")
    return data


def live_layers(config: dict, n: int) -> list[int]:
    return [i for i in range(n) if not dsa_layer_skips_topk(config, i)]


# ----- the right values ---------------------------------------------------------------------------
def test_glm52_live_layers_are_0_1_2_then_every_fourth_from_6():
    assert GLM52_LIVE[:5] == [0, 1, 2, 6, 10] and GLM52_LIVE[-1] == 74 and len(GLM52_LIVE) == 21
    model = DSAModelConfig.from_preset("glm-5.2")
    assert model.num_layers == 78
    assert list(model.live_indexer_layers) == GLM52_LIVE
    assert list(model.skipped_layers) == [i for i in range(78) if i not in GLM52_LIVE]
    assert live_layers(shipped("glm-5.2"), 78) == GLM52_LIVE


def test_glm52_freq_and_offset_alone_give_the_same_layers_as_its_indexer_types():
    cfg = shipped("glm-5.2")
    del cfg["indexer_types"]
    assert live_layers(cfg, 78) == GLM52_LIVE


def test_deepseek_v32_has_all_61_layers_live():
    model = DSAModelConfig.from_preset("deepseek-v3.2")
    assert model.num_layers == 61
    assert list(model.live_indexer_layers) == list(range(61))
    assert live_layers(shipped("deepseek-v3.2"), 61) == list(range(61))


@pytest.mark.parametrize("name", ["deepseek-v3.2", "glm-5.2"])
def test_presets_equal_the_shipped_config_excerpts(name):
    assert name in preset_names()
    assert get_preset(name) == shipped(name)


@pytest.mark.parametrize("name", ["deepseek-v3.2", "glm-5.2"])
def test_geometry_of_presets(name):
    fp8 = DSAModelConfig.from_preset(name)
    bf16 = DSAModelConfig.from_preset(name, kv_cache_dtype="bf16")
    assert (fp8.kv_lora_rank, fp8.qk_rope_head_dim, fp8.index_head_dim, fp8.page_size) == (512, 64, 128, 64)
    assert fp8.latent_row_bytes == 512 + 4 * 4 + 64 * 2 == 656 and fp8.kv_cache_dim == 656
    assert bf16.latent_row_bytes == 576 * 2 and bf16.kv_cache_dim == 576
    assert fp8.index_token_bytes == 132 and fp8.index_page_bytes == 64 * 132 == 8448


def test_from_hf_config_reads_a_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(shipped("glm-5.2")))
    model = DSAModelConfig.from_hf_config(path)
    assert list(model.live_indexer_layers) == GLM52_LIVE
    assert model.num_layers == 78 and model.kv_cache_dtype == "fp8"
    assert DSAModelConfig.from_hf_config(str(path), kv_cache_dtype="bf16").latent_row_bytes == 1152


def test_from_hf_config_missing_path_and_missing_field(tmp_path):
    with pytest.raises(FileNotFoundError):
        DSAModelConfig.from_hf_config(tmp_path / "nope.json")
    cfg = shipped("deepseek-v3.2")
    del cfg["kv_lora_rank"]
    with pytest.raises(ValueError, match="kv_lora_rank"):
        DSAModelConfig.from_hf_config(cfg)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="glm-5.2"):
        DSAModelConfig.from_preset("llama-3")


def test_num_layers_override_keeps_the_rules():
    model = DSAModelConfig.from_preset("glm-5.2", num_layers=8)
    assert model.skip_topk_layers == (False, False, False, True, True, True, False, True)


def test_fingerprint_tells_skip_masks_apart():
    glm = DSAModelConfig.from_preset("glm-5.2")
    assert glm.fingerprint()["skip_mask"] == "".join("F" if i in GLM52_LIVE else "S" for i in range(78))
    assert glm.fingerprint_digest() == DSAModelConfig.from_preset("glm-5.2").fingerprint_digest()
    assert glm.fingerprint_digest() != DSAModelConfig.from_preset("glm-5.2", kv_cache_dtype="bf16").fingerprint_digest()


# ----- each rule, and their order -----------------------------------------------------------------
def test_rule1_indexer_types_shared_skips_and_out_of_range_does_not():
    cfg = {"num_hidden_layers": 4, "indexer_types": ["full", "shared", "full", "shared"]}
    assert [dsa_layer_skips_topk(cfg, i) for i in range(6)] == [False, True, False, True, False, False]


def test_rule2_cli_factor():
    cfg = {"num_hidden_layers": 7, "cli_factor": 3}
    assert [dsa_layer_skips_topk(cfg, i) for i in range(7)] == [False, True, True, False, True, True, False]


def test_rule3_pattern():
    cfg = {"num_hidden_layers": 5, "index_topk_pattern": "FSSFS"}
    assert [dsa_layer_skips_topk(cfg, i) for i in range(6)] == [False, True, True, False, True, False]


def test_rule4_freq_with_and_without_offset():
    # offset 2, freq 3: max(l - 1, 0) % 3 != 0 -> l = 0, 1, 4, 7 full
    with_offset = {"num_hidden_layers": 9, "index_topk_freq": 3, "index_skip_topk_offset": 2}
    assert live_layers(with_offset, 9) == [0, 1, 4, 7]
    # no offset, freq 2: max(l - 1, 0) % 2 != 0 -> l = 0, 1, 3, 5 full
    no_offset = {"num_hidden_layers": 7, "index_topk_freq": 2}
    assert live_layers(no_offset, 7) == [0, 1, 3, 5]
    # nothing given: freq 1, no layer skips
    assert live_layers({"num_hidden_layers": 5}, 5) == [0, 1, 2, 3, 4]


def test_rules_apply_in_order():
    base = {"num_hidden_layers": 4, "index_topk_freq": 2}
    # rule 1 beats rules 2-4
    cfg = dict(base, indexer_types=["full"] * 4, cli_factor=2, index_topk_pattern="FSSS")
    assert live_layers(cfg, 4) == [0, 1, 2, 3]
    # rule 2 beats rules 3-4
    cfg = dict(base, cli_factor=2, index_topk_pattern="FFFF")
    assert live_layers(cfg, 4) == [0, 2]
    # cli_factor 1 does not apply: rule 3 decides
    cfg = dict(base, cli_factor=1, index_topk_pattern="FFSF")
    assert live_layers(cfg, 4) == [0, 1, 3]
    # rule 3 beats rule 4
    cfg = dict(base, index_topk_pattern="FFFF")
    assert live_layers(cfg, 4) == [0, 1, 2, 3]
    # rule 4 alone
    assert live_layers(base, 4) == [0, 1, 3]


def test_config_object_with_attributes_works_like_a_dict():
    class HFConfig:
        num_hidden_layers = 4
        index_topk_pattern = "FSFS"

    assert skip_topk_mask(HFConfig()) == (False, True, False, True)


# ----- invalid configs: ValueError naming the field -----------------------------------------------
@pytest.mark.parametrize(
    "cfg, field",
    [
        ({"num_hidden_layers": 3, "indexer_types": ["shared", "full", "full"]}, "indexer_types"),
        ({"num_hidden_layers": 3, "index_topk_pattern": "SFF"}, "index_topk_pattern"),
        ({"num_hidden_layers": 3, "index_skip_topk_offset": 0}, "index_skip_topk_offset"),
        ({"num_hidden_layers": 3, "index_skip_topk_offset": -2, "index_topk_freq": 4}, "index_skip_topk_offset"),
        ({"num_hidden_layers": 3, "index_topk_freq": 0}, "index_topk_freq"),
        ({"num_hidden_layers": 3, "index_topk_freq": -1}, "index_topk_freq"),
        ({"num_hidden_layers": 3, "index_topk_pattern": "FSx"}, "index_topk_pattern"),
        ({"num_hidden_layers": 3, "index_topk_pattern": "FsF"}, "index_topk_pattern"),
        ({"num_hidden_layers": 3, "index_topk_pattern": "FS"}, "index_topk_pattern"),
        ({"num_hidden_layers": 3, "indexer_types": ["full", "shared"]}, "indexer_types"),
        ({"num_hidden_layers": 3, "indexer_types": ["full", "shared", "full", "full"]}, "indexer_types"),
        ({"num_hidden_layers": 3, "indexer_types": ["full", "sparse", "full"]}, "indexer_types"),
        ({"num_hidden_layers": 3, "indexer_types": "full"}, "indexer_types"),
        ({"num_hidden_layers": 3, "cli_factor": 0}, "cli_factor"),
    ],
)
def test_invalid_config_raises_naming_the_field(cfg, field):
    with pytest.raises(ValueError, match=field):
        validate_skip_config(cfg)
    with pytest.raises(ValueError, match=field):
        dsa_layer_skips_topk(cfg, 1)
    with pytest.raises(ValueError, match=field):
        DSAModelConfig.from_hf_config(dict(cfg, kv_lora_rank=512, qk_rope_head_dim=64))


def test_layer_zero_skip_error_says_why():
    with pytest.raises(ValueError, match="layer 0"):
        validate_skip_config({"num_hidden_layers": 2, "index_topk_pattern": "SF"})
    with pytest.raises(ValueError, match="layer 0"):
        DSAModelConfig(name="x", num_layers=2, skip_topk_layers=(True, False))


def test_negative_layer_id_raises():
    with pytest.raises(ValueError, match="layer_id"):
        dsa_layer_skips_topk({"num_hidden_layers": 2}, -1)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_layers": 2, "kv_cache_dtype": "fp16"}, "kv_cache_dtype"),
        ({"num_layers": 2, "page_size": 0}, "page_size"),
        ({"num_layers": 2, "index_head_dim": 100}, "index_head_dim"),
        ({"num_layers": 2, "skip_topk_layers": (False, True, False)}, "skip_topk_layers"),
    ],
)
def test_model_config_rejects_bad_geometry(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DSAModelConfig(name="x", **kwargs)


def test_config_file_that_is_not_a_json_object(tmp_path):
    """Regression: a config.json holding a JSON list raised AttributeError ('list' object has no
    attribute 'get'); it is a ValueError saying what is wrong."""
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        DSAModelConfig.from_hf_config(path)
    path.write_text("{not json")
    with pytest.raises(ValueError):
        DSAModelConfig.from_hf_config(path)
