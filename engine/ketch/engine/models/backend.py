"""Chooses what executes the model: the paddle inference predictor or eager dygraph.

``predictor`` runs the dense layers as exported static programs on the inference predictor
with oneDNN (``ketch.kernels.predictor_backend``); ``eager`` is the dygraph reference;
``auto`` (the default) takes the predictor and falls back to eager, with one log line, where
it cannot be built on this machine.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ketch.engine.models.config import ModelConfig
from ketch.engine.models.llama import LlamaModel, ModelWeights
from ketch.kernels import CpuKernels

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "predictor", "eager")


def build_model(
    backend: str,
    config: ModelConfig,
    weights: ModelWeights,
    max_len: int,
    threads: int,
    kernels: CpuKernels | None = None,
    cache_dir: Path | None = None,
):
    """A model with ``forward(input_ids, positions, kv_caches, meta, logit_rows)``.

    ``kernels`` apply to the eager model only; ``cache_dir`` overrides ``$KETCH_CACHE_DIR``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    eager = LlamaModel(config, weights, max_len, kernels)
    if backend == "eager":
        return eager
    from ketch.engine.models.llama_predictor import PredictorLlamaModel

    if backend == "predictor":
        return PredictorLlamaModel(config, weights, eager, threads, cache_dir)
    try:
        return PredictorLlamaModel(config, weights, eager, threads, cache_dir)
    except Exception as exc:  # any failure to export or load: the reference still runs
        logger.warning(
            "backend: eager (the predictor cannot run here: %s: %s)", type(exc).__name__, exc
        )
        return eager
