"""What this build of the engine can run: the one list of settings it refuses at start-up.

``EngineConfig`` checks each value on its own (a known dtype, a positive size); this module checks
what this build can do with them. ``LLMEngine`` calls ``check_runnable`` before it loads
anything, and the operator (its spec validation and ``ketch-operator check-wiring``) calls
``refusals`` on the configuration it renders for each pod, so an InferenceService never renders
pods that would exit at start-up. Widen what the engine runs here, and both follow.

Runs today: the CPU with float32 or bfloat16 weights, int8 linear layers and a float32 or
bfloat16 KV cache (below float32 on the native backend only: docs/precision.md), tensor
parallelism across CPU worker processes (1 to
``MAX_TENSOR_PARALLEL_SIZE`` ranks, on models whose heads and MLP split evenly:
``ketch.engine.models.sharding``). Written but never run (issue 17): ``--device gpu`` (bfloat16 /
float16 / float32 on GPUs, KV blocks from ``gpu_memory_utilization``: ``ketch.engine.device``).
It is refused on a paddle built without CUDA (every machine Ketch is built and tested on), and
the operator renders no GPU pods (``MAX_GPUS``) until it has run.

The GPU checks need facts only CUDA knows (GPU count, free memory, compute capability): they come
from ``probe`` (default ``device.probe_gpus``; tests pass their own), asked only when the device
is a GPU, so the operator's calls never import paddle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ketch.engine import device as dev
from ketch.engine.cache_manager.protocol import KVLayout
from ketch.engine.config import EngineConfig
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.sharding import Shard, shard_problems

logger = logging.getLogger(__name__)

# CPU backends that run below float32 (bfloat16 weights or KV cache, int8 weights): the packed
# GEMM and the paged-attention kernel. eager and predictor compute from float32 tensors only.
LOW_PRECISION_BACKENDS = ("auto", "native")
# Worker processes per instance, one per rank; more ranks than this is a typo, not a plan.
MAX_TENSOR_PARALLEL_SIZE = 64
CPU_SERIAL = ("eager", "predictor")  # CPU backends with no tensor-parallel path
# GPUs per engine pod the operator may render: none until the GPU path has run somewhere.
MAX_GPUS = 0
PLANNED = "issue 17"
GPU_BACKENDS = ("auto",)  # the CPU backends (native, predictor, eager) do not run on a GPU

Probe = Callable[[tuple[int, ...]], tuple[dev.GpuInfo, ...]]


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
    config: EngineConfig,
    *,
    model: ModelConfig | None = None,
    gpus: int | None = None,
    probe: Probe | None = None,
) -> list[Refusal]:
    """Every reason this build would not start ``config``; [] when it would.

    ``model``: the checkpoint's facts when known (the engine, or the built-in tiny model), for
    the checks that need them. ``gpus``: the pod's GPU count, when the caller knows it.
    ``probe``: what CUDA reports about GPUs (only asked when ``config.device`` is a GPU)."""
    device = dev.parse_device(config.device)
    gpu_facts, out = None, []
    if device.is_gpu:
        gpu_facts, out = _gpu_refusals(config, device, probe)
    capability = _capability(gpu_facts) if gpu_facts else None
    problem = dev.dtype_problem(device, config.dtype, capability)
    if problem is not None:
        out.append(Refusal("dtype", config.dtype, problem))
    else:
        out += _precision_refusals(config, device, model, capability)
    if config.tensor_parallel_size > MAX_TENSOR_PARALLEL_SIZE:
        out.append(
            Refusal(
                "tensor_parallel_size",
                config.tensor_parallel_size,
                f"at most {MAX_TENSOR_PARALLEL_SIZE} tensor-parallel ranks (worker processes) "
                "per instance",
            )
        )
    if config.tensor_parallel_size > 1 and not device.is_gpu and config.backend in CPU_SERIAL:
        out.append(
            Refusal(
                "backend",
                config.backend,
                f"tensor_parallel_size {config.tensor_parallel_size} on the CPU runs on the "
                "native backend only (its layers hold the ranks' shards and all-reduces): use "
                "auto or native",
            )
        )
    if gpus is not None and gpus > MAX_GPUS:
        out.append(
            Refusal(
                "gpus",
                gpus,
                "the engine runs on the CPU only here: its GPU path (--device gpu) is written "
                "against paddle's documented GPU APIs but has never been run (no paddle GPU "
                "build could be installed where Ketch is built and tested), so the operator "
                f"renders no pod that depends on it: use 0 (GPU workers are planned, {PLANNED})",
            )
        )
    if model is not None:
        unsupported = model.backend_problem(config.backend, gpu=device.is_gpu)
        if unsupported is not None:  # before any weights load
            where = ("device", config.device) if device.is_gpu else ("backend", config.backend)
            out.append(Refusal(*where, unsupported))
        out += _speculative_refusals(config, model, device.is_gpu)
        if device.is_gpu and (gpu_facts is None or problem is not None):
            out += _model_refusals(config, model, kv=False)  # no GPU (or dtype) to size it by
        else:
            out += _model_refusals(config, model, facts=gpu_facts)
    return out


def _speculative_refusals(config: EngineConfig, model: ModelConfig, gpu: bool) -> list[Refusal]:
    """``method: mtp`` drafts with the checkpoint's multi-token-prediction layer: refused for a
    checkpoint without one, and where its layer does not run (the CPU's native and eager)."""
    spec = config.speculative_config
    if spec is None or spec.method != "mtp":
        return []
    if not model.num_mtp_layers:
        return [
            Refusal(
                "speculative_config",
                spec.to_json(),
                "speculative_config.method 'mtp' needs a checkpoint with multi-token-prediction "
                f"layers (config num_nextn_predict_layers > 0); {config.model} has none",
            )
        ]
    if gpu or config.backend not in ("auto", "native", "eager"):
        where = "--device gpu" if gpu else f"--backend {config.backend}"
        return [
            Refusal(
                "speculative_config",
                spec.to_json(),
                f"speculative_config.method 'mtp' runs on the CPU's native or eager backend, "
                f"not {where}",
            )
        ]
    return []


def check_runnable(
    config: EngineConfig, model: ModelConfig | None = None, probe: Probe | None = None
) -> None:
    """Raises ``ValueError`` naming every refusal; what ``LLMEngine`` calls first."""
    found = refusals(config, model=model, probe=probe)
    if found:
        raise ValueError("; ".join(map(str, found)))


def compute_dtype(
    config: EngineConfig, probe: Probe | None = None, model: ModelConfig | None = None
) -> str:
    """The dtype the weights use (``config`` having passed ``check_runnable``); ``model``: the
    checkpoint's facts (``auto`` follows a bfloat16 checkpoint on the CPU)."""
    device = dev.parse_device(config.device)
    if not device.is_gpu:
        return cpu_weight_dtype(config, model)
    return dev.resolve_dtype(device, config.dtype, _capability(_facts(config, device, probe)))


def kv_cache_dtype(
    config: EngineConfig, probe: Probe | None = None, model: ModelConfig | None = None
) -> str:
    """The KV cache's element type: ``kv_cache_dtype``, or with ``auto`` the weights' dtype."""
    if config.kv_cache_dtype != "auto":
        return config.kv_cache_dtype
    return compute_dtype(config, probe, model)


def precision_line(weights: str, quantization: str, kv: str) -> str:
    """How the instance computes, for the start-up logs: 'bfloat16 weights (int8 linear layers),
    bfloat16 KV cache, float32 activations'."""
    quantized = " (int8 linear layers)" if quantization == "int8" else ""
    return f"{weights} weights{quantized}, {kv} KV cache, float32 activations"


def cpu_weight_dtype(config: EngineConfig, model: ModelConfig | None) -> str:
    """``auto`` on the CPU: bfloat16 for a bfloat16 checkpoint where the backend runs it."""
    return cpu_dtypes(config, model.torch_dtype if model is not None else None)[0]


def cpu_dtypes(config: EngineConfig, checkpoint_dtype: str | None = None) -> tuple[str, str]:
    """(weight dtype, KV-cache dtype) on the CPU for a checkpoint saved in ``checkpoint_dtype``
    (config.json's ``torch_dtype``; None: not known, taken as float32). ValueError for a dtype
    the CPU refuses."""
    if config.dtype == "auto" and config.backend not in LOW_PRECISION_BACKENDS:
        weights = "float32"  # eager and predictor compute from float32 weights
    else:
        weights = dev.resolve_dtype(dev.CPU, config.dtype, checkpoint_dtype=checkpoint_dtype)
    return weights, weights if config.kv_cache_dtype == "auto" else config.kv_cache_dtype


def below_float32(config: EngineConfig, model: ModelConfig | None = None) -> list[tuple[str, str]]:
    """The CPU precision settings of ``config`` below float32, as (field, value): the weight
    dtype as resolved, ``kv_cache_dtype`` and ``quantization`` as set."""
    return [
        (name, value)
        for name, value in (
            ("dtype", cpu_weight_dtype(config, model)),
            ("kv_cache_dtype", config.kv_cache_dtype),
            ("quantization", config.quantization),
        )
        if value not in ("float32", "auto", "none")
    ]


def precision_backend_refusal(
    config: EngineConfig, model: ModelConfig | None = None
) -> Refusal | None:
    """The CPU backend's refusal of ``config``'s below-float32 settings (None: it runs them,
    or there are none). ``config.dtype`` must be a CPU dtype."""
    if config.backend in LOW_PRECISION_BACKENDS:
        return None
    below = [f"{name}={value}" for name, value in below_float32(config, model)]
    if not below:
        return None
    return Refusal(
        "backend",
        config.backend,
        f"{', '.join(below)} runs on the native backend only (the packed GEMM and the "
        f"paged-attention kernel; {config.backend} computes from float32 tensors): use "
        "auto or native",
    )


def _precision_refusals(
    config: EngineConfig,
    device: dev.Device,
    model: ModelConfig | None,
    capability: tuple[int, int] | None,
) -> list[Refusal]:
    """bfloat16 / int8 settings this device or backend cannot run (the dtype itself valid)."""
    out = []
    if device.is_gpu:
        if config.quantization != "none":
            out.append(
                Refusal(
                    "quantization",
                    config.quantization,
                    "int8 weights run on the CPU only (the packed GEMM dequantizes them); on a "
                    "GPU use none",
                )
            )
        if config.kv_cache_dtype not in ("auto", config.dtype):
            out.append(
                Refusal(
                    "kv_cache_dtype",
                    config.kv_cache_dtype,
                    f"on a GPU the KV cache holds the compute dtype: use auto (dtype "
                    f"{config.dtype})",
                )
            )
        return out
    refusal = precision_backend_refusal(config, model)
    return out if refusal is None else [*out, refusal]


def max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    """The longest request: ``config.max_model_len``, else the model's context length."""
    return model.max_position_embeddings if config.max_model_len is None else config.max_model_len


def num_kv_blocks(config: EngineConfig, model: ModelConfig, probe: Probe | None = None) -> int:
    """KV-cache blocks: ``num_kv_blocks`` if set, else as many as ``kv_cache_memory`` holds (on
    a GPU: as many as every rank's GPU holds, ``device.gpu_kv_plan``)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    device = dev.parse_device(config.device)
    if not device.is_gpu:
        return config.kv_cache_bytes // kv_layout(config, model).block_bytes
    plans = _gpu_plans(config, model, _facts(config, device, probe))
    for info, plan in plans:
        logger.info("KV cache on gpu:%d (%s): %s", info.index, info.name, plan)
    return min(plan.num_blocks for _, plan in plans)


def kv_cache_bytes(config: EngineConfig, model: ModelConfig, probe: Probe | None = None) -> int:
    """Bytes of the KV cache: the segment in /dev/shm under ``ketch serve`` on the CPU; on a GPU,
    what each rank holds in device memory."""
    blocks = num_kv_blocks(config, model, probe)
    device = dev.parse_device(config.device)
    if not device.is_gpu:
        return blocks * kv_layout(config, model).block_bytes
    dtype = kv_cache_dtype(config, probe, model)
    shard = Shard.of(model, 0, config.tensor_parallel_size)
    return blocks * dev.kv_block_bytes(model, shard, config.block_size, dtype)


def kv_layout(config: EngineConfig, model: ModelConfig) -> KVLayout:
    """The KV cache's layout for ``config`` and ``model`` (no blocks: sizes per block)."""
    return KVLayout(
        num_layers=model.num_hidden_layers,
        kv_heads=model.num_key_value_heads,
        num_blocks=0,
        block_size=config.block_size,
        head_dim=model.head_dim,
        dtype=kv_cache_dtype(config, model=model) if _runs_on_cpu(config) else "float32",
    )


def _runs_on_cpu(config: EngineConfig) -> bool:
    """The CPU precision settings resolve (a refused dtype is sized as float32)."""
    return dev.dtype_problem(dev.CPU, config.dtype) is None


def _facts(config: EngineConfig, device: dev.Device, probe: Probe | None):
    indices = tuple(d.index for d in dev.rank_devices(device, config.tensor_parallel_size))
    return (probe or dev.probe_gpus)(indices)


def _capability(facts) -> tuple[int, int]:
    """The oldest of the ranks' GPUs decides what they all compute in."""
    return min(info.capability for info in facts)


def _gpu_refusals(config: EngineConfig, device: dev.Device, probe: Probe | None):
    """(the GPUs' facts or None, the refusals that come with a GPU device)."""
    out = []
    if config.backend not in GPU_BACKENDS:
        out.append(
            Refusal(
                "backend",
                config.backend,
                "a CPU backend: on a GPU the model runs on paddle's GPU ops (use auto)",
            )
        )
    last = device.index + config.tensor_parallel_size - 1
    if last > dev.MAX_GPU_INDEX:
        reason = f"its {config.tensor_parallel_size} ranks would need GPUs up to gpu:{last}"
        return None, [*out, Refusal("device", config.device, reason)]
    try:
        return _facts(config, device, probe), out
    except dev.DeviceError as exc:
        return None, [*out, Refusal("device", config.device, str(exc))]


def _gpu_plans(config: EngineConfig, model: ModelConfig, facts) -> list:
    dtype = dev.resolve_dtype(dev.parse_device(config.device), config.dtype, _capability(facts))
    tp = config.tensor_parallel_size
    return [
        (
            info,
            dev.gpu_kv_plan(
                info,
                config.gpu_memory_utilization,
                model,
                Shard.of(model, rank, tp),
                dtype=dtype,
                block_size=config.block_size,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_len=max_model_len(config, model),
            ),
        )
        for rank, info in enumerate(facts)
    ]


def _model_refusals(
    config: EngineConfig, model: ModelConfig, *, kv: bool = True, facts=None
) -> list[Refusal]:
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
    if not kv or (facts is not None and tp > MAX_TENSOR_PARALLEL_SIZE):
        return []  # a GPU plan needs the model split into tp shards
    if facts is None or config.num_kv_blocks is not None:
        blocks = num_kv_blocks(config, model)
    else:
        blocks = min(plan.num_blocks for _, plan in _gpu_plans(config, model, facts))
    length = max_model_len(config, model)
    needed = -(-length // config.block_size) + 1  # block 0 is reserved
    if blocks >= needed:
        return []
    if config.num_kv_blocks is not None:
        setting, raise_what = "num_kv_blocks", "kv_cache_memory (or num_kv_blocks)"
    elif facts is None:
        setting, raise_what = "kv_cache_memory", "kv_cache_memory (or num_kv_blocks)"
    else:
        setting, raise_what = "gpu_memory_utilization", "gpu_memory_utilization"
    return [
        Refusal(
            setting,
            getattr(config, setting),
            f"the KV cache ({blocks} blocks of {config.block_size} tokens) cannot hold one "
            f"request of max_model_len={length}; it needs {needed} blocks: raise "
            f"{raise_what} or lower max_model_len",
        )
    ]
