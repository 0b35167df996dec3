"""A model's memory geometry, read from its `config.json` the way SGLang 0.5.23 reads it.

Only what sizes the two memory pools is kept: the linear-attention layers that carry
fixed-size recurrent state (KDA for Kimi-Linear and Kimi K3, Gated DeltaNet for Qwen3-Next)
and the full-attention layers that carry a per-token KV cache (MLA latent rows, or MHA/GQA
K+V heads). Pure: `geometry_from_config` takes the parsed JSON; `load_geometry` is the only IO.

Where each number comes from (SGLang 0.5.23, paths relative to the `sglang` package):

- The text config is the sub-config SGLang calls `hf_text_config`
  (`srt/utils/hf_transformers/common.py:547-613`: `thinker_config`, `llm_config`,
  `language_config`, then `text_config`). A config that has one is *multimodal* for SGLang
  (`has_multimodal_subconfig`, `srt/configs/model_config.py:809-827`), which reserves 100 MiB
  of the pool budget (see `calculator.mm_reservation_bytes`). K3's config always has one.
- KDA (`srt/configs/kimi_linear.py:158-189`): `linear_attn_config.kda_layers` are 1-based layer
  numbers; every other layer of `num_hidden_layers` is full attention; heads, head_dim and
  `short_conv_kernel_size` are read with `[...]`, so a missing one fails SGLang too. Key and
  value heads/dims are equal (the state shape is `(H/tp, hd, hd)`). Full attention is MLA
  (`model_config.py:1463-1475`): `kv_lora_rank + qk_rope_head_dim` per row and layer.
- GDN (`srt/configs/qwen3_next.py:259-313`): layer `i` is full attention when
  `(i + 1) % full_attention_interval == 0`; full attention is MHA/GQA with
  `num_key_value_heads` heads of `head_dim` (+ `v_head_dim`, default `head_dim`).
  SGLang falls back to its class defaults for missing `linear_*` fields; this module refuses
  instead, so a truncated config is named rather than sized as a different model.
- `context_length` follows `get_context_length` (`common.py:668-694`): the first of
  `max_sequence_length`, `seq_length`, `max_seq_len`, `model_max_length`,
  `max_position_embeddings` on the text config, times a plain `rope_scaling.factor`; without
  any, the config class's default (4096 Kimi-Linear, 32768 Qwen3-Next).

Invariants of `Geometry`: every count is positive except the attention fields of the other
attention kind, which are 0; `linear_layers + full_layers` is the model's layer count.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.errors import EX_DATAERR, EX_USAGE, ApplianceError

_TEXT_KEYS = ("thinker_config", "llm_config", "language_config", "text_config")
_CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                 "max_position_embeddings")
_DEFAULT_CONTEXT = {"kda": 4096, "gdn": 32768}
_SSM_DTYPES = ("float32", "bfloat16", "float16")


class GeometryError(ApplianceError):
    """A model config that cannot be sized; the message names the file and the field."""

    exit_code = EX_DATAERR

    def __init__(self, message: str, hint: str = "", *, exit_code: int | None = None) -> None:
        super().__init__("geometry_invalid", message,
                         hint or "point at the model's own config.json (the checkpoint's file)",
                         status=422, exit_code=exit_code)


@dataclass(frozen=True)
class Geometry:
    """What sizes SGLang's recurrent-state pool and full-attention KV pool, for one model."""

    model_type: str
    linear_kind: str            # "kda" (Kimi-Linear/K3) or "gdn" (Qwen3-Next)
    linear_layers: int
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    conv_kernel: int
    full_layers: int
    attention: str              # "mla" or "mha"
    kv_lora_rank: int           # MLA (0 for MHA)
    qk_rope_head_dim: int
    kv_heads: int               # MHA (0 for MLA)
    head_dim: int
    v_head_dim: int
    context_length: int
    ssm_dtype: str | None       # `mamba_ssm_dtype` from the config, if present
    multimodal: bool = False    # SGLang's `is_multimodal` (a text sub-config): 100 MiB reserved

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class DraftGeometry:
    """A DSPARK/DFLASH draft's dense attention: what its KV pool costs per target token.

    `block_size` is the draft's gamma when its config states one (draft tokens = gamma + 1).
    """

    layers: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    block_size: int | None = None


