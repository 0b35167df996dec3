"""Model geometry from config.json, read the way SGLang 0.5.23 reads it (tuning/geometry.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from appliance.errors import EX_DATAERR, EX_USAGE
from appliance.tuning.geometry import (
    DraftGeometry,
    GeometryError,
    draft_from_config,
    geometry_from_config,
    load_draft,
    load_geometry,
)

DATA = Path(__file__).parent / "data" / "tuning"


def config(name: str) -> dict[str, Any]:
    data = json.loads((DATA / name).read_text())
    assert isinstance(data, dict)
    return data


def test_kimi_k3_is_69_kda_and_24_mla_layers_and_multimodal() -> None:
    g = load_geometry(DATA / "kimi-k3.config.json")
    assert (g.model_type, g.linear_kind, g.attention) == ("kimi_k3", "kda", "mla")
    assert (g.linear_layers, g.full_layers) == (69, 24)
    assert (g.linear_k_heads, g.linear_v_heads, g.linear_k_dim, g.linear_v_dim) == \
        (96, 96, 128, 128)
    assert g.conv_kernel == 4
    assert (g.kv_lora_rank, g.qk_rope_head_dim, g.kv_heads, g.head_dim) == (512, 64, 0, 0)
    assert g.context_length == 1_048_576
    assert g.ssm_dtype is None
    # text_config makes hf_config is not hf_text_config: SGLang's is_multimodal is True.
    assert g.multimodal


def test_kimi_linear_48b_reads_one_based_kda_layers_and_model_max_length() -> None:
    g = load_geometry(DATA / "kimi-linear-48b-a3b.config.json")
    assert (g.model_type, g.linear_kind, g.linear_layers, g.full_layers) == \
        ("kimi_linear", "kda", 20, 7)
    assert (g.linear_v_heads, g.linear_v_dim, g.kv_lora_rank, g.qk_rope_head_dim) == \
        (32, 128, 512, 64)
    # No max_position_embeddings in the published file: SGLang reads model_max_length.
    assert g.context_length == 1_048_576
    assert not g.multimodal


def test_qwen3_next_is_36_gdn_and_12_gqa_layers() -> None:
    g = load_geometry(DATA / "qwen3-next-80b-a3b.config.json")
    assert (g.linear_kind, g.attention, g.linear_layers, g.full_layers) == \
        ("gdn", "mha", 36, 12)
    assert (g.linear_k_heads, g.linear_v_heads, g.linear_k_dim, g.linear_v_dim) == \
        (16, 32, 128, 128)
    assert (g.kv_heads, g.head_dim, g.v_head_dim, g.kv_lora_rank) == (2, 256, 256, 0)
    assert g.context_length == 262_144


def test_a_model_directory_means_its_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config("kimi-k3.config.json")))
    assert load_geometry(tmp_path).linear_layers == 69


def test_the_missing_field_is_named_with_its_path() -> None:
    broken = config("kimi-k3.config.json")
    del broken["text_config"]["linear_attn_config"]["kda_layers"]
    with pytest.raises(GeometryError) as caught:
        geometry_from_config(broken)
    assert caught.value.message == \
        "config.json: text_config.linear_attn_config.kda_layers is missing"
    assert caught.value.exit_code == EX_DATAERR


@pytest.mark.parametrize(("path", "value", "named"), [
    (("text_config", "num_hidden_layers"), None, "text_config.num_hidden_layers is missing"),
    (("text_config", "kv_lora_rank"), None, "text_config.kv_lora_rank is missing"),
    (("text_config", "linear_attn_config", "num_heads"), "96",
     "text_config.linear_attn_config.num_heads is '96', expected a positive integer"),
    (("text_config", "linear_attn_config", "full_attn_layers"), None,
     "text_config.linear_attn_config.full_attn_layers is missing"),
    (("text_config", "linear_attn_config", "kda_layers"), [200],
     "kda_layers names no layer in 1..93"),
    (("text_config", "linear_attn_config", "short_conv_kernel_size"), 1,
     "short_conv_kernel_size is 1"),
    (("text_config", "mamba_ssm_dtype"), "fp8", "mamba_ssm_dtype is 'fp8'"),
])
def test_bad_kda_fields_are_refused_by_name(path: tuple[str, ...], value: Any,
                                            named: str) -> None:
    broken = config("kimi-k3.config.json")
    parent = broken
    for key in path[:-1]:
        parent = parent[key]
    if value is None:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    with pytest.raises(GeometryError, match=named.replace(".", r"\.").replace("[", r"\[")):
        geometry_from_config(broken, source="k3.json")


@pytest.mark.parametrize("key", ["full_attention_interval", "linear_num_value_heads",
                                 "linear_key_head_dim", "num_attention_heads"])
def test_bad_gdn_fields_are_refused_by_name(key: str) -> None:
    broken = config("qwen3-next-80b-a3b.config.json")
    del broken[key]
    with pytest.raises(GeometryError, match=f"q.json: {key} is missing"):
        geometry_from_config(broken, source="q.json")


def test_a_model_without_linear_attention_is_refused() -> None:
    llama = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32}
    with pytest.raises(GeometryError, match="not a hybrid linear-attention model"):
        geometry_from_config(llama)


def test_language_model_only_drops_the_multimodal_flag() -> None:
    data = config("kimi-k3.config.json")
    data["language_model_only"] = True
    assert not geometry_from_config(data).multimodal


def test_context_length_follows_sglang_key_order_and_rope_factor() -> None:
    data = config("qwen3-next-80b-a3b.config.json")
    data["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    assert geometry_from_config(data).context_length == 4 * 262_144
    data["rope_scaling"]["original_max_position_embeddings"] = 262_144
    assert geometry_from_config(data).context_length == 262_144
    data = config("kimi-linear-48b-a3b.config.json")
    del data["model_max_length"]
    assert geometry_from_config(data).context_length == 4096  # KimiLinearConfig's default


def test_gdn_reads_mamba_ssm_dtype() -> None:
    data = config("qwen3-next-80b-a3b.config.json")
    data["mamba_ssm_dtype"] = "bfloat16"
    assert geometry_from_config(data).ssm_dtype == "bfloat16"


def test_missing_and_unreadable_files_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(GeometryError, match="no such file") as caught:
        load_geometry(tmp_path / "nope.json")
    assert caught.value.exit_code == EX_USAGE
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(GeometryError, match="not valid JSON") as caught:
        load_geometry(bad)
    assert caught.value.exit_code == EX_DATAERR
    bad.write_text("[1, 2]")
    with pytest.raises(GeometryError, match="not a JSON object"):
        load_geometry(bad)


def test_draft_geometry_and_gamma() -> None:
    assert load_draft(DATA / "k3-dspark-draft.config.json") == DraftGeometry(
        layers=8, kv_heads=1, head_dim=128, v_head_dim=128, block_size=7)


def test_draft_defaults_follow_model_config() -> None:
    base = {"num_hidden_layers": 2, "num_attention_heads": 16, "hidden_size": 2048}
    assert draft_from_config(base) == DraftGeometry(2, 16, 128, 128, None)
    nested = {"text_config": dict(base, num_key_value_heads=2, head_dim=64, v_head_dim=96),
              "dflash_config": {"block_size": 15}}
    assert draft_from_config(nested) == DraftGeometry(2, 2, 64, 96, 15)
    partial = copy.deepcopy(base)
    del partial["num_hidden_layers"]
    with pytest.raises(GeometryError, match="draft config: num_hidden_layers is missing"):
        draft_from_config(partial)
    with pytest.raises(GeometryError, match="head_dim is missing"):
        draft_from_config({"num_hidden_layers": 2, "num_key_value_heads": 1})
