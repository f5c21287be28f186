"""A static check that rendered children are wired to what their ``ketch`` processes do.

``check_wiring(children)`` reads every pod template's ``ketch`` containers the way the process
would (``pods``): their command and args through the real ``ketch`` argument parser, their
``--config`` file from the rendered ConfigMap mounted at that path, then the real config
dataclasses. It compares what each process listens on with the containers' declared ports,
probes and Services (``ports``) and the router's settings (``router``), and checks each engine's
configuration against what this engine build runs (``engine``: what ``ketch serve`` would
refuse at start-up, named by the InferenceService field it was rendered from; and that prefill
and decode hold their KV caches in one dtype, ``check_kv_pair``). No paddle: only
``ketch`` config and argparse-level modules are imported.
"""

from __future__ import annotations

from pathlib import Path

from ketch.operator.wiring.engine import check_engine, check_kv_pair
from ketch.operator.wiring.pods import Obj, WiringError, read_pods
from ketch.operator.wiring.ports import check_pod, check_ports, check_service
from ketch.operator.wiring.router import check_router

__all__ = ["WiringError", "check_wiring"]


def check_wiring(children: list[Obj], model_dir: Path | None = None) -> list[str]:
    """Problems with how ``children`` (one InferenceService's, rendered) are wired; [] when fine.
    ``model_dir``: a local copy of the served checkpoint, checked against each engine."""
    problems: list[str] = []
    pods = read_pods(children, problems)
    services = [o for o in children if o["kind"] == "Service"]
    for pod in pods:
        for proc in pod.processes:
            problems += check_ports(proc)
            if proc.command == "serve" and not proc.init:
                problems += check_engine(proc, pod, model_dir)
        problems += check_pod(pod)
    problems += check_kv_pair(pods, model_dir)
    for svc in services:
        problems += check_service(svc, pods)
    for pod in pods:
        for proc in pod.processes:
            if proc.command == "router":
                problems += check_router(proc, pod, pods, services)
    return problems
