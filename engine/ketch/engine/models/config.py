"""The facts of a Hugging Face checkpoint that the engine needs, read from ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ketch.engine.errors import ModelLoadError
from ketch.engine.models.architectures import (
    ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    Architecture,
    Settings,
    gemma3_layer_types,
    gemma3_rope_parameters,
    rope_field,
)
from ketch.engine.models.paths import read_json_object

__all__ = [
    "MOE_BACKENDS",
    "SUPPORTED_ARCHITECTURES",
    "GemmaConfig",
    "ModelConfig",
    "RopeConfig",
    "moe_refusal",
]


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class GemmaConfig:
    """Where Gemma 3's decoder differs from Llama's beyond its weights
    (``ketch.engine.models.gemma3``). Implied by it: RMSNorm ``x * (1 + w)`` (folded into the
    weights at load), embeddings scaled by sqrt(hidden_size), a GELU-tanh gated MLP, and norms
    of the attention's and the MLP's outputs before each joins the residual."""

    query_pre_attn_scalar: float  # attention scores are scaled by its -1/2 power
    final_logit_softcapping: float | None  # logits -> cap * tanh(logits / cap)
    local_rope: RopeConfig  # the sliding_attention layers' rotation (ModelConfig.rope: the rest)
    local_layers: tuple[int, ...]  # the sliding_attention layers


@dataclass(frozen=True)
class ModelConfig:
    """What the engine computes with: sizes, RoPE, which weights a layer has."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: per-head RMSNorm of queries and keys (weights [head_dim]) before RoPE
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # ERNIE 4.5: RoPE rotates the pairs (2i, 2i + 1); loaded with the q/k rows reordered so
    # the rotate-half rotation computes it (``loader.deinterleave``)
    rope_interleaved: bool = False
    lm_head_bias: bool = False  # ERNIE 4.5 MoE with use_bias
    # Routed experts (``ketch.engine.models.moe``) in the layers ``moe_layers``; the other
    # layers have the dense MLP of ``intermediate_size``. 0 / () for a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # Qwen3-MoE
    moe_layers: tuple[int, ...] = ()
    gemma: GemmaConfig | None = None  # Gemma 3; ``rope`` is then its full_attention layers'
    # Each layer's sliding window (a query at position p sees keys p - w < j <= p), 0 for full
    # attention; () when every layer is full. The architecture computes it (``Architecture``).
    sliding_windows: tuple[int, ...] = ()
    # ERNIE 4.5 MoE (``architectures.Experts``): top-k on probabilities + the router's
    # e_score_correction_bias, weights renormalised with the sum clamped to ``moe_norm_min``;
    # shared experts: a dense MLP of ``shared_intermediate_size`` in each expert layer.
    moe_score_bias: bool = False
    moe_norm_min: float = 0.0
    shared_intermediate_size: int = 0
    # Multi-token-prediction layers in the checkpoint (ERNIE 4.5 MoE's ``mtp_*`` weights,
    # config ``num_nextn_predict_layers``): read only for speculative ``method: mtp``
    # (``ketch.engine.spec_decode.mtp``); whether the MTP block's MLP is routed experts.
    num_mtp_layers: int = 0
    mtp_moe: bool = False

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def attention_scale(self) -> float:
        """What attention scores are scaled by: 1/sqrt(head_dim), or Gemma 3's
        1/sqrt(query_pre_attn_scalar)."""
        scalar = self.head_dim if self.gemma is None else self.gemma.query_pre_attn_scalar
        return scalar**-0.5

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window; 0: full attention."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    @property
    def attention_windows(self) -> tuple[int, ...]:
        """The distinct windows of the layers, ascending (0: full attention), e.g. (0, 4096)."""
        return tuple(sorted(set(self.sliding_windows or (0,))))

    def backend_problem(self, backend: str, gpu: bool = False) -> str | None:
        """Why this model cannot run on ``backend`` (or on a GPU); None when it can. For start-up
        checks (``capabilities.refusals``); ``build_model`` raises the same at load."""
        if self.is_moe and (gpu or backend not in MOE_BACKENDS):
            return moe_refusal(self.architecture, "--device gpu" if gpu else f"--backend {backend}")
        if self.gemma is not None and (gpu or backend not in GEMMA_BACKENDS):
            where = "--device gpu" if gpu else f"--backend {backend}"
            return (
                f"{self.architecture} runs on the eager/native backend only; {where} has no "
                "Gemma 3 decoder layer yet: use --backend native, eager or auto on the CPU"
            )
        if self.sliding_windows and gpu:
            return (
                f"{self.architecture} with sliding_window={max(self.sliding_windows)} runs on the "
                "CPU backends only; --device gpu has no sliding-window attention yet"
            )
        return None

    @property
    def family(self) -> str:
        return ARCHITECTURES[self.architecture].family

    @classmethod
    def from_dir(cls, path: Path, context_len: int | None = None) -> ModelConfig:
        """The checkpoint's config; ``context_len``: the longest sequence it will be served at
        (default ``max_position_embeddings``), against which a window Llama declares (and
        transformers ignores) is checked."""
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(
                f"{path} has no config.json; is it a Hugging Face model directory?"
            )
        raw = read_json_object(config_file)
        generation = path / "generation_config.json"
        gen = read_json_object(generation) if generation.is_file() else {}
        return cls.from_dict(raw, gen, source=str(config_file), context_len=context_len)

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        generation: dict[str, Any] | None = None,
        source: str = "config",
        context_len: int | None = None,
    ) -> ModelConfig:
        """Raises ``ModelLoadError`` naming every field Ketch would not honour
        (``ketch.engine.models.architectures``)."""
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        arch = _architecture(raw, source)
        s = arch.settings(raw)
        heads = _int(s, "num_attention_heads", source)
        hidden = _int(s, "hidden_size", source)
        layers = _int(s, "num_hidden_layers", source)
        max_positions = _int(s, "max_position_embeddings", source)
        problems = arch.problems(s, context_len or max_positions)
        if problems:
            raise ModelLoadError(f"{source}: {arch.name}: " + "; ".join(problems))
        config = cls(
            architecture=arch.name,
            vocab_size=_int(s, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=_int(s, "intermediate_size", source),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=_int(s, "num_key_value_heads", source, default=heads),
            head_dim=_int(s, "head_dim", source, default=hidden // heads),
            max_position_embeddings=max_positions,
            rms_norm_eps=_eps(s, source),
            rope=_gemma_ropes(s)[0] if arch.gemma else _rope(s),
            tie_word_embeddings=bool(s.get("tie_word_embeddings", False)),
            qkv_bias=arch.flag(arch.qkv_bias, s),
            o_bias=arch.flag(arch.o_bias, s),
            mlp_bias=arch.flag(arch.mlp_bias, s),
            qk_norm=arch.qk_norm,
            rope_interleaved=arch.rope_interleaved,
            lm_head_bias=arch.flag(arch.lm_head_bias, s),
            torch_dtype=str(s.get("torch_dtype") or s.get("dtype") or "float32"),
            eos_token_ids=_eos_ids(raw, generation or {}, source),
            bos_token_id=_token_id(raw.get("bos_token_id"), "bos_token_id", source),
            sliding_windows=_windows(arch, s),
            **_moe(arch, s),
            **_mtp(arch, s),
            **(_gemma(s) if arch.gemma else {}),
        )
        config._validate(source)
        return config

    def _validate(self, source: str) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"{source}: head_dim must be even for rotary embeddings")


def _architecture(raw: dict[str, Any], source: str) -> Architecture:
    architectures = raw.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ModelLoadError(f"{source}: architectures must be a list of class names")
    for name in architectures:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    found = ", ".join(architectures) or f"model_type={raw.get('model_type')!r}"
    raise ModelLoadError(f"{source}: unsupported architecture {found}; Ketch supports {supported}")


MOE_BACKENDS = ("auto", "native", "eager")  # where routed experts run (auto: native, else eager)
GEMMA_BACKENDS = MOE_BACKENDS  # where Gemma 3's decoder layer runs


def moe_refusal(architecture: str, where: str) -> str:
    """``where``: the backend as the user chose it (``--backend predictor``, ``--device gpu``)."""
    return (
        f"{architecture} runs on the eager/native backend only; {where} has no routed-expert "
        "(MoE) layers yet: use --backend native, eager or auto on the CPU"
    )


def _moe(arch: Architecture, s: Settings) -> dict[str, Any]:
    """The expert fields (the architecture's rules have checked them); {} for a dense model."""
    experts = arch.experts(s) if arch.experts is not None else None
    if experts is None:
        return {}
    return {
        "num_experts": experts.count,
        "num_experts_per_tok": experts.top_k,
        "moe_intermediate_size": experts.intermediate_size,
        "norm_topk_prob": experts.norm_topk_prob,
        "moe_layers": experts.layers,
        "moe_score_bias": experts.score_bias,
        "moe_norm_min": experts.norm_min,
        "shared_intermediate_size": experts.shared_intermediate_size,
    }


def _mtp(arch: Architecture, s: Settings) -> dict[str, Any]:
    if arch.mtp is None:
        return {}
    layers, moe = arch.mtp(s)
    return {"num_mtp_layers": layers, "mtp_moe": moe} if layers else {}


def _windows(arch: Architecture, s: Settings) -> tuple[int, ...]:
    windows = tuple(int(w) for w in arch.windows(s))
    return windows if any(windows) else ()


# Far above any released model's, and low enough that per-layer (and per-head) work at load
# stays small whatever config.json claims.
_MAXIMA = {
    "num_hidden_layers": 1024,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "head_dim": 4096,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "vocab_size": 1 << 24,
    "max_position_embeddings": 1 << 27,
}


def _int(s: Settings, key: str, source: str, default: int | None = None) -> int:
    value = s.get(key) if default is None or s.get(key) is not None else default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"{source}: {key} must be a positive integer, got {value!r}")
    if value > _MAXIMA.get(key, value):
        raise ModelLoadError(f"{source}: {key}={value} is more than Ketch loads ({_MAXIMA[key]})")
    return value


