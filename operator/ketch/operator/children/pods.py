"""The engine pod template of a role's Deployment: its containers (from ``containers``), volumes,
security context, scheduling and the annotations that roll it when its config changes."""

from __future__ import annotations

from ketch.operator.children.configmap import config_hash
from ketch.operator.children.kind import Obj
from ketch.operator.containers import (
    PRESTOP_SLEEP,
    cache_manager_container,
    engine_container,
    model_fetch_container,
    model_volume,
    needs_model_volume,
)
from ketch.operator.labels import ANNOTATION_CONFIG_HASH
from ketch.operator.objects import labels
from ketch.operator.pod_layout import API_KEY_PATH, PEER_KEY_PATH, PEER_KEY_VOLUME
from ketch.operator.quantity import canonical
from ketch.operator.spec.model import ServiceSpec

RUN_AS_USER = 1000


def pod_security() -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def engine_pod(svc: ServiceSpec, role: str, config_text: str) -> Obj:
    role_spec = svc.role(role)
    containers = [engine_container(svc, role)]
    if svc.spec["cacheManager"]["enabled"]:
        containers.append(cache_manager_container(svc, role))
    pod_spec: Obj = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(),
        "terminationGracePeriodSeconds": int(svc.spec["engine"]["drainTimeout"])
        + PRESTOP_SLEEP
        + 10,
    }
    if svc.spec["model"]["uri"].split("://", 1)[0] in ("hf", "s3"):
        pod_spec["initContainers"] = [model_fetch_container(svc)]
    pod_spec["containers"] = containers
    pod_spec["volumes"] = _volumes(svc, role)
    _add_scheduling(pod_spec, role_spec.get("scheduling", {}))
    annotations = {
        ANNOTATION_CONFIG_HASH: config_hash(config_text),
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(svc.ports.get("metrics") or svc.ports["http"]),
        "prometheus.io/path": "/metrics",
    }
    return {
        "metadata": {"labels": labels(svc, role), "annotations": annotations},
        "spec": pod_spec,
    }


def _volumes(svc: ServiceSpec, role: str) -> list[Obj]:
    volumes: list[Obj] = [
        {"name": "config", "configMap": {"name": f"{svc.name}-config"}},
        {
            "name": "dshm",
            "emptyDir": {"medium": "Memory", "sizeLimit": canonical(svc.spec["engine"]["shmSize"])},
        },
        {"name": "tmp", "emptyDir": {}},
    ]
    if needs_model_volume(svc):
        volumes.append(model_volume(svc))
    auth = svc.spec.get("auth", {}).get("apiKeySecretRef")
    if auth:
        volumes.append(_secret_volume("api-key", auth, API_KEY_PATH))
    peer = svc.spec.get("auth", {}).get("peerKeySecretRef")
    if peer and role != "mixed":
        volumes.append(_secret_volume(PEER_KEY_VOLUME, peer, PEER_KEY_PATH))
    return volumes


def _secret_volume(name: str, ref: Obj, path: str) -> Obj:
    """One key of a Secret, as the file ``path`` names (its directory is the mount)."""
    key_file = path.rsplit("/", 1)[1]
    return {
        "name": name,
        "secret": {"secretName": ref["name"], "items": [{"key": ref["key"], "path": key_file}]},
    }


def _add_scheduling(pod_spec: Obj, scheduling: Obj) -> None:
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        if scheduling.get(key):
            pod_spec[key] = scheduling[key]
