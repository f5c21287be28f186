"""Gemma 3 (text): interleaved sliding and full layers, each kind with its own RoPE."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ketch.engine.models.architectures.rules import (
    ROPE_TYPES,
    Architecture,
    Rule,
    Settings,
    count,
    positive,
    quantization_problem,
    ranges,
    rope_problem,
    show,
    string_list,
    window_value,
)

GEMMA3_LAYER_TYPES = ("full_attention", "sliding_attention")


def gemma3_layer_types(s: Settings) -> list[str]:
    """Each layer's attention as Gemma3TextConfig computes it: ``layer_types`` when given, else
    every ``sliding_window_pattern``-th layer full and the others sliding."""
    given = s.get("layer_types")
    if given is not None:
        return list(given)
    pattern = s.get("sliding_window_pattern", 6)
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(int(s.get("num_hidden_layers") or 0))
    ]


def gemma3_rope_parameters(s: Settings) -> dict[str, dict[str, Any]]:
    """The RoPE parameters of each layer type, as Gemma3TextConfig assembles them: transformers
    5's ``rope_parameters`` per layer type, else (transformers 4) ``rope_theta`` with
    ``rope_scaling`` for the full layers and ``rope_local_base_freq`` for the sliding ones."""
    given = s.get("rope_parameters")
    given = given if isinstance(given, Mapping) else {}
    out = {}
    for layer_type in GEMMA3_LAYER_TYPES:
        params = given.get(layer_type)
        out[layer_type] = dict(params) if isinstance(params, Mapping) else {"rope_type": "default"}
    scaling = s.get("rope_scaling")
    out["full_attention"].update(scaling if isinstance(scaling, Mapping) else {})
    out["full_attention"].setdefault("rope_theta", s.get("rope_theta", 1_000_000.0))
    out["sliding_attention"].setdefault("rope_theta", s.get("rope_local_base_freq", 10_000.0))
    return out


def _gemma3_activation(s: Settings, _context: int) -> str | None:
    act = s.get("hidden_activation")
    if act == "gelu_pytorch_tanh":
        return None
    return f"{show('hidden_activation', act)}: only gelu_pytorch_tanh is implemented"


def _gemma3_rope(s: Settings, context: int) -> str | None:
    given = s.get("rope_parameters")
    if given and (
        not isinstance(given, Mapping)
        or set(given) - set(GEMMA3_LAYER_TYPES)
        or not all(isinstance(p, Mapping) for p in given.values())
    ):
        # transformers' Gemma 3 ignores a flat set (it keeps its default thetas): not guessed at.
        return (
            f"{show('rope_parameters', given)}: expected one object per layer type "
            f"({', '.join(GEMMA3_LAYER_TYPES)})"
        )
    scaling = s.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, Mapping):
        return f"{show('rope_scaling', scaling)}: expected an object"
    for layer_type, params in gemma3_rope_parameters(s).items():
        declared = params.get("type")
        if declared is not None and declared != params.get("rope_type"):
            # Gemma3TextConfig merges rope_scaling over {"rope_type": "default"}, so a legacy
            # "type" is ignored by transformers: not guessed at either way.
            return (
                f"{layer_type} layers: type={declared!r} beside rope_type="
                f"{params.get('rope_type')!r}: write the scaling as rope_type"
            )
        problem = rope_problem({"rope_parameters": params}, context)
        if problem is not None:
            return f"{layer_type} layers: {problem}"
    return None


def _gemma3_partial_rotary(s: Settings, _context: int) -> str | None:
    for params in (s, *gemma3_rope_parameters(s).values()):
        factor = params.get("partial_rotary_factor")
        if factor not in (None, 1):
            shown = show("partial_rotary_factor", factor)
            return f"{shown}: rotating part of each head is not implemented"
    return None


def _gemma3_layer_types(s: Settings, _context: int) -> str | None:
    given = s.get("layer_types")
    if given is not None and not string_list(given):
        return f"{show('layer_types', given)}: expected a list of layer kinds (strings)"
    pattern = s.get("sliding_window_pattern", 6)
    if given is None and (not count(pattern) or not pattern):
        return f"{show('sliding_window_pattern', pattern)}: expected a positive integer"
    types = gemma3_layer_types(s)
    other = sorted(set(types) - set(GEMMA3_LAYER_TYPES))
    if other:
        return f"layer_types: {', '.join(map(repr, other))} layers are not implemented"
    if len(types) != s.get("num_hidden_layers"):
        return f"layer_types: {len(types)} types for {s.get('num_hidden_layers')} layers"
    return None


def _gemma3_window(s: Settings, _context: int) -> str | None:
    sliding = [i for i, t in enumerate(gemma3_layer_types(s)) if t == "sliding_attention"]
    if not sliding:
        return None
    where = f" (sliding_attention layers {ranges(sliding)})"
    if s.get("sliding_window") is None:  # transformers cannot build their mask
        return f"sliding_window=None{where}: expected a positive integer"
    return window_value("sliding_window", s.get("sliding_window"), where)


def _gemma3_windows(s: Settings) -> list[int]:
    window = s.get("sliding_window") or 0
    return [window if t == "sliding_attention" else 0 for t in gemma3_layer_types(s)]


def _gemma3_scalars(s: Settings, _context: int) -> str | None:
    scalar = s.get("query_pre_attn_scalar")
    if not positive(scalar):
        return f"{show('query_pre_attn_scalar', scalar)}: must be a positive number"
    cap = s.get("final_logit_softcapping")
    if cap is not None and not positive(cap):
        return f"{show('final_logit_softcapping', cap)}: must be a positive number or null"
    return None


def _gemma3_attention_softcap(s: Settings, _context: int) -> str | None:
    # transformers' Gemma 3 stores the field but never applies it (Gemma 2 did): a config that
    # sets it may expect either, so it is refused rather than guessed at.
    cap = s.get("attn_logit_softcapping")
    if cap is None:
        return None
    return (
        f"{show('attn_logit_softcapping', cap)}: soft-capping attention scores is not "
        "implemented (transformers' Gemma 3 ignores the field); only null is served"
    )


def _gemma3_bidirectional(s: Settings, _context: int) -> str | None:
    if not s.get("use_bidirectional_attention"):
        return None
    return "use_bidirectional_attention=True: only causal attention is implemented"


GEMMA3 = Architecture(
    name="Gemma3ForCausalLM",
    family="gemma3",
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    mlp_bias=False,
    qk_norm=True,
    # Gemma3TextConfig's defaults (rope thetas: gemma3_rope_parameters)
    defaults={
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    },
    rules=(
        Rule("hidden_activation", "gelu_pytorch_tanh", _gemma3_activation),
        Rule(
            "rope_parameters / rope_scaling / rope_local_base_freq",
            f"rope_type {', '.join(ROPE_TYPES)}; one set per layer type",
            _gemma3_rope,
        ),
        Rule("partial_rotary_factor", "absent or 1", _gemma3_partial_rotary),
        Rule("quantization_config", "absent (unquantized weights)", quantization_problem),
        Rule(
            "layer_types / sliding_window_pattern",
            "full_attention, sliding_attention (see sliding_window)",
            _gemma3_layer_types,
        ),
        Rule(
            "sliding_window",
            "a positive window in the sliding_attention layers (or no such layer)",
            _gemma3_window,
        ),
        Rule(
            "query_pre_attn_scalar / final_logit_softcapping",
            "any positive number (soft-capping: or null)",
            _gemma3_scalars,
        ),
        Rule("attn_logit_softcapping", "null", _gemma3_attention_softcap),
        Rule("use_bidirectional_attention", "false", _gemma3_bidirectional),
    ),
    windows=_gemma3_windows,
    gemma=True,
)
