"""What an architecture entry is (``Architecture``, its ``Rule``s, ``Experts``), and the rules
and helpers several families share. No paddle."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Settings = Mapping[str, Any]  # config.json over the architecture's defaults
# (settings, the longest sequence the model will be served at) -> why not, or None
Problem = Callable[[Settings, int], "str | None"]
# settings (its rules passed) -> each layer's sliding window, 0 for full attention
Windows = Callable[[Settings], list[int]]

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Rule:
    """One field (or a setting spread over a few) and the values of it Ketch implements."""

    field: str
    supported: str  # in words, for docs/models.md
    problem: Problem


@dataclass(frozen=True)
class Experts:
    """A model's routed-expert settings, as its config class reads them from config.json."""

    count: int
    top_k: int
    intermediate_size: int
    layers: tuple[int, ...]  # the layers whose MLP is the routed experts
    norm_topk_prob: bool = False  # Qwen3-MoE: renormalise the top-k weights
    # ERNIE 4.5: the top-k is chosen on the probabilities plus the router's per-expert
    # ``e_score_correction_bias``, the weights are the un-biased probabilities renormalised over
    # the top-k (their sum clamped to at least ``norm_min``), and a dense MLP of
    # ``shared_intermediate_size`` (the shared experts) is added to every token's routed output.
    score_bias: bool = False
    norm_min: float = 0.0
    shared_intermediate_size: int = 0


@dataclass(frozen=True)
class Architecture:
    """What sets one architecture's decoder apart. A bias is ``True``/``False``, or the name of
    the config field that says (read after ``defaults``)."""

    name: str
    family: str
    qkv_bias: bool | str
    o_bias: bool | str
    mlp_bias: bool | str
    qk_norm: bool  # RMSNorm of each query and key head (own weights) before the rotation
    defaults: Mapping[str, Any]
    rules: tuple[Rule, ...]
    windows: Windows = lambda _s: []  # each layer's window; by default none slides
    # Routed experts: how config.json's fields (the rules have checked them) say which layers
    # have them and how they route; None for a dense architecture.
    experts: Callable[[Settings], Experts | None] | None = None
    # RoPE rotates the pairs (2i, 2i + 1) of each head (ERNIE 4.5, GLM) where Llama rotates
    # (i, i + D/2): the loader reorders the q/k projections' rows (``loader.deinterleave``).
    rope_interleaved: bool = False
    lm_head_bias: bool | str = False  # ERNIE 4.5 MoE: the lm_head is biased with ``use_bias``
    gemma: bool = False  # Gemma 3's decoder layer and RoPE per layer kind (``GemmaConfig``)
    # Multi-token-prediction layers the checkpoint carries (speculative ``method: mtp``): how
    # config.json says (how many, whether the block's MLP is routed experts); None: never any.
    mtp: Callable[[Settings], tuple[int, bool]] | None = None

    def settings(self, raw: Mapping[str, Any]) -> Settings:
        """config.json with the config class's defaults under it (an explicit null stays)."""
        return {**self.defaults, **raw}

    def flag(self, which: bool | str, settings: Settings) -> bool:
        return which if isinstance(which, bool) else bool(settings.get(which))

    def problems(self, settings: Settings, context_len: int) -> list[str]:
        """Why Ketch would not compute what transformers does ([] when it would)."""
        found = (rule.problem(settings, context_len) for rule in self.rules)
        return [p for p in found if p is not None]


def show(field: str, value: Any) -> str:
    shown = repr(value)
    return f"{field}={shown if len(shown) <= 200 else shown[:200] + '...'}"


def string_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def hidden_act_problem(s: Settings, _context: int) -> str | None:
    act = s.get("hidden_act", "silu")
    if act in ("silu", "swish"):
        return None
    return f"{show('hidden_act', act)}: only silu (swish) is implemented"


def rope_field(s: Settings) -> tuple[str, Any]:
    """Where the RoPE parameters are: ``rope_parameters`` (transformers 5), else ``rope_scaling``
    (transformers 4, with ``rope_theta`` beside it)."""
    key = "rope_parameters" if s.get("rope_parameters") else "rope_scaling"
    return key, s.get(key) or {}


