"""Llama and Mistral."""

from __future__ import annotations

from ketch.engine.models.architectures.rules import (
    COMMON,
    DECLARED_FULL_ATTENTION,
    Architecture,
    Rule,
    Settings,
    declared_layer_types,
    window_value,
)


def _mistral_window(s: Settings, _context: int) -> str | None:
    return window_value("sliding_window", s.get("sliding_window"))


def _mistral_windows(s: Settings) -> list[int]:
    # MistralAttention applies config.sliding_window to every layer; layer_types is ignored.
    return [s.get("sliding_window") or 0] * int(s["num_hidden_layers"])


LLAMA = Architecture(
    name="LlamaForCausalLM",
    family="llama",
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    mlp_bias="mlp_bias",
    qk_norm=False,
    defaults={"max_position_embeddings": 2048},
    rules=(
        *COMMON,
        *DECLARED_FULL_ATTENTION,
    ),
)
MISTRAL = Architecture(
    name="MistralForCausalLM",
    family="llama",
    qkv_bias=False,  # MistralAttention and MistralMLP have no biases, whatever the config says
    o_bias=False,
    mlp_bias=False,
    qk_norm=False,
    defaults={"num_key_value_heads": 8, "max_position_embeddings": 131072, "sliding_window": 4096},
    rules=(
        *COMMON,
        Rule("layer_types", "absent, or full_attention only", declared_layer_types),
        Rule("sliding_window", "a positive window in every layer, or null", _mistral_window),
    ),
    windows=_mistral_windows,
)
