"""What this build of the engine can run: the one list of settings it refuses at start-up.

``EngineConfig`` checks each value on its own (a known dtype, a positive size); this module checks
what this build can do with them. ``LLMEngine`` calls ``check_runnable`` before it loads
anything, and the operator (its spec validation and ``ketch-operator check-wiring``) calls
``refusals`` on the configuration it renders for each pod, so an InferenceService never renders
pods that would exit at start-up. Widen what the engine runs here, and both follow.

Runs today: the CPU, float32, tensor parallelism across CPU worker processes (1 to
``MAX_TENSOR_PARALLEL_SIZE`` ranks, on models whose heads and MLP split evenly:
``ketch.engine.models.sharding``), no GPUs. Planned (issue 17): GPU workers, bfloat16/float16 on
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ketch.engine.cache_manager.protocol import KVLayout
from ketch.engine.config import EngineConfig
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.sharding import shard_problems

DEVICE = "cpu"
# dtype asked -> dtype computed. bfloat16/float16 need GPU workers.
COMPUTE_DTYPES = {"auto": "float32", "float32": "float32"}
# Worker processes per instance, one per rank; more ranks than this is a typo, not a plan.
MAX_TENSOR_PARALLEL_SIZE = 64
MAX_GPUS = 0  # per engine instance: the CPU engine uses none
PLANNED = "issue 17"


@dataclass(frozen=True)
class Refusal:
    """One setting this build refuses: ``setting`` is an ``EngineConfig`` field, or ``gpus`` (the
    GPUs the instance's pod is given, which the engine cannot see for itself)."""

    setting: str
    value: Any
    reason: str

    def __str__(self) -> str:
        return f"{self.setting}={self.value}: {self.reason}"


def refusals(
    config: EngineConfig, *, model: ModelConfig | None = None, gpus: int | None = None
) -> list[Refusal]:
    """Every reason this build would not start ``config``; [] when it would.

    ``model``: the checkpoint's facts when known (the engine, or the built-in tiny model), for
    the checks that need them. ``gpus``: the pod's GPU count, when the caller knows it."""
    out = []
    if config.dtype not in COMPUTE_DTYPES:
        out.append(
            Refusal(
                "dtype",
                config.dtype,
                f"the engine computes in float32 on the CPU only: use auto or float32 "
                f"({config.dtype} is for GPU workers, planned in {PLANNED})",
            )
        )
    if config.tensor_parallel_size > MAX_TENSOR_PARALLEL_SIZE:
        out.append(
            Refusal(
                "tensor_parallel_size",
                config.tensor_parallel_size,
                f"at most {MAX_TENSOR_PARALLEL_SIZE} tensor-parallel ranks (worker processes) "
                "per instance",
            )
        )
    if gpus is not None and gpus > MAX_GPUS:
        out.append(
            Refusal(
                "gpus",
                gpus,
                "the engine runs on the CPU only: a pod given GPUs holds them unused, and the "
                "engine has never run with one in its pod (the image's paddle GPU build would "
                f"place tensors on it): use 0 (GPU workers are planned, {PLANNED})",
            )
        )
    if model is not None:
        out += _model_refusals(config, model)
    return out


def check_runnable(config: EngineConfig, model: ModelConfig | None = None) -> None:
    """Raises ``ValueError`` naming every refusal; what ``LLMEngine`` calls first."""
    found = refusals(config, model=model)
    if found:
        raise ValueError("; ".join(map(str, found)))


def compute_dtype(config: EngineConfig) -> str:
    """The dtype weights and KV cache use (``config`` having passed ``check_runnable``)."""
    return COMPUTE_DTYPES[config.dtype]


def max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    """The longest request: ``config.max_model_len``, else the model's context length."""
    return model.max_position_embeddings if config.max_model_len is None else config.max_model_len


def num_kv_blocks(config: EngineConfig, model: ModelConfig) -> int:
    """KV-cache blocks: ``num_kv_blocks`` if set, else as many as ``kv_cache_memory`` holds."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    return config.kv_cache_bytes // _layout(config, model).block_bytes


def kv_cache_bytes(config: EngineConfig, model: ModelConfig) -> int:
    """Bytes of the KV cache segment (in /dev/shm under ``ketch serve``)."""
    return num_kv_blocks(config, model) * _layout(config, model).block_bytes


def _layout(config: EngineConfig, model: ModelConfig) -> KVLayout:
    return KVLayout(
        num_layers=model.num_hidden_layers,
        kv_heads=model.num_key_value_heads,
        num_blocks=0,
        block_size=config.block_size,
        head_dim=model.head_dim,
        dtype=COMPUTE_DTYPES.get(config.dtype, "float32"),
    )


def _model_refusals(config: EngineConfig, model: ModelConfig) -> list[Refusal]:
    tp = config.tensor_parallel_size
    if tp <= MAX_TENSOR_PARALLEL_SIZE:
        problems = shard_problems(model, tp)
        if problems:
            return [
                Refusal(
                    "tensor_parallel_size",
                    tp,
                    f"the model cannot be split across {tp} ranks: " + "; ".join(problems),
                )
            ]
    limit = model.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        return [
            Refusal(
                "max_model_len",
                config.max_model_len,
                f"max_model_len={config.max_model_len} exceeds the model's context length "
                f"(max_position_embeddings={limit})",
            )
        ]
    blocks, length = num_kv_blocks(config, model), max_model_len(config, model)
    needed = -(-length // config.block_size) + 1  # block 0 is reserved
    if blocks >= needed:
        return []
    setting = "num_kv_blocks" if config.num_kv_blocks is not None else "kv_cache_memory"
    return [
        Refusal(
            setting,
            getattr(config, setting),
            f"the KV cache ({blocks} blocks of {config.block_size} tokens) cannot hold one "
            f"request of max_model_len={length}; it needs {needed} blocks: raise "
            "kv_cache_memory (or num_kv_blocks) or lower max_model_len",
        )
    ]
