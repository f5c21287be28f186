"""The architectures Ketch serves, and for each the ``config.json`` fields it checks at load.

One table. An architecture's entry says which weights its decoder layers have (biases, per-head
q/k norms), the defaults its Hugging Face config class gives fields that ``config.json`` may
leave out, each layer's sliding window as its modeling code applies it (``windows``), and the
rules for the fields whose values Ketch implements only in part. A value that would make the
model compute something other than transformers does is refused at load, in an error naming the
field: never served silently different. Fields transformers' modeling code ignores for an
architecture (e.g. ``attention_bias`` for Mistral) are ignored here too, except attention that
is not full (a sliding window, other ``layer_types``): a config that declares it was likely
trained with it, so it is refused where transformers would ignore it (a window on Llama,
``layer_types`` on Llama, Mistral and Qwen3-MoE).

``SUPPORTED_ARCHITECTURES`` is the one list of what Ketch serves (the CLI's errors, the operator
and docs/models.md follow it). This module imports nothing heavy: no paddle.
"""

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

    def settings(self, raw: Mapping[str, Any]) -> Settings:
        """config.json with the config class's defaults under it (an explicit null stays)."""
        return {**self.defaults, **raw}

    def flag(self, which: bool | str, settings: Settings) -> bool:
        return which if isinstance(which, bool) else bool(settings.get(which))

    def problems(self, settings: Settings, context_len: int) -> list[str]:
        """Why Ketch would not compute what transformers does ([] when it would)."""
        found = (rule.problem(settings, context_len) for rule in self.rules)
        return [p for p in found if p is not None]


def _show(field: str, value: Any) -> str:
    return f"{field}={value!r}"


def _hidden_act(s: Settings, _context: int) -> str | None:
    act = s.get("hidden_act", "silu")
    if act in ("silu", "swish"):
        return None
    return f"{_show('hidden_act', act)}: only silu (swish) is implemented"


def rope_field(s: Settings) -> tuple[str, Any]:
    """Where the RoPE parameters are: ``rope_parameters`` (transformers 5), else ``rope_scaling``
    (transformers 4, with ``rope_theta`` beside it)."""
    key = "rope_parameters" if s.get("rope_parameters") else "rope_scaling"
    return key, s.get(key) or {}


def _rope(s: Settings, _context: int) -> str | None:
    key, params = rope_field(s)
    if not isinstance(params, Mapping):
        return f"{_show(key, params)}: expected an object"
    if any(isinstance(v, Mapping) for v in params.values()):
        return f"{_show(key, params)}: RoPE parameters per layer type are not implemented"
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        return (
            f"{key}.rope_type={rope_type!r}: this RoPE scaling is not implemented; Ketch "
            f"implements {', '.join(ROPE_TYPES)}"
        )
    theta = params.get("rope_theta", s.get("rope_theta", 10000.0))
    if not _positive(theta):
        return f"{_show('rope_theta', theta)}: must be a positive number"
    if rope_type != "default" and not _positive(params.get("factor", 1.0)):
        return f"{key}.factor={params.get('factor')!r}: must be a positive number"
    return None


def _partial_rotary(s: Settings, _context: int) -> str | None:
    _key, params = rope_field(s)
    factor = s.get("partial_rotary_factor")
    if isinstance(params, Mapping) and factor is None:
        factor = params.get("partial_rotary_factor")
    if factor is None or factor == 1:
        return None
    shown = _show("partial_rotary_factor", factor)
    return f"{shown}: rotating part of each head is not implemented"


def _quantization(s: Settings, _context: int) -> str | None:
    config = s.get("quantization_config")
    if not config:
        return None
    method = config.get("quant_method") if isinstance(config, Mapping) else config
    return (
        f"quantization_config (quant_method={method!r}): quantized checkpoints are not "
        "implemented; Ketch loads float32, bfloat16 or float16 weights"
    )


def _window_value(field: str, window: Any, where: str = "") -> str | None:
    """A window must be a positive number of tokens (null: none)."""
    if window is None or (_count(window) and window > 0):
        return None
    return f"{_show(field, window)}{where}: expected a positive integer or null"


