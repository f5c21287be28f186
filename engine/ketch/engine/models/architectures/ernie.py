"""ERNIE 4.5 and ERNIE 4.5 MoE (interleaved RoPE, a biased router, shared experts)."""

from __future__ import annotations

from typing import Any

from ketch.engine.models.architectures.rules import (
    COMMON,
    DECLARED_FULL_ATTENTION,
    Architecture,
    Experts,
    Rule,
    Settings,
    count,
    show,
)

_ERNIE_DEFAULTS = {
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,  # the config classes' default_theta
    "tie_word_embeddings": True,
    "use_bias": False,
}

ERNIE4_5 = Architecture(
    name="Ernie4_5ForCausalLM",
    family="ernie4_5",
    qkv_bias="use_bias",
    o_bias="use_bias",
    mlp_bias="use_bias",
    qk_norm=False,
    # Ernie4_5Config's defaults (ERNIE-4.5-0.3B's sizes)
    defaults={
        **_ERNIE_DEFAULTS,
        "vocab_size": 103424,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 18,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 128,
    },
    rules=(*COMMON, *DECLARED_FULL_ATTENTION),
    rope_interleaved=True,
)


def _alias(s: Settings, field: str, alias: str) -> Any:
    """Ernie4_5_MoeConfig's ``attribute_map``: ``num_experts`` sets ``moe_num_experts``, etc."""
    return s[alias] if alias in s else s.get(field)


def ernie_moe_layers(s: Settings) -> list[int]:
    """The layers with routed experts, as Ernie4_5_MoeDecoderLayer decides: ``(i + 1) %
    moe_layer_interval == 0`` and ``moe_layer_start_index <= i <= moe_layer_end_index``, an end
    of -1 meaning the last layer (Ernie4_5_MoeConfig resolves it so; other values are taken as
    written)."""
    layers = int(s.get("num_hidden_layers") or 0)
    start, end = s.get("moe_layer_start_index"), s.get("moe_layer_end_index")
    end = layers - 1 if end == -1 else end
    step = s.get("moe_layer_interval")
    return [i for i in range(layers) if (i + 1) % step == 0 and start <= i <= end]


def ernie_mtp(s: Settings) -> tuple[int, bool]:
    """(MTP layers, whether the MTP block has routed experts), as transformers builds them
    (``PreTrainedConfig.get_mtp_config``, ``MtpModel``): ``num_nextn_predict_layers`` (alias
    ``num_mtp_layers``) layers, each an ``Ernie4_5_MoeDecoderLayer`` with layer index 0 under
    the model's own expert-layer rule (``moe_layer_end_index`` resolved against the model's
    layer count), so with the Hub's ``moe_layer_start_index`` 1 the block is dense."""
    layers = s.get("num_nextn_predict_layers", s.get("num_mtp_layers")) or 0
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
        layers = 0  # the rule below names it
    if not layers:
        return 0, False
    start, end = s.get("moe_layer_start_index"), s.get("moe_layer_end_index")
    end = int(s.get("num_hidden_layers") or 0) - 1 if end == -1 else end
    step = s.get("moe_layer_interval")
    return layers, 1 % step == 0 and start <= 0 <= end


def _ernie_mtp_count(s: Settings, _context: int) -> str | None:
    for field in ("num_nextn_predict_layers", "num_mtp_layers"):
        value = s.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return f"{show(field, value)}: expected a non-negative integer"
        if isinstance(value, int) and not 0 <= value <= 1:
            return f"{show(field, value)}: ERNIE 4.5 MoE has at most one MTP layer"
    return None


def _ernie_moe_sizes(s: Settings, _context: int) -> str | None:
    experts = _alias(s, "moe_num_experts", "num_experts")
    top_k = _alias(s, "moe_k", "num_experts_per_tok")
    if not count(experts) or not experts:
        return f"{show('moe_num_experts', experts)}: expected a positive integer"
    if not count(top_k) or not 1 <= top_k <= experts:
        return f"{show('moe_k', top_k)}: expected 1 to moe_num_experts ({experts})"
    size, shared = s.get("moe_intermediate_size"), s.get("moe_num_shared_experts")
    if not count(size) or not size:
        return f"{show('moe_intermediate_size', size)}: expected a positive integer"
    if not count(shared):
        return f"{show('moe_num_shared_experts', shared)}: expected a non-negative integer"
    norm_min = s.get("moe_norm_min")
    if not isinstance(norm_min, int | float) or isinstance(norm_min, bool) or norm_min < 0:
        return f"{show('moe_norm_min', norm_min)}: expected a non-negative number"
    return None


def _ernie_moe_layer_choice(s: Settings, _context: int) -> str | None:
    step = s.get("moe_layer_interval")
    if not count(step) or not step:
        return f"{show('moe_layer_interval', step)}: expected a positive integer"
    for field in ("moe_layer_start_index", "moe_layer_end_index"):
        value = s.get(field)
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{show(field, value)}: expected an integer"
    return None


def _ernie_moe_experts(s: Settings) -> Experts | None:
    layers = tuple(ernie_moe_layers(s))
    if not layers:
        return None
    inter = int(s["moe_intermediate_size"])
    return Experts(
        count=int(_alias(s, "moe_num_experts", "num_experts")),
        top_k=int(_alias(s, "moe_k", "num_experts_per_tok")),
        intermediate_size=inter,
        layers=layers,
        score_bias=True,
        norm_min=float(s["moe_norm_min"]),
        shared_intermediate_size=inter * int(s["moe_num_shared_experts"]),
    )


ERNIE4_5_MOE = Architecture(
    name="Ernie4_5_MoeForCausalLM",
    family="ernie4_5_moe",
    qkv_bias="use_bias",
    o_bias="use_bias",
    mlp_bias="use_bias",  # the dense layers' MLP and the shared experts; routed experts: none
    qk_norm=False,
    # Ernie4_5_MoeConfig's defaults (ERNIE-4.5-21B-A3B's sizes); it has no head_dim default
    # (hidden / heads).
    defaults={
        **_ERNIE_DEFAULTS,
        "vocab_size": 103424,
        "hidden_size": 2560,
        "intermediate_size": 12288,
        "num_hidden_layers": 28,
        "num_attention_heads": 20,
        "num_key_value_heads": 4,
        "moe_intermediate_size": 1536,
        "moe_k": 6,
        "moe_num_experts": 64,
        "moe_num_shared_experts": 2,
        "moe_layer_start_index": 1,
        "moe_layer_end_index": -1,
        "moe_layer_interval": 1,
        "moe_norm_min": 1e-12,
    },
    rules=(
        *COMMON,
        Rule(
            "moe_num_experts / moe_k / moe_intermediate_size / moe_num_shared_experts / "
            "moe_norm_min",
            "any sizes (at least one expert; 0 shared experts: none); moe_k at most "
            "moe_num_experts",
            _ernie_moe_sizes,
        ),
        Rule(
            "moe_layer_start_index / moe_layer_end_index / moe_layer_interval",
            "any (they choose the expert layers as transformers does)",
            _ernie_moe_layer_choice,
        ),
        Rule(
            "num_nextn_predict_layers / num_mtp_layers",
            "0 or 1 (the multi-token-prediction layer speculative method 'mtp' drafts with)",
            _ernie_mtp_count,
        ),
        *DECLARED_FULL_ATTENTION,
    ),
    experts=_ernie_moe_experts,
    mtp=ernie_mtp,
    rope_interleaved=True,
    lm_head_bias="use_bias",
)
