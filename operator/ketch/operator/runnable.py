"""Whether this engine build can run what an InferenceService asks, in the spec's own words.

The engine refuses some settings only at start-up (``ketch.engine.capabilities``): a dtype or a
tensor-parallel size it does not run (float16 on the CPU; bfloat16, a bfloat16 KV cache or int8
weights on a backend without them), GPUs it cannot use, and, for a model whose facts are known
without its checkpoint (the built-in ``tiny``, or a config.json given to ``check-wiring
--model-config``), a ``max_model_len``, KV cache or tensor-parallel size it cannot honour. The
rest are the pod's: the KV cache is a segment in the pod's memory-backed ``/dev/shm``, so it must
fit ``engine.shmSize`` (its bytes at its dtype); where the model's facts are known, the engine
container's memory limit must hold the weights at the chosen precision, that KV cache and a
headroom (``cpu_sizing.cpu_memory``); a GPU pod holds one GPU per tensor-parallel rank; the
worker processes of a CPU pod need a CPU each. A pod with any of these would crash-loop or
stall, so the operator refuses the spec (``spec.parse``: ``InvalidSpec``, then ``Degraded``) and
``check-wiring`` reports the rendered pod; both go through ``problems``, so they say the same
thing.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from ketch.engine import device as dev
from ketch.engine.capabilities import kv_cache_bytes, precision_backend_refusal, refusals
from ketch.engine.cli_args import flag_name
from ketch.engine.config import EngineConfig
from ketch.engine.cpu_sizing import cpu_memory
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.paths import TINY_MODEL_DIR
from ketch.kernels.collective import ShmGroup
from ketch.operator.crd import engine_fields
from ketch.operator.quantity import QuantityError, parse

_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)(m|k|Ki|M|Mi|G|Gi|T|Ti)?")
_UNITS = {
    None: 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


@functools.cache
def _tiny() -> ModelConfig:
    return ModelConfig.from_dir(TINY_MODEL_DIR)


def known_model(model: str) -> ModelConfig | None:
    """The facts of ``model`` (the config-file value) when known here: the built-in tiny model's.
    A checkpoint's are read by the engine at start-up, after the pod is scheduled."""
    return _tiny() if model == "tiny" else None


def spec_field(setting: str, role: str) -> str:
    """The InferenceService field that sets ``setting`` for ``role``'s pods."""
    if setting in ("gpus", "cpu", "memory"):
        return f"spec.roles.{role}.resources.{setting}"
    if setting == "shm_size":
        return "spec.engine.shmSize"
    return engine_fields.flag_source(flag_name(setting)) or setting


def quantity_bytes(quantity: str) -> int | None:
    """A Kubernetes quantity ('2Gi', '512M', '1.5Gi') in bytes; None if it is none of those."""
    match = _QUANTITY.fullmatch(str(quantity).strip())
    if not match:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def problems(
    config: EngineConfig,
    *,
    role: str,
    gpus: int,
    shm_size: str | None,
    cpu: str | None = None,
    memory: str | None = None,
    named: Callable[[str], str] | None = None,
    model: ModelConfig | None = None,
) -> list[str]:
    """``"<field>: <value>: <why>"`` for each reason ``role``'s pods could not run ``config``.

    ``gpus``: the GPUs each pod gets; ``shm_size``: the sizeLimit of its ``/dev/shm`` (None:
    unlimited); ``cpu``: the engine container's CPU limit (None: none); ``memory``: its memory
    limit (None: none). ``named(setting)`` names where a setting came from (default: the spec
    field). ``model``: the checkpoint's facts when the caller has read them (default: the
    built-in tiny model's, else none)."""
    name = named or (lambda setting: spec_field(setting, role))
    model = model or known_model(config.model)
    found = refusals(config, model=model, gpus=gpus)
    out = [problem for r in found for problem in _refusal_problems(config, model, r, name)]
    ranks = _rank_problems(config, gpus, cpu, name)
    out += ranks
    limit = quantity_bytes(shm_size) if shm_size is not None else None
    if limit is not None:
        out += _shm_problems(config, model, shm_size, limit, name)
    runs = not found and not ranks and gpus == 0
    if runs and memory is not None and model is not None:
        out += _memory_problems(config, model, memory, name)
    return out


def _refusal_problems(
    config: EngineConfig, model: ModelConfig | None, refusal, name: Callable[[str], str]
) -> list[str]:
    """The engine's refusal as the spec's problems. A backend that cannot run the precision
    settings is named by each of those settings (the fields one sets in a spec; the backend is
    not one), with where the backend came from; every other refusal by its own setting."""
    if refusal.setting == "backend" and refusal == precision_backend_refusal(config, model):
        fields = [
            f for f in ("dtype", "kv_cache_dtype", "quantization")
            if getattr(config, f) not in ("auto", "float32", "none")
        ] or ["dtype"]  # fmt: skip
        return [
            f"{name(f)}: {getattr(config, f)}: {refusal.reason} (the backend, "
            f"{config.backend}, is set by {name('backend')})"
            for f in fields
        ]
    return [f"{name(refusal.setting)}: {refusal.value}: {refusal.reason}"]