def _declared_window(s: Settings, context_len: int) -> str | None:
    # transformers' Llama ignores a window, but a config that declares one was likely trained
    # with it: refused rather than guessed at, unless it never slides (full attention is exact).
    window = s.get("sliding_window")
    if s.get("use_sliding_window") is False or window is None:
        return None
    if _window_value("sliding_window", window) or window < context_len:
        return (
            f"{_show('sliding_window', window)}: transformers' LlamaForCausalLM ignores a "
            "sliding window, and a config that declares one shorter than the context the model "
            f"would be served at ({context_len} tokens) was likely trained with it; Ketch "
            "refuses it rather than guess (MistralForCausalLM and Qwen2ForCausalLM apply one)"
        )
    return None


def _declared_layer_types(s: Settings, _context: int) -> str | None:
    # Ignored by transformers' Llama, Mistral and Qwen3-MoE; refused for the reason above.
    given = s.get("layer_types")
    if given is None:
        return None
    if not isinstance(given, list):
        return f"{_show('layer_types', given)}: expected a list"
    other = sorted(set(given) - {"full_attention"})
    if not other:
        return None
    return f"layer_types: {', '.join(map(repr, other))} layers are not implemented"


def _mistral_window(s: Settings, _context: int) -> str | None:
    return _window_value("sliding_window", s.get("sliding_window"))


def _mistral_windows(s: Settings) -> list[int]:
    # MistralAttention applies config.sliding_window to every layer; layer_types is ignored.
    return [s.get("sliding_window") or 0] * int(s["num_hidden_layers"])


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
    if given is not None and not isinstance(given, list):
        return f"{_show('layer_types', given)}: expected a list"
    layers = s.get("num_hidden_layers")
    if given is not None and len(given) != layers:
        return f"layer_types: {len(given)} entries for {layers} layers (num_hidden_layers)"
    first = s.get("max_window_layers", 28)
    if given is None and not _count(first):
        return f"{_show('max_window_layers', first)}: expected a non-negative integer"
    other = sorted(set(qwen_layer_types(s)) - {"full_attention", "sliding_attention"})
    if not other:
        return None
    return f"layer_types: {', '.join(map(repr, other))} layers are not implemented"


def _qwen_window(s: Settings, _context: int) -> str | None:
    # The attention slides only in the layers whose type is sliding_attention; with no window
    # there, transformers cannot build their mask (it raises), so neither is it served.
    problem = _window_value("sliding_window", qwen_window(s), " (use_sliding_window=true)")
    if problem is not None or _qwen_layer_types(s, _context) is not None:
        return problem  # a malformed layer_types or max_window_layers: named by its own rule
    sliding = [i for i, t in enumerate(qwen_layer_types(s)) if t == "sliding_attention"]
    if not sliding or qwen_window(s) is not None:
        return None
    why = "use_sliding_window is false" if s.get("sliding_window") else "sliding_window is null"
    return (
        f"layer_types: sliding_attention layers {_ranges(sliding)} without a window ({why}); "
        "transformers cannot build their mask"
    )


def _qwen_windows(s: Settings) -> list[int]:
    window = qwen_window(s) or 0
    return [window if t == "sliding_attention" else 0 for t in qwen_layer_types(s)]


def _ranges(indices: list[int]) -> str:
    contiguous = indices == list(range(indices[0], indices[-1] + 1))
    return f"{indices[0]}-{indices[-1]}" if contiguous else str(indices)


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


_COMMON = (
    Rule("hidden_act", "silu (swish)", _hidden_act),
    Rule(
        "rope_parameters / rope_scaling",
        f"rope_type {', '.join(ROPE_TYPES)}; one set for every layer",
        _rope,
    ),
    Rule("partial_rotary_factor", "absent or 1", _partial_rotary),
    Rule("quantization_config", "absent (unquantized weights)", _quantization),
)
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
_DECLARED_FULL_ATTENTION = (
    Rule("layer_types", "absent, or full_attention only", _declared_layer_types),
    Rule(
        "sliding_window",
        "absent or null (or use_sliding_window false), or at least the served context",
        _declared_window,
    ),
)
_QWEN_DEFAULTS = {
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}

