"""What a model runner needs to know, decided by the engine (``RunnerConfig``): a leaf, so the
engine, the worker processes and the speculative proposers read it without importing the runner."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ketch.engine.models.config import ModelConfig
from ketch.engine.spec_decode.config import SpeculativeConfig

GRAMMAR_COMPILE_TIMEOUT_S = 10.0
"""Default ``RunnerConfig.grammar_compile_timeout_s``."""


@dataclass
class RunnerConfig:
    """What the runner needs to know, decided by the engine."""

    model_path: Path
    model_config: ModelConfig
    max_model_len: int
    num_blocks: int
    block_size: int
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # the weights' (activations are float32 on the CPU)
    kv_cache_dtype: str = "float32"
    quantization: str = "none"  # or "int8": linear layers' weights (CPU, native backend)
    num_threads: int | None = None
    backend: str = "auto"
    tensor_parallel_size: int = 1
    # 'cpu' or 'gpu:N' (rank r on gpu:N+r: ketch.engine.device). The GPU path has never run.
    device: str = "cpu"
    max_num_batched_tokens: int = 2048  # bounds a GPU step's attention gathers
    # A request whose grammar has not compiled this long after it arrived fails (alone).
    grammar_compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S
    speculative: SpeculativeConfig | None = None
