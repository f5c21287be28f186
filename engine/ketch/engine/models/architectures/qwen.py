"""Qwen2, Qwen3 and Qwen3-MoE: their sliding-window layers and routed experts."""

from __future__ import annotations

from typing import Any

from ketch.engine.models.architectures.rules import (
    COMMON,
    Architecture,
    Experts,
    Rule,
    Settings,
    count,
    declared_layer_types,
    ranges,
    show,
    string_list,
    window_value,
)


def qwen_layer_types(s: Settings) -> list[str]:
    """Each layer's attention as Qwen2/Qwen3's config computes it: ``layer_types`` when given,
    else sliding from layer ``max_window_layers`` on when there is a window (``qwen_window``)."""
    given = s.get("layer_types")
    if given is not None:
        return list(given)
    windowed = qwen_window(s) is not None
    first = s.get("max_window_layers", 28)
    return [
        "sliding_attention" if windowed and i >= first else "full_attention"
        for i in range(int(s.get("num_hidden_layers") or 0))
    ]


def qwen_window(s: Settings) -> Any:
    """Qwen2Config/Qwen3Config (and Qwen3MoeConfig) drop the window unless use_sliding_window."""
    return s.get("sliding_window") if s.get("use_sliding_window") else None


def _qwen_layer_types(s: Settings, _context: int) -> str | None:
    given = s.get("layer_types")
    if given is not None and not string_list(given):
        return f"{show('layer_types', given)}: expected a list of layer kinds (strings)"
    layers = s.get("num_hidden_layers")
    if given is not None and len(given) != layers:
        return f"layer_types: {len(given)} entries for {layers} layers (num_hidden_layers)"
    first = s.get("max_window_layers", 28)
    if given is None and not count(first):
        return f"{show('max_window_layers', first)}: expected a non-negative integer"
    other = sorted(set(qwen_layer_types(s)) - {"full_attention", "sliding_attention"})
    if not other:
        return None
    return f"layer_types: {', '.join(map(repr, other))} layers are not implemented"


def _qwen_window(s: Settings, _context: int) -> str | None:
    # The attention slides only in the layers whose type is sliding_attention; with no window
    # there, transformers cannot build their mask (it raises), so neither is it served.
    problem = window_value("sliding_window", qwen_window(s), " (use_sliding_window=true)")
    if problem is not None or _qwen_layer_types(s, _context) is not None:
        return problem  # a malformed layer_types or max_window_layers: named by its own rule
    sliding = [i for i, t in enumerate(qwen_layer_types(s)) if t == "sliding_attention"]
    if not sliding or qwen_window(s) is not None:
        return None
    why = "use_sliding_window is false" if s.get("sliding_window") else "sliding_window is null"
    return (
        f"layer_types: sliding_attention layers {ranges(sliding)} without a window ({why}); "
        "transformers cannot build their mask"
    )


def _qwen_windows(s: Settings) -> list[int]:
    window = qwen_window(s) or 0
    return [window if t == "sliding_attention" else 0 for t in qwen_layer_types(s)]


_QWEN_WINDOWS = (
    Rule(
        "layer_types",
        "full_attention, sliding_attention (see sliding_window)",
        _qwen_layer_types,
    ),
    Rule(
        "sliding_window",
        "a positive window in the sliding_attention layers (use_sliding_window true), or inactive",
        _qwen_window,
    ),
)
_QWEN_DEFAULTS = {
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}


QWEN2 = Architecture(
    name="Qwen2ForCausalLM",
    family="qwen2",
    qkv_bias=True,
    o_bias=False,
    mlp_bias=False,
    qk_norm=False,
    defaults=_QWEN_DEFAULTS,
    rules=(*COMMON, *_QWEN_WINDOWS),
    windows=_qwen_windows,
)
QWEN3 = Architecture(
    name="Qwen3ForCausalLM",
    family="qwen3",
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    mlp_bias=False,
    qk_norm=True,
    defaults={**_QWEN_DEFAULTS, "head_dim": 128},
    rules=(*COMMON, *_QWEN_WINDOWS),
    windows=_qwen_windows,
)