LLAMA = Architecture(
    name="LlamaForCausalLM",
    family="llama",
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    mlp_bias="mlp_bias",
    qk_norm=False,
    defaults={"max_position_embeddings": 2048},
    rules=(
        *_COMMON,
        *_DECLARED_FULL_ATTENTION,
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
        *_COMMON,
        Rule("layer_types", "absent, or full_attention only", _declared_layer_types),
        Rule("sliding_window", "a positive window in every layer, or null", _mistral_window),
    ),
    windows=_mistral_windows,
)
QWEN2 = Architecture(
    name="Qwen2ForCausalLM",
    family="qwen2",
    qkv_bias=True,
    o_bias=False,
    mlp_bias=False,
    qk_norm=False,
    defaults=_QWEN_DEFAULTS,
    rules=(*_COMMON, *_QWEN_WINDOWS),
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
    rules=(*_COMMON, *_QWEN_WINDOWS),
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


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _moe_sizes(s: Settings, _context: int) -> str | None:
    experts, top_k = num_experts(s), s.get("num_experts_per_tok")
    if not _count(experts):
        return f"{_show('num_experts', experts)}: expected a non-negative integer"
    if not experts:
        return None  # every layer dense, as transformers builds it
    if not _count(top_k) or not 1 <= top_k <= experts:
        return f"{_show('num_experts_per_tok', top_k)}: expected 1 to num_experts ({experts})"
    size = s.get("moe_intermediate_size")
    if not _count(size) or not size:
        return f"{_show('moe_intermediate_size', size)}: expected a positive integer"
    return None


def _moe_layer_choice(s: Settings, _context: int) -> str | None:
    step = s.get("decoder_sparse_step", 1)
    if not _count(step) or not step:
        return f"{_show('decoder_sparse_step', step)}: expected a positive integer"
    dense = s.get("mlp_only_layers")
    if dense is not None and (not isinstance(dense, list) or not all(_count(i) for i in dense)):
        return f"{_show('mlp_only_layers', dense)}: expected a list of layer indices"
    return None


def _moe_window(s: Settings, _context: int) -> str | None:
    where = " (use_sliding_window=true: every layer)"
    return _window_value("sliding_window", qwen_window(s), where)


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
        *_COMMON,
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
        Rule("layer_types", "absent, or full_attention only", _declared_layer_types),
        Rule(
            "sliding_window",
            "a positive window in every layer (use_sliding_window true), or inactive",
            _moe_window,
        ),
    ),
    windows=_moe_windows,
    experts=_qwen3_moe_experts,
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
    rules=(*_COMMON, *_DECLARED_FULL_ATTENTION),
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


def _ernie_moe_sizes(s: Settings, _context: int) -> str | None:
    experts = _alias(s, "moe_num_experts", "num_experts")
    top_k = _alias(s, "moe_k", "num_experts_per_tok")
    if not _count(experts) or not experts:
        return f"{_show('moe_num_experts', experts)}: expected a positive integer"
    if not _count(top_k) or not 1 <= top_k <= experts:
        return f"{_show('moe_k', top_k)}: expected 1 to moe_num_experts ({experts})"
    size, shared = s.get("moe_intermediate_size"), s.get("moe_num_shared_experts")
    if not _count(size) or not size:
        return f"{_show('moe_intermediate_size', size)}: expected a positive integer"
    if not _count(shared):
        return f"{_show('moe_num_shared_experts', shared)}: expected a non-negative integer"
    norm_min = s.get("moe_norm_min")
    if not isinstance(norm_min, int | float) or isinstance(norm_min, bool) or norm_min < 0:
        return f"{_show('moe_norm_min', norm_min)}: expected a non-negative number"
    return None


