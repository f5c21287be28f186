"""Each rendered ``ketch serve``'s engine configuration vs what this engine build runs.

The configuration is the one the process would build (its role file from the ConfigMap, then its
flags); the pod gives the rest: the GPUs and CPUs in the container's resources and the sizeLimit
of the ``/dev/shm`` volume it mounts. ``ketch.operator.runnable`` says what the engine would refuse,
naming each value by the InferenceService field it was rendered from, or by the flag in the
container's args when a flag set it.
"""

from __future__ import annotations

from pathlib import Path

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
        return runnable.spec_field(setting, role)

    found = runnable.problems(
        config,
        role=role,
        gpus=gpu_count(proc.container),
        shm_size=shm,
        cpu=cpu_limit(proc.container),
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