def num_experts(s: Settings) -> Any:
    """transformers 5 writes ``num_local_experts`` (Qwen3MoeConfig maps ``num_experts`` to it);
    earlier configs (and the Qwen3-MoE checkpoints on the Hub) write ``num_experts``."""
    return s["num_local_experts"] if "num_local_experts" in s else s.get("num_experts")


def moe_layers(s: Settings) -> list[int]:
    """The layers whose MLP is the routed experts, as Qwen3MoeDecoderLayer decides: not in
    ``mlp_only_layers``, and ``(i + 1) % decoder_sparse_step == 0``; none without experts."""
    if not num_experts(s):
        return []
    dense = set(s.get("mlp_only_layers") or ())
    step = s.get("decoder_sparse_step", 1)
    layers = int(s.get("num_hidden_layers") or 0)
    return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]


def _qwen3_moe_experts(s: Settings) -> Experts | None:
    layers = tuple(moe_layers(s))
    if not layers:
        return None
    return Experts(
        count=int(num_experts(s)),
        top_k=int(s["num_experts_per_tok"]),
        intermediate_size=int(s["moe_intermediate_size"]),
        layers=layers,
        norm_topk_prob=bool(s.get("norm_topk_prob")),
    )


def _moe_sizes(s: Settings, _context: int) -> str | None:
    experts, top_k = num_experts(s), s.get("num_experts_per_tok")
    if not count(experts):
        return f"{show('num_experts', experts)}: expected a non-negative integer"
    if not experts:
        return None  # every layer dense, as transformers builds it
    if not count(top_k) or not 1 <= top_k <= experts:
        return f"{show('num_experts_per_tok', top_k)}: expected 1 to num_experts ({experts})"
    size = s.get("moe_intermediate_size")
    if not count(size) or not size:
        return f"{show('moe_intermediate_size', size)}: expected a positive integer"
    return None


def _moe_layer_choice(s: Settings, _context: int) -> str | None:
    step = s.get("decoder_sparse_step", 1)
    if not count(step) or not step:
        return f"{show('decoder_sparse_step', step)}: expected a positive integer"
    dense = s.get("mlp_only_layers")
    if dense is not None and (not isinstance(dense, list) or not all(count(i) for i in dense)):
        return f"{show('mlp_only_layers', dense)}: expected a list of layer indices"
    return None


def _moe_window(s: Settings, _context: int) -> str | None:
    where = " (use_sliding_window=true: every layer)"
    return window_value("sliding_window", qwen_window(s), where)


def _moe_windows(s: Settings) -> list[int]:
    # Qwen3MoeAttention slides in every layer (no max_window_layers or layer_types for it).
    return [qwen_window(s) or 0] * int(s["num_hidden_layers"])


QWEN3_MOE = Architecture(
    name="Qwen3MoeForCausalLM",
    family="qwen3_moe",
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    mlp_bias=False,
    qk_norm=True,
    # Qwen3MoeConfig's defaults; it has no head_dim default (hidden_size / heads).
    defaults={
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "intermediate_size": 6144,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_experts": 128,
        "norm_topk_prob": False,
        "mlp_only_layers": [],
    },
    rules=(
        *COMMON,
        Rule(
            "num_experts / num_experts_per_tok / moe_intermediate_size",
            "any sizes (0 experts: every layer dense); top-k at most num_experts",
            _moe_sizes,
        ),
        Rule(
            "decoder_sparse_step / mlp_only_layers",
            "any (they choose the expert layers as transformers does)",
            _moe_layer_choice,
        ),
        Rule("layer_types", "absent, or full_attention only", declared_layer_types),
        Rule(
            "sliding_window",
            "a positive window in every layer (use_sliding_window true), or inactive",
            _moe_window,
        ),
    ),
    windows=_moe_windows,
    experts=_qwen3_moe_experts,
)
