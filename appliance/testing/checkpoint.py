"""A small generated checkpoint in K3's layout (test and demo instrument, not production).

`write_checkpoint` writes what a Hub snapshot of K3 holds, in miniature: `config.json`, the
tokenizer files, `generation_config.json`, N well-formed safetensors shards (tensors of several
dtypes, contiguous offsets, the buffer covered exactly) and `model.safetensors.index.json`
mapping every tensor to its shard. Contents are deterministic in `seed`, so a fake Hub
restarted over the same folder serves the same bytes, hashes and commit.
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any

# Kimi K3's config.json as SGLang reads it (shared/reference/kimi-k3/config.json: rebuilt
# from the published figures), so the stand-in checkpoint has K3's real geometry and the
# tuning calculator works on it. The real checkpoint's file wins on the box.
K3_CONFIG_JSON = (
    "{\"model_type\":\"kimi_k3\",\"architectures\":[\"KimiK3ForConditionalGeneration\"],\"text_config\""
    ":{\"model_type\":\"kimi_linear\",\"architectures\":[\"KimiK3LinearForCausalLM\"],\"vocab_size\":16"
    "3840,\"hidden_size\":7168,\"num_hidden_layers\":93,\"num_attention_heads\":96,\"num_key_value_h"
    "eads\":96,\"head_dim\":72,\"hidden_act\":\"situ\",\"activation_situ_beta\":4.0,\"activation_situ_l"
    "inear_beta\":25.0,\"intermediate_size\":18432,\"moe_intermediate_size\":3072,\"routed_expert_h"
    "idden_size\":3584,\"num_experts\":896,\"num_experts_per_token\":16,\"num_shared_experts\":2,\"fi"
    "rst_k_dense_replace\":1,\"moe_layer_freq\":1,\"moe_router_activation_func\":\"sigmoid\",\"q_lora"
    "_rank\":1536,\"kv_lora_rank\":512,\"qk_nope_head_dim\":128,\"qk_rope_head_dim\":64,\"v_head_dim\""
    ":128,\"mla_use_nope\":false,\"mla_use_output_gate\":true,\"max_position_embeddings\":1048576,\""
    "rms_norm_eps\":1e-06,\"rope_theta\":50000.0,\"torch_dtype\":\"bfloat16\",\"linear_attn_config\":{"
    "\"kda_layers\":[1,2,3,5,6,7,9,10,11,13,14,15,17,18,19,21,22,23,25,26,27,29,30,31,33,34,35,"
    "37,38,39,41,42,43,45,46,47,49,50,51,53,54,55,57,58,59,61,62,63,65,66,67,69,70,71,73,74,7"
    "5,77,78,79,81,82,83,85,86,87,89,90,91],\"full_attn_layers\":[4,8,12,16,20,24,28,32,36,40,4"
    "4,48,52,56,60,64,68,72,76,80,84,88,92,93],\"num_heads\":96,\"head_dim\":128,\"short_conv_kern"
    "el_size\":4,\"use_full_rank_gate\":false,\"gate_lower_bound\":-5.0}},\"vision_config\":{\"patch_"
    "size\":14,\"num_hidden_layers\":27,\"hidden_size\":1024,\"num_attention_heads\":12,\"merge_kerne"
    "l_size\":[2,2]},\"media_placeholder_token_id\":163605,\"quantization_config\":{\"quant_method\""
    ":\"compressed-tensors\",\"format\":\"mxfp4-pack-quantized\",\"config_groups\":{\"group_0\":{\"forma"
    "t\":\"mxfp4-pack-quantized\",\"weights\":{\"num_bits\":4,\"type\":\"float\",\"group_size\":32},\"input"
    "_activations\":{\"num_bits\":8,\"type\":\"float\",\"group_size\":32},\"targets\":[\"Linear\"]}},\"igno"
    "re\":[\"lm_head\"]}}"
)


def k3_config() -> dict[str, Any]:
    """A fresh copy of K3's config (callers may add keys)."""
    config: dict[str, Any] = json.loads("".join(K3_CONFIG_JSON))
    return config


# (dtype, bytes per element) for the tensors of a shard; K3 ships MXFP4 weights as U8 blocks
# with F8_E8M0 scales next to BF16 norms, so the generated shards use the same mix.
_DTYPES = (("U8", 1), ("F8_E8M0", 1), ("BF16", 2), ("F32", 4))


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def safetensors_bytes(tensors: list[tuple[str, str, list[int], bytes]],
                      metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file from (name, dtype, shape, data) in order: 8-byte header length, the
    JSON header padded with spaces to a multiple of 8, then the data, contiguous."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(t[3] for t in tensors)


def write_checkpoint(directory: Path, *, shards: int = 4, shard_bytes: int = 1 << 20,
                     seed: int = 0, model_type: str = "kimi_k3") -> list[Path]:
    """Write the checkpoint into `directory` (created); returns the files written, sorted.
    Each shard holds about `shard_bytes` of tensor data."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)  # noqa: S311 - reproducible test bytes, not secrets
    weight_map: dict[str, str] = {}
    total = 0
    for index in range(shards):
        name = shard_name(index, shards)
        tensors = []
        budget = shard_bytes
        layer = 0
        while budget > 0:
            for dtype, width in _DTYPES:
                elements = max(1, min(budget // width, 1 << 18) if dtype == "U8" else 64)
                data = rng.randbytes(elements * width)
                tensor = f"model.layers.{index * 1000 + layer}.{dtype.lower()}.weight"
                tensors.append((tensor, dtype, [elements], data))
                weight_map[tensor] = name
                budget -= len(data)
                total += len(data)
                if budget <= 0:
                    break
            layer += 1
        (directory / name).write_bytes(safetensors_bytes(tensors))
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        indent=2))
    config = k3_config()
    config["model_type"] = model_type
    config["note"] = "generated by appliance.testing.checkpoint (a test and demo stand-in)"
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text('{"max_new_tokens": 4096}\n')
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 262144}\n')
    # one Hugging Face's `tokenizers` loads (merges included): a cell's router reads it from
    # the local model path
    (directory / "tokenizer.json").write_text(json.dumps(
        {"version": "1.0", "model": {"type": "BPE", "vocab": {"<s>": 0, "</s>": 1},
                                     "merges": []}}))
    return sorted(p for p in directory.iterdir() if p.is_file())