def cpu_count(cpu: str | None) -> float | None:
    """A CPU quantity ('2', '500m', '1.5') as a number of CPUs; None if none or not one."""
    if cpu is None:
        return None
    try:
        return float(parse(str(cpu))[0])
    except QuantityError:
        return None


def threads_per_rank(cpu: str, tensor_parallel_size: int) -> int:
    """The model threads of each worker process in a CPU pod with ``cpu`` CPUs: the whole CPUs
    but one (the API server and the engine process need it, as under ``ketch serve``'s own
    default), shared by the ranks; at least 1. The engine cannot see the pod's limit itself:
    the CPU affinity it reads is the node's every core, which a CFS quota then throttles."""
    whole = int(cpu_count(cpu) or 0)
    return max(1, (whole - 1) // tensor_parallel_size)


def _rank_problems(
    config: EngineConfig, gpus: int, cpu: str | None, name: Callable[[str], str]
) -> list[str]:
    """One GPU per rank in a GPU pod; a CPU per worker process in a CPU pod."""
    tp = config.tensor_parallel_size
    if gpus > 0 and tp != gpus:
        return [
            f"{name('tensor_parallel_size')}: {tp}: must equal {name('gpus')} ({gpus}) when "
            "that is above 0: one GPU per tensor-parallel rank"
        ]
    cpus = cpu_count(cpu)
    if gpus == 0 and tp > 1 and cpus is not None and cpus < tp:
        return [
            f"{name('cpu')}: {cpu}: {tp} tensor-parallel ranks ({name('tensor_parallel_size')}) "
            f"need at least {tp} CPUs, one per worker process: the ranks meet in an all_reduce "
            "in every layer, so one waiting for CPU time stalls them all"
        ]
    return []


def _shm_problems(
    config: EngineConfig,
    model: ModelConfig | None,
    shm_size: str,
    limit: int,
    name: Callable[[str], str],
) -> list[str]:
    """The KV cache is a segment in /dev/shm: it must fit there (the worker writes all of it
    before the engine is ready), beside the tensor-parallel ranks' collectives segment."""
    if model is not None:
        size = kv_cache_bytes(config, model)
    elif config.num_kv_blocks is None:
        size = config.kv_cache_bytes  # the segment is at most this (whole blocks of it)
    else:
        return []  # blocks of a checkpoint whose size is not known here
    tp = config.tensor_parallel_size
    group = ShmGroup.nbytes(tp) if tp > 1 else 0
    if size + group <= limit:
        return []
    setting = "kv_cache_memory" if config.num_kv_blocks is None else "num_kv_blocks"
    beside = f" and the {tp} ranks' collectives segment ({group} bytes)" if group else ""
    return [
        f"{name(setting)}: {getattr(config, setting)}: the KV cache ({size} bytes) is a segment "
        f"in the pod's /dev/shm{beside}, which {name('shm_size')} {shm_size} ({limit} bytes) "
        "cannot hold: the engine would fail as it fills it at start-up; raise the one or lower "
        "the other"
    ]


def _memory_problems(
    config: EngineConfig, model: ModelConfig, memory: str, name: Callable[[str], str]
) -> list[str]:
    """The engine container's memory limit must hold the weights at the chosen precision, the
    KV cache at its dtype (its /dev/shm segment is memory-backed: the kernel charges it to the
    container that writes it), the ranks' collectives segment and a headroom
    (``ketch.engine.cpu_sizing.cpu_memory``), or the pod is OOM-killed as it loads or fills
    the cache."""
    limit = quantity_bytes(memory)
    if limit is None or dev.parse_device(config.device).is_gpu:
        return []
    plan = cpu_memory(config, model)
    tp = config.tensor_parallel_size
    group = ShmGroup.nbytes(tp) if tp > 1 else 0
    needed = plan.total + group
    if needed <= limit:
        return []
    beside = (
        f" + the {tp} ranks' collectives segment {group} bytes = {needed} bytes" if group else ""
    )
    kv = "kv_cache_memory" if config.num_kv_blocks is None else "num_kv_blocks"
    lower = [f"lower {name(kv)}"]
    if plan.weight_dtype == "float32":
        lower.append(f"store the weights in bfloat16 ({name('dtype')})")
    if config.quantization == "none":
        lower.append(f"quantize the linear layers to int8 ({name('quantization')})")
    if plan.kv_cache_dtype == "float32" and config.num_kv_blocks is not None:
        lower.append(f"hold the KV cache in bfloat16 ({name('kv_cache_dtype')})")
    return [
        f"{name('memory')}: {memory}: the engine container needs {plan}{beside}, more than "
        f"its memory limit ({limit} bytes): it would be OOM-killed as it loads the weights or "
        f"fills the KV cache (its /dev/shm segment counts against the limit); raise "
        f"{name('memory')}, or {', or '.join(lower)}"
    ]
