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
from ketch.engine.models.sharding import Shard
from ketch.kernels import CpuKernels
from ketch.kernels.collective import Group

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
):
    """A model with ``forward(input_ids, positions, kv_caches, meta, logit_rows)``.

    ``kernels`` apply to the eager model only; ``cache_dir`` overrides ``$KETCH_CACHE_DIR``.
    ``shard`` and ``group``: one tensor-parallel rank's weights and its collectives, which only
    the native backend runs (``auto`` then means native, with no fallback)."""
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
        matmul, _ = measured_matmul(weights, threads)  # logged by ketch.kernels.linear
        native_model = NativeGemma3Model if gemma else NativeLlamaModel
        return native_model(config, weights, eager, matmul, attention, shard, group)

    def predictor():
        return PredictorLlamaModel(config, weights, eager, threads, cache_dir)

    if backend == "native":
        return native()
    if parallel:
        try:
            return native()
        except Exception as exc:
            raise RuntimeError(
                f"tensor_parallel_size {shard.world} needs the native backend, which cannot run "
                f"here: {type(exc).__name__}: {exc}"
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