def _eps(s: Settings, source: str) -> float:
    value = s.get("rms_norm_eps", 1e-6)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise ModelLoadError(f"{source}: rms_norm_eps must be a number in (0, 1), got {value!r}")
    return float(value)


def _token_id(value: Any, key: str, source: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 31:
        raise ModelLoadError(f"{source}: {key} must be a token id, got {value!r}")
    return value


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any], source: str) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (one id or a list) over config.json's."""
    eos = generation.get("eos_token_id", raw.get("eos_token_id"))
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if len(ids) > 64:
        raise ModelLoadError(f"{source}: eos_token_id lists {len(ids)} ids (at most 64)")
    if any(i is None for i in ids):
        raise ModelLoadError(f"{source}: eos_token_id must be token ids, got {eos!r}")
    return tuple(_token_id(i, "eos_token_id", source) for i in ids)


def _gemma(s: Settings) -> dict[str, Any]:
    """Gemma 3's own fields (the architecture's rules have checked them)."""
    types = gemma3_layer_types(s)
    cap = s.get("final_logit_softcapping")
    gemma = GemmaConfig(
        query_pre_attn_scalar=float(s["query_pre_attn_scalar"]),
        final_logit_softcapping=None if cap is None else float(cap),
        local_rope=_gemma_ropes(s)[1],
        local_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
    )
    return {"gemma": gemma}


def _gemma_ropes(s: Settings) -> tuple[RopeConfig, RopeConfig]:
    """(the full_attention layers' rotation, the sliding_attention layers')."""
    sets = gemma3_rope_parameters(s)
    return _rope_of(sets["full_attention"], s), _rope_of(sets["sliding_attention"], s)


def _rope(s: Settings) -> RopeConfig:
    """The rotary embedding (the architecture's rules have checked it). transformers 5 writes
    ``rope_parameters`` (with ``rope_theta`` inside); 4.x wrote ``rope_theta`` and an optional
    ``rope_scaling`` with ``type`` or ``rope_type``."""
    _key, params = rope_field(s)
    return _rope_of(params, s)


def _rope_of(params: Settings, s: Settings) -> RopeConfig:
    theta = params.get("rope_theta", s.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    # transformers 5: a top-level original_max_position_embeddings wins, then the parameters'
    # own, then max_position_embeddings.
    original = s.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings", s["max_position_embeddings"]
    )
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
    )
