"""Tiny models for the real-engine tier, made at test time (nothing comes from a hub).

Run with the ENGINE environment's Python (it has ``tokenizers``; the project
venv does not need it): ``python tests/realengine/models.py dense|hybrid DIR``.
The tier's fixtures do exactly that (``fixtures.make_model``).

- ``dense``: a ``LlamaForCausalLM`` (hidden 64, 2 layers, 4 heads / 2 KV heads,
  head_dim 16) with random weights in one real ``model.safetensors`` (~280 kB), so
  the engine loads a checkpoint as it would K3's (its shard-loading lines, the
  product's weight proof); it serves requests end to end on CPU. ``--load-format
  dummy`` works on it too.
- ``hybrid``: a ``KimiLinearForCausalLM`` (the class SGLang builds for Kimi K3's
  config): one KDA layer and one MLA layer, dense MLP, run with ``--load-format
  dummy`` (random weights made by the engine). Its ``model.safetensors`` holds one
  placeholder tensor that the engine never reads: it is there because the product
  refuses to launch on a folder without a shard. It starts and allocates real state
  and KV pools but cannot generate on CPU (KDA prefill is Triton-only).

Both get the same 512-token byte-level BPE, trained in about a second on text
written here, and a ``tokenizer_config.json`` with a chat template. The output is
deterministic for a given corpus and vocabulary size, so two workers building
the same model agree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB_SIZE = 512

# Any plain text trains a byte-level BPE; this paragraph and its variations are
# enough for 512 merges and keep the tokenizer reproducible.
_CORPUS_SEED = (
    "The appliance serves one large model through SGLang on an on-prem box. "
    "An operator installs it, opens the console, and gives users a local endpoint. "
    "Requests stream tokens back; the gateway counts usage per key and enforces limits. "
    "The engine loads weights, allocates its KV cache and state pools, then answers health checks. "
    "Hello, how are you today? I am fine, thank you. What is the capital of France? Paris. "
    "0123456789 + - * / = ( ) [ ] { } < > : ; , . ! ? ' \" "
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|end|>", "<|system|>", "<|user|>",
                  "<|assistant|>"]


def _corpus() -> list[str]:
    words = _CORPUS_SEED.split()
    return [_CORPUS_SEED] + [" ".join(words[i:] + words[:i]) for i in range(0, len(words), 3)]


def write_tokenizer(directory: Path) -> None:
    """Train the byte-level BPE and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (directory / "special_tokens_map.json").write_text(
        json.dumps({k: config[k] for k in ("bos_token", "eos_token", "pad_token")})
    )


def _common(vocab: int) -> dict[str, object]:
    return {
        "vocab_size": vocab,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "initializer_range": 0.02,
    }


def dense_config() -> dict[str, object]:
    return {
        **_common(VOCAB_SIZE),
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 10000.0,
    }


def hybrid_config() -> dict[str, object]:
    return {
        **_common(VOCAB_SIZE),
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "num_experts": None,
        "first_k_dense_replace": 2,
        "linear_attn_config": {
            "kda_layers": [1],
            "full_attn_layers": [2],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        "rope_theta": 10000.0,
    }


CONFIGS = {"dense": dense_config, "hybrid": hybrid_config}


def write_dense_weights(directory: Path, seed: int = 0) -> None:
    """Random bf16 weights under Llama's checkpoint names (what SGLang's loader maps)."""
    import torch
    from safetensors.torch import save_file

    config = dense_config()
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim, vocab = int(config["head_dim"]), VOCAB_SIZE
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
               "lm_head.weight": rand(vocab, hidden)}
    for layer in range(int(config["num_hidden_layers"])):
        prefix = f"model.layers.{layer}"
        tensors |= {
            f"{prefix}.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            f"{prefix}.post_attention_layernorm.weight": torch.ones(hidden,
                                                                    dtype=torch.bfloat16),
            f"{prefix}.self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            f"{prefix}.self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            f"{prefix}.mlp.gate_proj.weight": rand(inter, hidden),
            f"{prefix}.mlp.up_proj.weight": rand(inter, hidden),
            f"{prefix}.mlp.down_proj.weight": rand(hidden, inter),
        }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def write_placeholder_shard(directory: Path) -> None:
    """One tensor no loader reads (the hybrid runs with --load-format dummy)."""
    import torch
    from safetensors.torch import save_file

    save_file({"appliance.placeholder": torch.zeros(1)}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})


def write_model(kind: str, directory: Path) -> Path:
    """Write config.json and the tokenizer for ``kind`` into ``directory``; return it."""
    if kind not in CONFIGS:
        raise SystemExit(f"unknown model kind {kind!r}: choose one of {', '.join(CONFIGS)}")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIGS[kind](), indent=2))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2})
    )
    write_tokenizer(directory)
    (write_dense_weights if kind == "dense" else write_placeholder_shard)(directory)
    return directory


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: models.py dense|hybrid DIRECTORY")
    print(write_model(sys.argv[1], Path(sys.argv[2])))
