"""Chooses what executes the model: Ketch's native kernels, the paddle inference predictor, or
eager dygraph.

Routed-expert (MoE) models and Gemma 3 run on native and eager only: ``predictor`` is refused
for them, and ``auto`` falls back from native straight to eager.

``native`` runs every step in dygraph on Ketch's C++ kernels: matmuls in the GEMM op (OpenBLAS)
or paddle.matmul, whichever measures faster here (``ketch.kernels.linear.choose_matmul``),
fused RMSNorm and rotary ops, attention in the paged-attention kernel (``llama_native``);
``predictor`` runs the dense layers as exported static programs on the inference predictor
with oneDNN (``ketch.kernels.predictor_backend``); ``eager`` is the dygraph reference.
``auto`` (the default) takes the first of native, predictor, eager that can be built on this
machine, with one log line for what it fell back from.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ketch.engine.models.config import ModelConfig
from ketch.engine.models.gemma3 import Gemma3Model
from ketch.engine.models.llama import LlamaModel, ModelWeights
from ketch.engine.models.llama_native import Panels
from ketch.engine.models.protocol import DecoderModel
from ketch.engine.models.sharding import Shard
from ketch.kernels import CpuKernels
from ketch.kernels.collective import Group
from ketch.kernels.packed_linear import select_packed_linear

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "native", "predictor", "eager")


def build_model(
    backend: str,
    config: ModelConfig,
    weights: ModelWeights,
    max_len: int,
    threads: int,
    kernels: CpuKernels | None = None,
    cache_dir: Path | None = None,
    shard: Shard | None = None,
    group: Group | None = None,
    dtype: str = "float32",
    quantization: str = "none",
) -> DecoderModel:
    """The model of ``backend`` (``DecoderModel``: ``forward(input_ids, positions, kv_caches,
    meta, logit_rows)`` and the rest).

    ``kernels`` apply to the eager model only; ``cache_dir`` overrides ``$KETCH_CACHE_DIR``.
    ``shard`` and ``group``: one tensor-parallel rank's weights and its collectives, which only
    the native backend runs (``auto`` then means native, with no fallback). ``dtype``: the
    weights' (as loaded), ``quantization``: ``int8`` for the linear layers; below float32 the
    model runs on the native backend's packed GEMM only (``auto``: no fallback either)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    problem = config.backend_problem(backend)
    if problem is not None:
        raise ValueError(problem)
    parallel = shard is not None and shard.world > 1
    if parallel and backend not in ("auto", "native"):
        raise ValueError(
            f"tensor_parallel_size {shard.world} runs on the native backend only, not {backend!r}"
        )
    panels = _panels(dtype, quantization)
    if panels is not None and backend not in ("auto", "native"):
        raise ValueError(
            f"{dtype} weights{' quantized to int8' if quantization == 'int8' else ''} run on "
            f"the native backend only, not {backend!r}"
        )
    gemma = config.gemma is not None
    eager = (Gemma3Model if gemma else LlamaModel)(config, weights, max_len, kernels)
    if backend == "eager":
        return eager
    from ketch.engine.models.llama_predictor import PredictorLlamaModel, _attention_kernel

    def native():
        from ketch.engine.models.gemma3 import NativeGemma3Model
        from ketch.engine.models.llama_native import NativeLlamaModel, measured_matmul
        from ketch.kernels import cpp_ops

        cpp_ops.ops()  # the fused ops and attention
        attention = _attention_kernel(eager.kernels, config.head_dim)
        if panels is None:
            matmul, _ = measured_matmul(weights, threads)  # logged by ketch.kernels.linear
        else:  # only the packed GEMM reads bfloat16 or int8 weights
            matmul = select_packed_linear(num_threads=threads)
            logger.info("matmul: packed (%s panels, %s lm_head)", panels.linear, panels.head)
        native_model = NativeGemma3Model if gemma else NativeLlamaModel
        return native_model(config, weights, eager, matmul, attention, shard, group, panels)

    def predictor():
        return PredictorLlamaModel(config, weights, eager, threads, cache_dir)

    if backend == "native":
        return native()
    if parallel or panels is not None:
        why = f"tensor_parallel_size {shard.world}" if parallel else f"{dtype} weights"
        if quantization == "int8":
            why += " quantized to int8"
        try:
            return native()
        except Exception as exc:
            raise RuntimeError(
                f"{why} need the native backend, which cannot run here: {type(exc).__name__}: {exc}"
            ) from exc
    if backend == "predictor":
        return predictor()
    why = []
    candidates = (("native", native), ("predictor", predictor))
    if config.backend_problem("predictor") is not None:  # e.g. no routed experts in its programs
        candidates = candidates[:1]
    for name, make in candidates:
        try:
            model = make()
        except Exception as exc:  # any failure to build or load: the next one is tried
            why.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if why:
            logger.warning("backend: %s (%s)", name, "; ".join(why))
        return model
    logger.warning("backend: eager (%s)", "; ".join(why))
    return eager


def _panels(dtype: str, quantization: str):
    """The packed GEMM's panel types for weights below float32, else None."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"the CPU backends take float32 or bfloat16 weights, not {dtype!r}")
    if quantization not in ("none", "int8"):
        raise ValueError(f"unknown quantization {quantization!r}; expected none or int8")
    if dtype == "float32" and quantization == "none":
        return None
    return Panels(linear="int8" if quantization == "int8" else dtype, head=dtype)
