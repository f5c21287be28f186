"""Deployments, per pod role: ``N-<role>`` runs the engine pods (engine container, cache-manager
sidecar unless disabled, memory-backed ``/dev/shm``; the containers come from ``containers``),
``N-router`` the router (with a gateway also its endpoint picker: ``--epp-port``).

Applied after the config, policy and Services the pods use, before the autoscalers that target
them. The pod templates and the replica hand-over are in ``pods`` and ``handoff``.
"""

from __future__ import annotations

from ketch.operator import gateway
from ketch.operator.children import handoff
from ketch.operator.children.configmap import config_hash, role_config, router_config
from ketch.operator.children.kind import ChildKind, Obj
from ketch.operator.children.pods import engine_pod, pod_security
from ketch.operator.containers import (
    PRESTOP_SLEEP,
    container_security,
    home_env,
    http_probe,
    tmp_mount,
)
from ketch.operator.labels import ANNOTATION_CONFIG_HASH
from ketch.operator.objects import labels, metadata, selector
from ketch.operator.pod_layout import CONFIG_DIR
from ketch.operator.port_names import EPP_PORT_NAME
from ketch.operator.spec.model import ServiceSpec


def deployment(svc: ServiceSpec, role: str, template: Obj, replicas: int | None) -> Obj:
    spec: Obj = {}
    if replicas is not None:  # left out when an autoscaler owns the replica count
        spec["replicas"] = replicas
    spec.update(
        {
            "selector": {"matchLabels": selector(svc, role)},
            # New pods come up before old ones go: no capacity dip while a rollout runs.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": 1800,
            "template": template,
        }
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(svc, f"{svc.name}-{role}", labels(svc, role)),
        "spec": spec,
    }


def engine_deployment(svc: ServiceSpec, role: str) -> Obj:
    role_spec = svc.role(role)
    replicas = None if role_spec.get("autoscaling") else role_spec["replicas"]
    template = engine_pod(svc, role, role_config(svc, role))
    return deployment(svc, role, template, replicas)


def router_deployment(svc: ServiceSpec) -> Obj:
    text = router_config(svc)
    args = ["--config", f"{CONFIG_DIR}/router.yaml"]
    ports = [{"name": "http", "containerPort": svc.ports["http"], "protocol": "TCP"}]
    readiness = http_probe("/ready", 5, 2)
    if gateway.router_picks(svc):  # the gateway's endpoint picker: gRPC ext_proc
        epp = gateway.epp_port(svc)
        args += ["--epp-port", str(epp)]
        ports.append({"name": EPP_PORT_NAME, "containerPort": epp, "protocol": "TCP"})
        # The node agent runs no grpc probes; the picker's port taking connections it can see.
        readiness = {
            "tcpSocket": {"port": EPP_PORT_NAME},
            "periodSeconds": 5,
            "failureThreshold": 2,
        }
    container = {
        "name": "router",
        "image": svc.spec["engine"]["image"],
        "imagePullPolicy": svc.spec["engine"]["imagePullPolicy"],
        "command": ["ketch", "router"],
        "args": args,
        "ports": ports,
        "env": [home_env()],
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            tmp_mount(),
        ],
        "readinessProbe": readiness,
        "livenessProbe": http_probe("/health", 10, 3),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP}}},
        "securityContext": container_security(),
    }
    template = {
        "metadata": {
            "labels": labels(svc, "router"),
            "annotations": {ANNOTATION_CONFIG_HASH: config_hash(text)},
        },
        "spec": {
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": pod_security(),
            "containers": [container],
            "volumes": [
                {"name": "config", "configMap": {"name": f"{svc.name}-config"}},
                {"name": "tmp", "emptyDir": {}},
            ],
        },
    }
    return deployment(svc, "router", template, svc.spec["router"]["replicas"])


def scale_target(svc: ServiceSpec, role: str) -> Obj:
    """How an autoscaler names the role's Deployment (``scaleTargetRef``)."""
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{svc.name}-{role}"}


def build(svc: ServiceSpec, role: str | None) -> list[Obj]:
    assert role is not None
    return [router_deployment(svc) if role == "router" else engine_deployment(svc, role)]


KIND = ChildKind(
    kind="Deployment",
    api_version="apps/v1",
    plural="deployments",
    build=build,
    stage=1,
    per_role=True,
    # Status reads each Deployment; until the watch has shown it (a restarted operator whose
    # Deployment watch has not listed yet), from the apply's answer: a restart never reports it
    # missing.
    keeps_answer=True,
    prepare=handoff.prepare,
)