def geometry_from_config(config: Mapping[str, Any], *, source: str = "config.json") -> Geometry:
    """The geometry of a parsed `config.json`; GeometryError names the missing/invalid field."""
    if not isinstance(config, Mapping):
        raise GeometryError(f"{source}: not a JSON object")
    text, prefix, multimodal = _text_config(config, source)
    if text.get("language_model_only") or config.get("language_model_only"):
        multimodal = False
    model_type = str(config.get("model_type") or text.get("model_type") or "unknown")
    layers = _int(text, "num_hidden_layers", source, prefix)
    if "linear_attn_config" in text:
        return _kda(text, source, prefix, model_type, layers, multimodal)
    if text.get("model_type") == "qwen3_next" or "full_attention_interval" in text:
        return _gdn(text, source, prefix, model_type, layers, multimodal)
    raise GeometryError(
        f"{source}: {prefix}linear_attn_config (KDA) or {prefix}full_attention_interval (GDN) is "
        f"missing: model_type {model_type!r} is not a hybrid linear-attention model",
        "the calculator sizes Kimi-Linear / Kimi K3 (kimi_linear, kimi_k3) and Qwen3-Next "
        "(qwen3_next) configs")


def load_geometry(path: Path) -> Geometry:
    """`geometry_from_config` of the JSON file at `path` (a model directory means its
    config.json)."""
    return geometry_from_config(_read_json(path), source=str(path))


def draft_from_config(config: Mapping[str, Any], *, source: str = "draft config") -> DraftGeometry:
    """A draft's attention geometry as `ModelConfig(is_draft_model=True)` resolves it: heads
    from `num_key_value_heads` (else `num_attention_heads`), `head_dim` (else hidden_size //
    heads), `v_head_dim` (else `head_dim`); gamma from `dspark_block_size`,
    `dspark_config.block_size`, `dflash_config.block_size` or `block_size`."""
    if not isinstance(config, Mapping):
        raise GeometryError(f"{source}: not a JSON object")
    nested = config.get("text_config")
    text = nested if isinstance(nested, Mapping) else config
    prefix = "text_config." if text is not config else ""
    layers = _int(text, "num_hidden_layers", source, prefix)
    heads = _optional_int(text, "num_attention_heads", source, prefix)
    kv_heads = _optional_int(text, "num_key_value_heads", source, prefix) or heads
    if kv_heads is None:
        raise GeometryError(f"{source}: {prefix}num_key_value_heads is missing "
                            "(and so is num_attention_heads)")
    head_dim = _optional_int(text, "head_dim", source, prefix)
    if head_dim is None:
        hidden = _optional_int(text, "hidden_size", source, prefix)
        if hidden is None or heads is None:
            raise GeometryError(f"{source}: {prefix}head_dim is missing (and hidden_size / "
                                "num_attention_heads cannot stand in for it)")
        head_dim = hidden // heads
    v_head_dim = _optional_int(text, "v_head_dim", source, prefix) or head_dim
    return DraftGeometry(layers, kv_heads, head_dim, v_head_dim, _draft_block_size(config))


def load_draft(path: Path) -> DraftGeometry:
    """`draft_from_config` of the JSON file at `path` (a directory means its config.json)."""
    return draft_from_config(_read_json(path), source=str(path))


# --- the two families ---------------------------------------------------------------------


def _kda(text: Mapping[str, Any], source: str, prefix: str, model_type: str, layers: int,
         multimodal: bool) -> Geometry:
    lac = text.get("linear_attn_config")
    where = f"{prefix}linear_attn_config"
    if not isinstance(lac, Mapping):
        raise GeometryError(f"{source}: {where} is not an object")
    kda_layers = _layer_list(lac, "kda_layers", source, where)
    _layer_list(lac, "full_attn_layers", source, where)  # SGLang asserts it is present
    linear = sum(1 for i in range(layers) if i + 1 in set(kda_layers))
    if linear == 0:
        raise GeometryError(f"{source}: {where}.kda_layers names no layer in 1..{layers}",
                            "kda_layers are 1-based layer numbers")
    heads = _int(lac, "num_heads", source, where + ".")
    head_dim = _int(lac, "head_dim", source, where + ".")
    kernel = _int(lac, "short_conv_kernel_size", source, where + ".")
    if kernel < 2:
        raise GeometryError(f"{source}: {where}.short_conv_kernel_size is {kernel}; the conv "
                            "state keeps kernel - 1 rows, so it must be at least 2")
    return Geometry(
        model_type=model_type, linear_kind="kda", linear_layers=linear,
        linear_k_heads=heads, linear_v_heads=heads, linear_k_dim=head_dim,
        linear_v_dim=head_dim, conv_kernel=kernel, full_layers=layers - linear,
        attention="mla", kv_lora_rank=_int(text, "kv_lora_rank", source, prefix),
        qk_rope_head_dim=_int(text, "qk_rope_head_dim", source, prefix),
        kv_heads=0, head_dim=0, v_head_dim=0,
        context_length=_context_length(text, "kda", source, prefix),
        ssm_dtype=_ssm_dtype(text, source, prefix), multimodal=multimodal)


