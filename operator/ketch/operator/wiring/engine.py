"""Each rendered ``ketch serve``'s engine configuration vs what this engine build runs.

The configuration is the one the process would build (its role file from the ConfigMap, then its
flags); the pod gives the rest: the GPUs and CPUs in the container's resources and the sizeLimit
of the ``/dev/shm`` volume it mounts. ``ketch.operator.runnable`` says what the engine would refuse,
naming each value by the InferenceService field it was rendered from, or by the flag in the
container's args when a flag set it. ``check_kv_pair``: a disaggregated InferenceService's
prefill and decode engines hold their KV caches in one dtype (prefill's blocks go to decode as
they are).
"""

from __future__ import annotations

from pathlib import Path

from ketch.engine import device as dev
from ketch.engine.capabilities import cpu_dtypes, refusals
from ketch.engine.cli_args import flag_name
from ketch.engine.config import EngineConfig
from ketch.engine.errors import ModelLoadError
from ketch.engine.models.config import ModelConfig
from ketch.engine.serving.config import ServerConfig
from ketch.operator import runnable
from ketch.operator.wiring.pods import Obj, Pod, Process

SHM = "/dev/shm"
RUNTIME_SHM = "64Mi"  # a pod's /dev/shm when no volume is mounted there


def check_engine(proc: Process, pod: Pod, model_dir: Path | None = None) -> list[str]:
    """What ``ketch serve`` in ``proc`` would refuse to run, or run without the GPUs it holds.
    ``model_dir``: a local copy of the checkpoint (its config.json), whose architecture and
    fields are checked as the engine checks them at load, at the context the role serves."""
    config = proc.config(EngineConfig)
    model = None
    if model_dir is not None:
        try:
            model = ModelConfig.from_dir(model_dir, context_len=config.max_model_len)
        except ModelLoadError as exc:
            return [f"{proc.where}: spec.model: {exc}"]
    role = proc.config(ServerConfig).role
    shm = shm_size_limit(proc.container, pod)
    mounted = any(m["mountPath"] == SHM for m in proc.container.get("volumeMounts") or [])

    def named(setting: str) -> str:
        if setting == "shm_size" and not mounted:
            return "the runtime's default /dev/shm (no volume mounted there)"
        if getattr(proc.args, setting, None) is not None:
            return f"{flag_name(setting)} (container args)"
        field = runnable.spec_field(setting, role)
        # a setting no spec field sets (backend): the role file's, which a hand edit set
        return field if field.startswith("spec.") else f"{setting} ({proc.source})"

    found = runnable.problems(
        config,
        role=role,
        gpus=gpu_count(proc.container),
        shm_size=shm,
        cpu=cpu_limit(proc.container),
        memory=memory_limit(proc.container),
        named=named,
        model=model,
    )
    return [f"{proc.where}: {problem}" for problem in found]


def gpu_count(container: Obj) -> int:
    """GPUs the container asks for: its extended resources named like GPUs (nvidia.com/gpu,
    amd.com/gpu, gpu.intel.com/i915, ...), limits over requests as the scheduler reads them."""
    resources = container.get("resources") or {}
    asked = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
    return sum(
        int(float(value))
        for name, value in asked.items()
        if "/" in name and "gpu" in name.lower() and str(value).replace(".", "", 1).isdigit()
    )


def cpu_limit(container: Obj) -> str | None:
    """The container's CPU limit, else its request (what the ranks' threads share)."""
    resources = container.get("resources") or {}
    for key in ("limits", "requests"):
        value = (resources.get(key) or {}).get("cpu")
        if value is not None:
            return str(value)
    return None


def memory_limit(container: Obj) -> str | None:
    """The container's memory limit (what it is OOM-killed above; a request alone is not)."""
    value = ((container.get("resources") or {}).get("limits") or {}).get("memory")
    return None if value is None else str(value)