def _ernie_moe_layer_choice(s: Settings, _context: int) -> str | None:
    step = s.get("moe_layer_interval")
    if not _count(step) or not step:
        return f"{_show('moe_layer_interval', step)}: expected a positive integer"
    for field in ("moe_layer_start_index", "moe_layer_end_index"):
        value = s.get(field)
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{_show(field, value)}: expected an integer"
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
        *_COMMON,
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
        *_DECLARED_FULL_ATTENTION,
    ),
    experts=_ernie_moe_experts,
    rope_interleaved=True,
    lm_head_bias="use_bias",
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
    return f"{_show('hidden_activation', act)}: only gelu_pytorch_tanh is implemented"


def _gemma3_rope(s: Settings, context: int) -> str | None:
    given = s.get("rope_parameters")
    if given and (
        not isinstance(given, Mapping)
        or set(given) - set(GEMMA3_LAYER_TYPES)
        or not all(isinstance(p, Mapping) for p in given.values())
    ):
        # transformers' Gemma 3 ignores a flat set (it keeps its default thetas): not guessed at.
        return (
            f"{_show('rope_parameters', given)}: expected one object per layer type "
            f"({', '.join(GEMMA3_LAYER_TYPES)})"
        )
    scaling = s.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, Mapping):
        return f"{_show('rope_scaling', scaling)}: expected an object"
    for layer_type, params in gemma3_rope_parameters(s).items():
        declared = params.get("type")
        if declared is not None and declared != params.get("rope_type"):
            # Gemma3TextConfig merges rope_scaling over {"rope_type": "default"}, so a legacy
            # "type" is ignored by transformers: not guessed at either way.
            return (
                f"{layer_type} layers: type={declared!r} beside rope_type="
                f"{params.get('rope_type')!r}: write the scaling as rope_type"
            )
        problem = _rope({"rope_parameters": params}, context)
        if problem is not None:
            return f"{layer_type} layers: {problem}"
    return None


def _gemma3_partial_rotary(s: Settings, _context: int) -> str | None:
    for params in (s, *gemma3_rope_parameters(s).values()):
        factor = params.get("partial_rotary_factor")
        if factor not in (None, 1):
            shown = _show("partial_rotary_factor", factor)
            return f"{shown}: rotating part of each head is not implemented"
    return None


def _gemma3_layer_types(s: Settings, _context: int) -> str | None:
    given = s.get("layer_types")
    if given is not None and not isinstance(given, list):
        return f"{_show('layer_types', given)}: expected a list"
    pattern = s.get("sliding_window_pattern", 6)
    if given is None and (not _count(pattern) or not pattern):
        return f"{_show('sliding_window_pattern', pattern)}: expected a positive integer"
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
    where = f" (sliding_attention layers {_ranges(sliding)})"
    if s.get("sliding_window") is None:  # transformers cannot build their mask
        return f"sliding_window=None{where}: expected a positive integer"
    return _window_value("sliding_window", s.get("sliding_window"), where)


def _gemma3_windows(s: Settings) -> list[int]:
    window = s.get("sliding_window") or 0
    return [window if t == "sliding_attention" else 0 for t in gemma3_layer_types(s)]


def _gemma3_scalars(s: Settings, _context: int) -> str | None:
    scalar = s.get("query_pre_attn_scalar")
    if not _positive(scalar):
        return f"{_show('query_pre_attn_scalar', scalar)}: must be a positive number"
    cap = s.get("final_logit_softcapping")
    if cap is not None and not _positive(cap):
        return f"{_show('final_logit_softcapping', cap)}: must be a positive number or null"
    return None


def _gemma3_attention_softcap(s: Settings, _context: int) -> str | None:
    # transformers' Gemma 3 stores the field but never applies it (Gemma 2 did): a config that
    # sets it may expect either, so it is refused rather than guessed at.
    cap = s.get("attn_logit_softcapping")
    if cap is None:
        return None
    return (
        f"{_show('attn_logit_softcapping', cap)}: soft-capping attention scores is not "
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
        Rule("quantization_config", "absent (unquantized weights)", _quantization),
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

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a for a in (LLAMA, MISTRAL, QWEN2, QWEN3, QWEN3_MOE, ERNIE4_5, ERNIE4_5_MOE, GEMMA3)
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)