def rope_problem(s: Settings, _context: int) -> str | None:
    key, params = rope_field(s)
    if not isinstance(params, Mapping):
        return f"{show(key, params)}: expected an object"
    if any(isinstance(v, Mapping) for v in params.values()):
        return f"{show(key, params)}: RoPE parameters per layer type are not implemented"
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        return (
            f"{key}.rope_type={rope_type!r}: this RoPE scaling is not implemented; Ketch "
            f"implements {', '.join(ROPE_TYPES)}"
        )
    theta = params.get("rope_theta", s.get("rope_theta", 10000.0))
    if not positive(theta):
        return f"{show('rope_theta', theta)}: must be a positive number"
    if rope_type != "default" and not positive(params.get("factor", 1.0)):
        return f"{key}.factor={params.get('factor')!r}: must be a positive number"
    return None


def partial_rotary_problem(s: Settings, _context: int) -> str | None:
    _key, params = rope_field(s)
    factor = s.get("partial_rotary_factor")
    if isinstance(params, Mapping) and factor is None:
        factor = params.get("partial_rotary_factor")
    if factor is None or factor == 1:
        return None
    shown = show("partial_rotary_factor", factor)
    return f"{shown}: rotating part of each head is not implemented"


def quantization_problem(s: Settings, _context: int) -> str | None:
    config = s.get("quantization_config")
    if not config:
        return None
    method = config.get("quant_method") if isinstance(config, Mapping) else config
    return (
        f"quantization_config (quant_method={method!r}): quantized checkpoints are not "
        "implemented; Ketch loads float32, bfloat16 or float16 weights"
    )


def window_value(field: str, window: Any, where: str = "") -> str | None:
    """A window must be a positive number of tokens (null: none)."""
    if window is None or (count(window) and window > 0):
        return None
    return f"{show(field, window)}{where}: expected a positive integer or null"


def declared_window(s: Settings, context_len: int) -> str | None:
    # transformers' Llama ignores a window, but a config that declares one was likely trained
    # with it: refused rather than guessed at, unless it never slides (full attention is exact).
    window = s.get("sliding_window")
    if s.get("use_sliding_window") is False or window is None:
        return None
    if window_value("sliding_window", window) or window < context_len:
        return (
            f"{show('sliding_window', window)}: transformers' LlamaForCausalLM ignores a "
            "sliding window, and a config that declares one shorter than the context the model "
            f"would be served at ({context_len} tokens) was likely trained with it; Ketch "
            "refuses it rather than guess (MistralForCausalLM and Qwen2ForCausalLM apply one)"
        )
    return None


def declared_layer_types(s: Settings, _context: int) -> str | None:
    # Ignored by transformers' Llama, Mistral and Qwen3-MoE; refused for the reason above.
    given = s.get("layer_types")
    if given is None:
        return None
    if not string_list(given):
        return f"{show('layer_types', given)}: expected a list of layer kinds (strings)"
    other = sorted(set(given) - {"full_attention"})
    if not other:
        return None
    return f"layer_types: {', '.join(map(repr, other))} layers are not implemented"


def ranges(indices: list[int]) -> str:
    contiguous = indices == list(range(indices[0], indices[-1] + 1))
    return f"{indices[0]}-{indices[-1]}" if contiguous else str(indices)


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


COMMON = (
    Rule("hidden_act", "silu (swish)", hidden_act_problem),
    Rule(
        "rope_parameters / rope_scaling",
        f"rope_type {', '.join(ROPE_TYPES)}; one set for every layer",
        rope_problem,
    ),
    Rule("partial_rotary_factor", "absent or 1", partial_rotary_problem),
    Rule("quantization_config", "absent (unquantized weights)", quantization_problem),
)
DECLARED_FULL_ATTENTION = (
    Rule("layer_types", "absent, or full_attention only", declared_layer_types),
    Rule(
        "sliding_window",
        "absent or null (or use_sliding_window false), or at least the served context",
        declared_window,
    ),
)