def shm_size_limit(container: Obj, pod: Pod) -> str | None:
    """What the container's /dev/shm holds: the sizeLimit of the emptyDir mounted there (None:
    unlimited, or not an emptyDir), or the runtime's 64Mi when nothing is mounted there."""
    mount = next((m for m in container.get("volumeMounts") or [] if m["mountPath"] == SHM), None)
    if mount is None:
        return RUNTIME_SHM
    volumes = {v.get("name"): v for v in pod.spec.get("volumes") or []}
    empty_dir = (volumes.get(mount["name"]) or {}).get("emptyDir") or {}
    limit = empty_dir.get("sizeLimit")
    return None if limit is None else str(limit)


def check_kv_pair(pods: list[Pod], model_dir: Path | None = None) -> list[str]:
    """Prefill engines send their KV blocks to decode engines as they are, never converted (the
    prefill instance refuses a decode instance of another KV dtype): every prefill and decode
    ``ketch serve`` must resolve its KV cache to the same dtype. ``kv_cache_dtype`` ``auto``
    follows the weight dtype, whose ``auto`` follows the checkpoint (bfloat16 for one saved in
    bfloat16 on the native backend): with the checkpoint unknown both cases are checked."""
    ends: dict[str, list[Process]] = {"prefill": [], "decode": []}
    for pod in pods:
        for proc in pod.processes:
            if proc.command == "serve" and not proc.init:
                role = proc.config(ServerConfig).role
                if role in ends:
                    ends[role].append(proc)
    if not ends["prefill"] or not ends["decode"]:
        return []
    for saved in (None, "bfloat16"):
        found = {}
        for role, procs in ends.items():
            for proc in procs:
                kv = _kv_dtype(proc, model_dir, saved)
                if kv is not None:
                    found.setdefault(role, (proc, kv))
                    if kv != found[role][1]:
                        return [_kv_mismatch(found[role], (proc, kv), role, role, model_dir, saved)]
        if len(found) == 2 and found["prefill"][1] != found["decode"][1]:
            return [
                _kv_mismatch(
                    found["prefill"], found["decode"], "prefill", "decode", model_dir, saved
                )
            ]
    return []


def _kv_dtype(proc: Process, model_dir: Path | None, saved: str | None) -> str | None:
    """The KV dtype ``proc``'s engine would use for a checkpoint saved in ``saved`` (the known
    model's own dtype when there is one); None on a GPU, or for settings or a checkpoint the
    engine refuses (an engine that never starts pairs with nothing; check_engine reports it)."""
    config = proc.config(EngineConfig)
    if dev.parse_device(config.device).is_gpu:
        return None
    model = runnable.known_model(config.model)
    if model_dir is not None:
        try:
            model = ModelConfig.from_dir(model_dir, context_len=config.max_model_len)
        except ModelLoadError:
            return None
    if refusals(config, model=model):
        return None
    return cpu_dtypes(config, model.torch_dtype if model is not None else saved)[1]


def _kv_mismatch(one, other, role_one: str, role_other: str, model_dir, saved) -> str:
    def how(proc: Process, role: str, kv: str) -> str:
        config = proc.config(EngineConfig)

        def source(setting: str) -> str:
            if getattr(proc.args, setting, None) is not None:
                return f"{flag_name(setting)} (container args)"
            return f"{runnable.spec_field(setting, role)} ({proc.source})"

        why = f"{source('kv_cache_dtype')}: {config.kv_cache_dtype}"
        if config.kv_cache_dtype == "auto":
            why += f", the weights' dtype: {source('dtype')}: {config.dtype}"
        return f"{kv} on {role} ({why})"

    (p1, kv1), (p2, kv2) = one, other
    checkpoint = ""
    if model_dir is None and runnable.known_model(p1.config(EngineConfig).model) is None:
        checkpoint = f" with a checkpoint saved in {saved or 'float32'}"
    return (
        f"{p1.where} and {p2.where}: the KV caches of prefill and decode differ{checkpoint}: "
        f"{how(p1, role_one, kv1)}, {how(p2, role_other, kv2)}: prefill sends its KV blocks to "
        "decode as they are, never converted, so every request would be refused with a KV "
        "cache dtype mismatch; "
        "set spec.engine.kvCacheDtype (one value, which every role's file takes) and leave "
        "--kv-cache-dtype and --dtype out of the containers' args"
    )
