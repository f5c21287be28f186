"""How a pod's manifest is translated to run on this machine (see ``cluster.py``).

``localize`` makes an InferenceService CPU-sized; the rest rewrites what a pod reads: config
files, flags and paths, with each declared container port mapped to the pod's local port and
each Service name resolved as cluster DNS would (``resolve``, from the cluster).

Some port numbers are never listened on: the engine's loopback channels are Unix sockets and
its KV cache a ``/dev/shm`` segment, all named after ``--engine-worker-queue-port`` and
``--cache-queue-port`` (``LOOPBACK_PORTS``). In a pod those names are private (its own ``/tmp``
and ``/dev/shm``); here every pod shares the machine's ``/dev/shm``, so each pod gets its own
numbers for them too (``loopback_ports``), as for its container ports.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]
Resolve = Callable[[str], str]

# Config keys (and their --flags) whose numbers only name a pod's sockets and segments.
LOOPBACK_PORTS = ("engine_worker_queue_port", "cache_queue_port")


def localize(isvc: Obj, swap_space: str = "64Mi", kv_cache_memory: str = "128MiB") -> Obj:
    """The same InferenceService made to run on a CPU machine: the built-in tiny model, no GPUs,
    this machine's CPUs as each role's ``resources.cpu`` (the operator sizes the engine's
    threads from it; every pod here has the machine's cores), one tensor-parallel rank, the
    model's own context length, small KV cache and swap space. Everything else (roles,
    replicas, ports, router, auth, cache manager) is kept."""
    out = copy.deepcopy(isvc)
    spec = out["spec"]
    spec["model"]["uri"] = "tiny"
    engine = spec.setdefault("engine", {})
    for key in ("tensorParallelSize", "maxModelLen", "dtype", "numKvBlocks"):
        engine.pop(key, None)
    engine["kvCacheMemory"] = kv_cache_memory
    if engine.get("blockSize", 64) > 64:
        engine["blockSize"] = 64
    for role in spec.get("roles", {}).values():
        role.pop("scheduling", None)
        role.setdefault("resources", {}).update(gpus=0, cpu=str(len(os.sched_getaffinity(0))))
    if "cacheManager" in spec:
        spec["cacheManager"]["hostSwapSpace"] = swap_space
    return out


def loopback_ports(files: dict[str, str], argvs: list[list[str]]) -> set[int]:
    """The ``LOOPBACK_PORTS`` numbers a pod's config files (name -> text) and argv name."""
    found: set[int] = set()
    for key, text in files.items():
        if key.endswith((".yaml", ".yml", ".json")):
            data = yaml.safe_load(text)  # JSON is YAML
            if isinstance(data, dict):
                found |= {v for k, v in data.items() if k in LOOPBACK_PORTS and _is_port(v)}
    flags = {"--" + key.replace("_", "-") for key in LOOPBACK_PORTS}
    for argv in argvs:
        for before, arg in zip(["", *argv], argv, strict=False):
            flag, eq, value = arg.partition("=")
            if eq and flag in flags and value.isdigit():
                found.add(int(value))
            elif before in flags and arg.isdigit():
                found.add(int(arg))
    return found


def _is_port(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def localize_file(
    key: str, text: str, ports: dict[int, int], mounts: list[tuple[str, Path]], resolve: Resolve
) -> str:
    """A mounted ConfigMap file as this pod reads it (YAML/JSON are rewritten, rest as is)."""
    if key.endswith((".yaml", ".yml")):
        return yaml.safe_dump(_localize_value(yaml.safe_load(text), ports, mounts, resolve))
    if key.endswith(".json"):
        return json.dumps(_localize_value(json.loads(text), ports, mounts, resolve))
    return text


def _localize_value(
    value: Any,
    ports: dict[int, int],
    mounts: list[tuple[str, Path]],
    resolve: Resolve,
    key: str = "",
) -> Any:
    if isinstance(value, dict):
        return {k: _localize_value(v, ports, mounts, resolve, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_localize_value(v, ports, mounts, resolve, key) for v in value]
    if isinstance(value, int) and key.lower().endswith("port") and value in ports:
        return ports[value]
    if isinstance(value, str):
        return resolve(local_path(value, mounts))
    return value


def local_path(value: str, mounts: list[tuple[str, Path]]) -> str:
    """A path under a volume mount, as it is on this machine (longest mount first)."""
    for mount, path in mounts:
        if value == mount or value.startswith(mount.rstrip("/") + "/"):
            return str(path) + value[len(mount) :]
    return value


def localize_args(argv: list[str], ports: dict[int, int]) -> list[str]:
    """``--something-port N`` (or ``=N``) with a declared container port N -> its local port."""
    out: list[str] = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if eq and flag.startswith("--") and flag.endswith("port") and value.isdigit():
            arg = f"{flag}={ports.get(int(value), int(value))}"
        elif out and out[-1].startswith("--") and out[-1].endswith("port") and arg.isdigit():
            arg = str(ports.get(int(arg), int(arg)))
        out.append(arg)
    return out
