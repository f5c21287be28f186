"""Where the model runs: the device layer the runner, the KV cache and the memory budget go through.

A device is ``cpu`` or ``gpu:N``. Tensor-parallel rank ``r`` of an engine whose device is
``gpu:N`` runs on ``gpu:N+r`` (``gpu`` means ``gpu:0``); on the CPU every rank is a process on the
same CPUs. Everything here is plain Python, importable without paddle (the operator imports
it through ``ketch.engine.capabilities``), except ``probe_gpus``, which imports paddle when called.

What has run: the CPU. The GPU path (``--device gpu``) is written against paddle's documented GPU
APIs and has never been run: no paddle GPU build could be installed where Ketch is built and
tested (docs/gpu.md says exactly what is and is not tested).

KV-cache blocks on a GPU (``gpu_kv_plan``): the memory the instance may take on each of its GPUs
is ``free * gpu_memory_utilization`` (free as CUDA reports it before anything is loaded); from
that come the rank's weights and an activation reserve (``activation_reserve``: an estimate from
the step's shapes, not a measurement), and the rest is whole KV blocks. Every rank gets the
fewest blocks any rank can hold: the scheduler keeps one block table for all of them.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from ketch.engine.models.config import ModelConfig
from ketch.engine.models.sharding import Shard

MAX_GPU_INDEX = 255  # more than any machine holds: a larger index is a typo, not a plan
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Weight dtypes the CPU runs (activations and sums are float32 whatever the weights are):
# bfloat16 weights are widened to float32 as the packed GEMM loads them (ketch.kernels).
CPU_DTYPES = ("auto", "float32", "bfloat16")
GPU_DTYPES = ("float32", "bfloat16", "float16")
BF16_CAPABILITY = (8, 0)  # bfloat16 matmuls and flash attention need Ampere or newer
# CUDA context, cuBLAS workspaces, NCCL buffers and the allocator's slack: set aside once per GPU.
# An allowance, not a measurement (nothing here has run on a GPU).
GPU_RUNTIME_BYTES = 1 << 30
_DEVICE = re.compile(r"gpu(?::([0-9]+))?")


class DeviceError(RuntimeError):
    """This machine or paddle build cannot give the engine the device it was asked for."""


@dataclass(frozen=True)
class Device:
    """``cpu``, or GPU ``index``."""

    kind: str  # "cpu" | "gpu"
    index: int = 0

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    def __str__(self) -> str:
        return f"gpu:{self.index}" if self.is_gpu else "cpu"


CPU = Device("cpu")


def parse_device(text: object) -> Device:
    """``"cpu"``, ``"gpu"`` or ``"gpu:N"``; ValueError naming the forms otherwise."""
    if text == "cpu":
        return CPU
    match = _DEVICE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"device must be 'cpu', 'gpu' or 'gpu:N' (N a GPU index, 0-{MAX_GPU_INDEX}), "
            f"got {text!r}"
        )
    index = int(match.group(1) or 0)
    if index > MAX_GPU_INDEX:
        raise ValueError(f"device {text!r}: GPU index {index} is above {MAX_GPU_INDEX}")
    return Device("gpu", index)


def rank_device(base: Device, rank: int) -> Device:
    """The device tensor-parallel rank ``rank`` runs on: ``gpu:N`` -> ``gpu:N+rank``."""
    if rank < 0:
        raise ValueError(f"rank {rank} is negative")
    if not base.is_gpu:
        return base
    index = base.index + rank
    if index > MAX_GPU_INDEX:
        raise ValueError(f"rank {rank} on {base} would be GPU {index}, above {MAX_GPU_INDEX}")
    return Device("gpu", index)


def rank_devices(base: Device, world: int) -> tuple[Device, ...]:
    return tuple(rank_device(base, r) for r in range(world))


# ---------------------------------------------------------------------------------------- dtype


def dtype_problem(
    device: Device, dtype: str, capability: tuple[int, int] | None = None
) -> str | None:
    """Why ``dtype`` cannot run on ``device`` (None when it can). ``capability``: the GPU's
    compute capability, when known."""
    if not device.is_gpu:
        if dtype in CPU_DTYPES:
            return None
        return (
            f"{dtype} is not a CPU weight dtype: use auto, float32 or bfloat16 (x86-64 CPUs "
            "have no float16 arithmetic; Ketch computes in float32 on the CPU, from float32 "
            "or bfloat16 weights)"
        )
    if dtype != "auto" and dtype not in GPU_DTYPES:
        return f"{dtype} is not a GPU compute dtype: use auto, {', '.join(GPU_DTYPES)}"
    if dtype == "bfloat16" and capability is not None and tuple(capability) < BF16_CAPABILITY:
        major, minor = capability
        return (
            f"bfloat16 needs a GPU of compute capability {BF16_CAPABILITY[0]}.0 or newer; "
            f"{device} is {major}.{minor}: use float16 (or auto)"
        )
    return None


def resolve_dtype(
    device: Device,
    dtype: str,
    capability: tuple[int, int] | None = None,
    checkpoint_dtype: str | None = None,
) -> str:
    """The dtype the weights use. ``auto``: on the CPU bfloat16 for a checkpoint saved in
    bfloat16 (``checkpoint_dtype``, config.json's ``torch_dtype``), else float32; on a GPU
    bfloat16 where it has it (compute capability 8.0+), else float16."""
    problem = dtype_problem(device, dtype, capability)
    if problem is not None:
        raise ValueError(problem)
    if dtype != "auto":
        return dtype
    if not device.is_gpu:
        return "bfloat16" if checkpoint_dtype == "bfloat16" else "float32"
    if capability is None or tuple(capability) >= BF16_CAPABILITY:
        return "bfloat16"
    return "float16"


# -------------------------------------------------------------------------------- memory budget


@dataclass(frozen=True)
class GpuInfo:
    """What CUDA reports about one GPU before the engine loads anything on it."""

    index: int
    name: str
    free: int  # bytes
    total: int
    capability: tuple[int, int]


@dataclass(frozen=True)
class KVPlan:
    """One rank's memory arithmetic (bytes): ``budget - weights - reserve`` is the KV cache."""

    budget: int
    weights: int
    reserve: int
    block_bytes: int

    @property
    def num_blocks(self) -> int:
        return max(0, (self.budget - self.weights - self.reserve) // self.block_bytes)

    def __str__(self) -> str:
        gib = 1 << 30
        return (
            f"{self.budget / gib:.2f} GiB usable - weights {self.weights / gib:.2f} GiB - "
            f"reserve {self.reserve / gib:.2f} GiB = {self.num_blocks} blocks of "
            f"{self.block_bytes} bytes"
        )


def kv_block_bytes(model: ModelConfig, shard: Shard, block_size: int, dtype: str) -> int:
    """One block's keys and values in every layer, for the KV heads ``shard`` holds."""
    return (
        2 * model.num_hidden_layers * block_size * shard.num_kv_heads * model.head_dim
    ) * DTYPE_BYTES[dtype]


def weight_bytes(model: ModelConfig, shard: Shard, dtype: str, max_len: int) -> int:
    """The rank's weights as the loader lays them out (an lm_head tied to the embeddings is
    still a transposed copy), and the rotary tables (float32)."""
    hidden, d = model.hidden_size, model.head_dim
    heads, kv = shard.num_heads, shard.num_kv_heads
    inter = shard.intermediate[1] - shard.intermediate[0]
    qkv = (heads + 2 * kv) * d
    per_layer = hidden * qkv + heads * d * hidden + 3 * hidden * inter + 2 * hidden
    if model.qkv_bias:
        per_layer += qkv
    if model.o_bias:
        per_layer += hidden
    if model.mlp_bias:
        per_layer += 2 * inter + hidden
    elements = model.num_hidden_layers * per_layer + model.vocab_size * hidden + hidden
    if shard.first:
        elements += model.vocab_size * hidden
    return elements * DTYPE_BYTES[dtype] + 2 * max_len * d * 4


QUANTIZATIONS = ("none", "int8")
INT8_SCALE_BYTES = 4  # int8 weights: one float32 scale per output channel (symmetric)


def cpu_weight_bytes(
    model: ModelConfig, shard: Shard, dtype: str, quantization: str = "none"
) -> int:
    """The rank's weights as the CPU loader lays them out, at ``dtype`` (``float32`` or
    ``bfloat16``; the checkpoint's tensors are converted to it as they load).

    With ``quantization`` ``int8`` every linear layer the packed GEMM runs (q/k/v, o, the MLP's
    gate/up and down, each routed expert's, ERNIE's shared experts') holds 1 byte per weight
    plus a float32 scale per output channel; the embedding and the lm_head (an lm_head tied to
    the embeddings is still its own transposed copy, on rank 0) stay at ``dtype``; the norms,
    biases and MoE routers (and ERNIE's score bias) are float32 whatever ``dtype`` is (the CPU
    loader reads them so: ``load_weights(small_dtype="float32")``). Not counted: the rotary
    tables (float32, ``2 * max_len * head_dim`` values) and the packed GEMM's panel padding: the
    caller's headroom covers them."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    size = DTYPE_BYTES[dtype]
    linear = cpu_linear_shapes(model, shard)
    if quantization == "int8":
        linear_bytes = sum(n_in * n_out + INT8_SCALE_BYTES * n_out for n_in, n_out in linear)
    else:
        linear_bytes = sum(n_in * n_out for n_in, n_out in linear) * size
    hidden = model.hidden_size
    norms = 2 + (2 if model.gemma is not None else 0)
    per_layer = norms * hidden + (2 * model.head_dim if model.qk_norm else 0)
    qkv = (shard.num_heads + 2 * shard.num_kv_heads) * model.head_dim
    if model.qkv_bias:
        per_layer += qkv
    if model.o_bias:
        per_layer += hidden
    vectors = model.num_hidden_layers * per_layer + hidden  # float32 on the CPU (the loader)
    router = 0
    for i in range(model.num_hidden_layers):
        moe = i in model.moe_layers
        inter = _width(shard.shared if moe else shard.intermediate)
        if model.mlp_bias and inter:
            vectors += 2 * inter + hidden
        if moe:
            router += hidden * model.num_experts + (
                model.num_experts if model.moe_score_bias else 0
            )
    tables = model.vocab_size * hidden
    if shard.first:
        tables += model.vocab_size * hidden
        vectors += model.vocab_size if model.lm_head_bias else 0
    return linear_bytes + tables * size + (vectors + router) * 4


def cpu_linear_shapes(model: ModelConfig, shard: Shard) -> list[tuple[int, int]]:
    """(input features, output channels) of every linear layer the rank's packed GEMM runs,
    layer by layer: q/k/v fused, o, then the dense MLP's gate/up fused and down, or in a MoE
    layer each held expert's and the shared experts'."""
    hidden, d = model.hidden_size, model.head_dim
    out = []
    for i in range(model.num_hidden_layers):
        out.append((hidden, (shard.num_heads + 2 * shard.num_kv_heads) * d))
        out.append((shard.num_heads * d, hidden))
        moe = i in model.moe_layers
        inter = _width(shard.shared if moe else shard.intermediate)
        if inter:
            out += [(hidden, 2 * inter), (inter, hidden)]
        if moe:
            e = model.moe_intermediate_size
            out += [(hidden, 2 * e), (e, hidden)] * _width(shard.experts)
    return out


def _width(span: tuple[int, int]) -> int:
    return span[1] - span[0]


def activation_reserve(
    model: ModelConfig, shard: Shard, dtype: str, max_num_batched_tokens: int, max_len: int
) -> int:
    """Memory one step may need beyond weights and KV cache (an estimate from the shapes):

    - the dense layer's activations at the step's token budget, twice (inputs and outputs live
      together);
    - logits: up to one float32 row per token (prompt_logprobs), with the compute-dtype copy;
    - attention: the keys and values gathered from the cache for one call (at most
      ``attention_window`` tokens), repeated to the query heads, the padded queries and the
      output;
    - ``GPU_RUNTIME_BYTES``."""
    size = DTYPE_BYTES[dtype]
    tokens = max_num_batched_tokens
    hidden, d = model.hidden_size, model.head_dim
    inter = shard.intermediate[1] - shard.intermediate[0]
    dense = 2 * tokens * (4 * hidden + (shard.num_heads + 2 * shard.num_kv_heads) * d + 3 * inter)
    logits = tokens * model.vocab_size * (size + 4) if shard.first else 0
    window = attention_window(max_num_batched_tokens, max_len)
    attention = 4 * window * shard.num_heads * d * size + 16 * window
    return dense * size + logits + attention + GPU_RUNTIME_BYTES


def attention_window(max_num_batched_tokens: int, max_len: int) -> int:
    """Most context tokens one attention call gathers: the GPU attention splits a step's
    sequences into calls of at most this many (one sequence's context always fits)."""
    return max(max_num_batched_tokens, max_len)


def gpu_kv_plan(
    info: GpuInfo,
    utilization: float,
    model: ModelConfig,
    shard: Shard,
    *,
    dtype: str,
    block_size: int,
    max_num_batched_tokens: int,
    max_len: int,
) -> KVPlan:
    """The KV cache one rank's GPU holds."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    return KVPlan(
        budget=int(info.free * utilization),
        weights=weight_bytes(model, shard, dtype, max_len),
        reserve=activation_reserve(model, shard, dtype, max_num_batched_tokens, max_len),
        block_bytes=kv_block_bytes(model, shard, block_size, dtype),
    )


# ---------------------------------------------------------------------------------- the probe


def cuda_problem() -> str | None:
    """Why this paddle cannot run on a GPU (None when it was built with CUDA). Imports paddle."""
    import paddle

    if paddle.device.is_compiled_with_cuda():
        return None
    return (
        f"this paddle ({paddle.__version__}) was built without CUDA "
        "(paddle.device.is_compiled_with_cuda() is false): install a paddlepaddle-gpu build, "
        "or use --device cpu. Ketch's GPU path is written against paddle's documented GPU APIs "
        "but has never been run"
    )


@functools.cache
def probe_gpus(indices: tuple[int, ...]) -> tuple[GpuInfo, ...]:
    """Free and total memory and compute capability of GPUs ``indices`` (as CUDA numbers the
    visible devices). DeviceError when paddle has no CUDA or a GPU does not exist.

    The numbers come from a short-lived spawned process: CUDA initialised here would keep a
    context on every GPU for this process's lifetime, and its memory would count as used.
    Cached: the engine asks during its checks and again to size the KV cache."""
    problem = cuda_problem()
    if problem is not None:
        raise DeviceError(problem)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        found = pool.submit(_probe_here, indices).result(timeout=300)
    if isinstance(found, str):
        raise DeviceError(found)
    return found


def _probe_here(indices: tuple[int, ...]) -> tuple[GpuInfo, ...] | str:
    """Runs in the probe process. paddle.cuda.mem_get_info is cudaMemGetInfo (paddle 3.x docs);
    never run on a GPU."""
    import paddle

    count = paddle.device.cuda.device_count()
    missing = [i for i in indices if i >= count]
    if missing:
        return f"gpu:{missing[0]} does not exist: CUDA sees {count} GPU(s) here"
    out = []
    for index in indices:
        free, total = paddle.cuda.mem_get_info(index)
        major, minor = paddle.device.cuda.get_device_capability(index)
        name = paddle.device.cuda.get_device_name(index)
        out.append(GpuInfo(index, name, int(free), int(total), (int(major), int(minor))))
    return tuple(out)