def _gdn(text: Mapping[str, Any], source: str, prefix: str, model_type: str, layers: int,
         multimodal: bool) -> Geometry:
    interval = _int(text, "full_attention_interval", source, prefix)
    full = sum(1 for i in range(layers) if (i + 1) % interval == 0)
    heads = _int(text, "num_attention_heads", source, prefix)
    kv_heads = _optional_int(text, "num_key_value_heads", source, prefix) or heads
    head_dim = _optional_int(text, "head_dim", source, prefix)
    if head_dim is None:
        head_dim = _int(text, "hidden_size", source, prefix) // heads
    kernel = _int(text, "linear_conv_kernel_dim", source, prefix)
    if kernel < 2:
        raise GeometryError(f"{source}: {prefix}linear_conv_kernel_dim is {kernel}; it must be "
                            "at least 2")
    return Geometry(
        model_type=model_type, linear_kind="gdn", linear_layers=layers - full,
        linear_k_heads=_int(text, "linear_num_key_heads", source, prefix),
        linear_v_heads=_int(text, "linear_num_value_heads", source, prefix),
        linear_k_dim=_int(text, "linear_key_head_dim", source, prefix),
        linear_v_dim=_int(text, "linear_value_head_dim", source, prefix),
        conv_kernel=kernel, full_layers=full, attention="mha", kv_lora_rank=0,
        qk_rope_head_dim=0, kv_heads=kv_heads, head_dim=head_dim,
        v_head_dim=_optional_int(text, "v_head_dim", source, prefix) or head_dim,
        context_length=_context_length(text, "gdn", source, prefix),
        ssm_dtype=_ssm_dtype(text, source, prefix), multimodal=multimodal)


# --- field readers ------------------------------------------------------------------------


def _text_config(config: Mapping[str, Any], source: str) -> tuple[Mapping[str, Any], str, bool]:
    for key in _TEXT_KEYS:
        sub = config.get(key)
        if sub is None:
            continue
        if not isinstance(sub, Mapping):
            raise GeometryError(f"{source}: {key} is not an object")
        inner = sub.get("text_config") if key == "thinker_config" else None
        if isinstance(inner, Mapping):
            return inner, f"{key}.text_config.", True
        return sub, f"{key}.", True
    return config, "", False


def _int(data: Mapping[str, Any], key: str, source: str, prefix: str) -> int:
    value = _optional_int(data, key, source, prefix)
    if value is None:
        raise GeometryError(f"{source}: {prefix}{key} is missing")
    return value


def _optional_int(data: Mapping[str, Any], key: str, source: str, prefix: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise GeometryError(f"{source}: {prefix}{key} is {value!r}, expected a positive integer")
    return value


def _layer_list(data: Mapping[str, Any], key: str, source: str, where: str) -> list[int]:
    value = data.get(key)
    if value is None:
        raise GeometryError(f"{source}: {where}.{key} is missing")
    if not isinstance(value, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise GeometryError(f"{source}: {where}.{key} is not a list of layer numbers")
    return value


def _context_length(text: Mapping[str, Any], kind: str, source: str, prefix: str) -> int:
    factor = 1.0
    rope = text.get("rope_scaling")
    if isinstance(rope, Mapping) and rope:
        raw = rope.get("factor", 1)
        factor = float(raw) if isinstance(raw, int | float) else 1.0
        if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3":
            factor = 1.0
    for key in _CONTEXT_KEYS:
        value = text.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise GeometryError(f"{source}: {prefix}{key} is {value!r}, expected a "
                                    "positive integer")
            return int(factor * value)
    return _DEFAULT_CONTEXT[kind]


def _ssm_dtype(text: Mapping[str, Any], source: str, prefix: str) -> str | None:
    value = text.get("mamba_ssm_dtype")
    if value is None:
        return None
    if value not in _SSM_DTYPES:
        raise GeometryError(f"{source}: {prefix}mamba_ssm_dtype is {value!r}, expected one of "
                            + ", ".join(_SSM_DTYPES))
    return str(value)


def _draft_block_size(config: Mapping[str, Any]) -> int | None:
    candidates: list[Any] = [config.get("dspark_block_size")]
    for key in ("dspark_config", "dflash_config"):
        sub = config.get(key)
        if isinstance(sub, Mapping):
            candidates.append(sub.get("block_size"))
    candidates.append(config.get("block_size"))
    for value in candidates:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _read_json(path: Path) -> Mapping[str, Any]:
    target = path / "config.json" if path.is_dir() else path
    try:
        text = target.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GeometryError(f"{target}: no such file", "give the path of the model's "
                            "config.json (or its directory)", exit_code=EX_USAGE) from None
    except OSError as exc:
        raise GeometryError(f"{target}: cannot be read ({exc.strerror})",
                            "check the path and its permissions", exit_code=EX_USAGE) from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise GeometryError(f"{target}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise GeometryError(f"{target}: not a JSON object")
    return data
