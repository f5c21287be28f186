"""Engine configuration: one frozen dataclass, validated without I/O.

Every field carries its user-facing help text in ``metadata["help"]``. That metadata is the
single source of truth for the engine's command-line flags (and, later, the CRD's ``engine``
fields), so a flag and the field it sets can never drift apart.

Metadata keys: ``help`` (flag help and CRD description), ``choices`` (flag choices and CRD enum),
``minimum`` (CRD bound; ``__post_init__`` enforces the same), ``crd`` (the field's path under an
InferenceService's ``spec``; default ``engine.<camelCase name>``; ``False`` when the operator sets
the field itself, e.g. ``model`` comes from ``spec.model.uri``), ``parse`` and ``metavar`` (the
flag's). A field typed as a dataclass (``speculative_config``) is a CRD object of that class's
fields, described and bounded by their own metadata (``help``, ``choices``, ``minimum``,
``maximum``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from ketch.engine.device import parse_device
from ketch.engine.spec_decode.config import SpeculativeConfig

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "KI": 1024,
    "KIB": 1024,
    "M": 1000**2,
    "MB": 1000**2,
    "MI": 1024**2,
    "MIB": 1024**2,
    "G": 1000**3,
    "GB": 1000**3,
    "GI": 1024**3,
    "GIB": 1024**3,
}


def parse_memory_size(value: int | float | str, name: str = "size") -> int:
    """Parses ``"512MiB"``, ``"2Gi"``, ``"1.5GB"`` or a plain number of bytes."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size such as '512MiB' or a number of bytes")
    if isinstance(value, int | float):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
        if not match:
            raise ValueError(f"{name}={value!r} is not a size; use e.g. '512MiB', '2GiB' or bytes")
        number, unit = float(match.group(1)), match.group(2).upper()
    if unit not in _SIZE_UNITS:
        raise ValueError(f"{name}={value!r} has unknown unit {unit!r}; use B, KiB, MiB or GiB")
    size = int(number * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return size


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class EngineConfig:
    """What the engine is asked to do; the model's own facts live in ``ModelConfig``."""

    model: str = _opt(
        "tiny",
        "Model to serve: 'tiny' or 'tiny-copy' (built in) or a Hugging Face checkpoint dir.",
        crd=False,
    )
    max_num_seqs: int = _opt(
        64, "Most requests that run in one step (the batch size limit).", minimum=1
    )
    max_model_len: int | None = _opt(
        None,
        "Longest prompt + output in tokens; defaults to the model's context length.",
        minimum=1,
    )
    max_num_batched_tokens: int = _opt(
        2048,
        "Token budget of one step; longer prompts are prefilled in chunks of this size.",
        minimum=1,
    )
    block_size: int = _opt(64, "Tokens per KV-cache block.", choices=(16, 32, 64, 128))
    kv_cache_memory: str = _opt(
        "1GiB",
        "Memory for the KV cache on CPU, e.g. '512MiB' or '4GiB' (with --device gpu the cache "
        "is sized by --gpu-memory-utilization instead).",
    )
    num_kv_blocks: int | None = _opt(
        None,
        "Exact number of KV-cache blocks; overrides --kv-cache-memory (for testing).",
        minimum=2,
    )
    enable_prefix_caching: bool = _opt(True, "Reuse KV blocks of prompts that share a prefix.")
    tensor_parallel_size: int = _opt(
        1,
        "Tensor-parallel ranks per engine instance: one worker process per rank, each holding "
        "its share of the attention heads and MLP columns (they must divide evenly; KV heads are "
        "replicated when there are fewer than ranks). On the CPU each rank gets (cores - 1) / N "
        "threads unless --num-threads says otherwise. GPU workers (--device gpu:N, rank r on "
        "GPU N + r) are written but have never been run (issue 17).",
        minimum=1,
    )
    device: str = _opt(
        "cpu",
        "Where the model runs: 'cpu', or 'gpu' / 'gpu:N' (GPU N; tensor-parallel rank r on GPU "
        "N + r). The GPU path (bfloat16/float16 compute, flash attention over the paged KV cache "
        "in device memory, NCCL between ranks) is written against paddle's documented GPU APIs "
        "but has NEVER BEEN RUN: no paddle GPU build could be installed where Ketch is built "
        "and tested. On a paddle without CUDA, gpu is refused at start-up (docs/gpu.md).",
        crd=False,  # the operator renders CPU pods only (capabilities: the gpus refusal)
    )
    gpu_memory_utilization: float = _opt(
        0.9,
        "With --device gpu: the fraction of each GPU's free memory (at start-up) the instance "
        "takes for weights, activations and the KV cache; the KV cache gets what the weights "
        "and an activation reserve leave (0 < x <= 1; ignored on the CPU; never run).",
        crd=False,
    )
    dtype: str = _opt(
        "auto",
        "Weight dtype. On the CPU: float32, or bfloat16 (weights stored as bfloat16, half the "
        "bytes, widened to float32 as the GEMM loads them; activations and sums stay float32; "
        "native backend only); auto: bfloat16 for a checkpoint saved in bfloat16, else float32. "
        "float16 is refused on the CPU. With --device gpu (written, never run): auto (bfloat16 on "
        "GPUs of compute capability 8.0+, else float16), bfloat16, float16 or float32.",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    kv_cache_dtype: str = _opt(
        "auto",
        "Element type of the KV cache (and of its host swap tier and P/D transfers: a prefill "
        "and a decode instance must use the same). auto: the weight dtype (--dtype; float32 "
        "under --quantization int8 with float32 weights). bfloat16 halves the cache's bytes "
        "per token on the CPU; keys and values are rounded to bfloat16 as they are written.",
        choices=("auto", "float32", "bfloat16"),
    )
    quantization: str = _opt(
        "none",
        "Weight quantization applied at load. int8: every linear layer's weight (attention, "
        "MLP, experts) as int8 with a float32 scale per output channel (symmetric), dequantized "
        "in the GEMM (float32 activations); the embedding and lm_head stay in --dtype. CPU, "
        "native backend only.",
        choices=("none", "int8"),
    )
    runner: str = _opt(
        "model",
        "What computes tokens: 'model', or 'null' (a fixed token, instantly: for measuring the "
        "serving path without the model).",
        choices=("model", "null"),
    )
    backend: str = _opt(
        "auto",
        "What executes the model: 'native' (dygraph with Ketch's C++ kernels: matmuls through "
        "OpenBLAS, paged attention; built once into ~/.cache/ketch), 'predictor' (dense layers "
        "as static programs on paddle's inference predictor with oneDNN, exported once into "
        "$KETCH_CACHE_DIR, default ~/.cache/ketch), 'eager' (dygraph, the reference), or "
        "'auto': the first of native, predictor, eager that runs here, with one log line for "
        "what it fell back from.",
        choices=("auto", "native", "predictor", "eager"),
        crd=False,
    )
    speculative_config: SpeculativeConfig | None = _opt(  # noqa: RUF009 (a frozen value)
        None,
        'Speculative decoding, as JSON: {"method": "ngram" | "draft" | "mtp", '
        '"num_speculative_tokens": k, ...}. Each decode step the method proposes up to k '
        "tokens per request and the model checks them all in that one step (greedy keeps the "
        "longest prefix it agrees with plus its own next token; sampling keeps a proposed token "
        "exactly when it is the token sampled there, so outputs are those without speculation). "
        "ngram: prompt lookup, the tokens that followed the latest earlier occurrence of the "
        'last prompt_lookup_max..prompt_lookup_min tokens (defaults 4..2); draft: "model": '
        "a smaller checkpoint with the same tokenizer, run by the worker with its own KV cache; "
        "mtp: the checkpoint's multi-token-prediction layer (num_nextn_predict_layers). "
        "disable_by_batch_size (default 8; 0: never): no speculation in a step with more "
        "running requests than that (docs/speculative.md).",
        parse=SpeculativeConfig.parse,
        metavar="JSON",
    )
    seed: int = _opt(0, "Seed for requests that sample without their own seed.")
    num_threads: int | None = _opt(
        None,
        "CPU threads for the model, per worker process (per tensor-parallel rank). Default: "
        "every core offline; all but one under 'ketch serve', whose API server and engine need "
        "the other, shared by the ranks ((cores - 1) // tensor_parallel_size, at least 1).",
        minimum=1,
    )

    def __post_init__(self) -> None:
        _check_positive(self, "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2, got {self.num_kv_blocks}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
        for name in ("block_size", "dtype", "kv_cache_dtype", "quantization", "runner", "backend"):
            allowed = _field_choices(name)
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}"
                )
        parse_memory_size(self.kv_cache_memory, "kv_cache_memory")
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
        )
        parse_device(self.device)
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, int | float):
            raise ValueError(f"gpu_memory_utilization must be a number, got {utilization!r}")
        if not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(
                "model must be 'tiny', 'tiny-copy' or a path to a Hugging Face checkpoint directory"
            )

    @property
    def kv_cache_bytes(self) -> int:
        return parse_memory_size(self.kv_cache_memory, "kv_cache_memory")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Builds a config, naming any unknown argument instead of a bare TypeError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)


def _field_choices(name: str) -> tuple[Any, ...]:
    return next(f.metadata["choices"] for f in dataclasses.fields(EngineConfig) if f.name == name)


def _check_positive(config: EngineConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
