"""Pure builders: a validated InferenceService -> the child objects the operator applies.

No I/O and no clock: the same spec always gives byte-identical children, which is what lets
``ketch-operator render`` show exactly what the running operator applies, and lets a re-apply be a
no-op on the server. Children, per InferenceService ``N``:

- ConfigMap ``N-config``: one ``ketch serve`` config file per role (``<role>.yaml``) and the
  router's (``router.yaml``) when disaggregated.
- Per role: Deployment ``N-<role>`` (engine container, cache-manager sidecar unless disabled,
  memory-backed ``/dev/shm``; the containers come from ``containers``), Service ``N-<role>``
  (API), headless Service ``N-<role>-peers`` (peer discovery), PodDisruptionBudget ``N-<role>``.
- Per autoscaled role: HorizontalPodAutoscaler ``N-<role>`` (mode ``hpa``, the default) or KEDA
  ScaledObject ``N-<role>`` (mode ``keda``), targeting Deployment ``N-<role>`` (built by
  ``autoscaling.autoscalers``).
- Disaggregated, or with ``spec.gateway``: Deployment, Service and PodDisruptionBudget
  ``N-router`` (with a gateway the router is also its endpoint picker: ``--epp-port``, Service
  port ``grpc-epp``).
- With ``spec.gateway``: InferencePool ``N`` and, with ``gatewayRef``, HTTPRoute ``N``
  (``gateway``).
- NetworkPolicy ``N``: the API, metrics and sidecar HTTP ports open; pd-comm and kv-transfer
  only from the InferenceService's own pods; no other port.
"""

from __future__ import annotations

import hashlib

from ketch.operator import gateway
from ketch.operator.autoscaling.autoscalers import autoscaler
from ketch.operator.containers import (
    PRESTOP_SLEEP,
    cache_manager_container,
    container_security,
    engine_container,
    home_env,
    http_probe,
    model_fetch_container,
    model_volume,
    needs_model_volume,
    tmp_mount,
)
from ketch.operator.labels import ANNOTATION_CONFIG_HASH, LABEL_INSTANCE, LABEL_MANAGED_BY, MANAGER
from ketch.operator.objects import Obj, instance_labels, labels, metadata, selector
from ketch.operator.pod_layout import API_KEY_PATH, CONFIG_DIR, PEER_KEY_PATH, PEER_KEY_VOLUME
from ketch.operator.port_names import (
    EPP_APP_PROTOCOL,
    EPP_PORT_NAME,
    PORT_HTTP,
    PORT_KV_TRANSFER,
    PORT_PD_COMM,
)
from ketch.operator.quantity import canonical
from ketch.operator.spec.engine_config import role_settings
from ketch.operator.spec.model import ServiceSpec
from ketch.operator.yaml_text import dump_yaml

RUN_AS_USER = 1000


# --------------------------------------------------------------------------- config


def role_config(svc: ServiceSpec, role: str) -> str:
    return dump_yaml(role_settings(svc, role))


def has_router(svc: ServiceSpec) -> bool:
    """Disaggregated serving needs the router; so does a gateway (its endpoint picker)."""
    return svc.disaggregated or gateway.router_picks(svc)


def router_config(svc: ServiceSpec) -> str:
    ports = svc.ports
    domain = f"{svc.namespace}.svc"
    values: Obj = {"port": ports["http"], "policy": svc.spec["router"]["policy"]}
    if svc.disaggregated:
        values["prefill"] = f"{svc.name}-prefill-peers.{domain}"
        values["decode"] = f"{svc.name}-decode-peers.{domain}"
    else:
        values["mixed"] = f"{svc.name}-mixed-peers.{domain}"
    values["engine_port"] = ports["http"]
    if svc.disaggregated:
        values["pd_comm_port"] = ports["pdComm"]
    return dump_yaml(values)


def config_map(svc: ServiceSpec, configs: dict[str, str]) -> Obj:
    data = {f"{role}.yaml": configs[role] for role in svc.roles}
    if has_router(svc):
        data["router.yaml"] = router_config(svc)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(svc, f"{svc.name}-config", instance_labels(svc)),
        "data": data,
    }


def config_hash(*texts: str) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


# --------------------------------------------------------------------------- pods


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
        key_file = API_KEY_PATH.rsplit("/", 1)[1]
        volumes.append(
            {
                "name": "api-key",
                "secret": {
                    "secretName": auth["name"],
                    "items": [{"key": auth["key"], "path": key_file}],
                },
            }
        )
    peer = svc.spec.get("auth", {}).get("peerKeySecretRef")
    if peer and role != "mixed":
        key_file = PEER_KEY_PATH.rsplit("/", 1)[1]
        volumes.append(
            {
                "name": PEER_KEY_VOLUME,
                "secret": {
                    "secretName": peer["name"],
                    "items": [{"key": peer["key"], "path": key_file}],
                },
            }
        )
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
    pod_spec["volumes"] = volumes
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


def _add_scheduling(pod_spec: Obj, scheduling: Obj) -> None:
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        if scheduling.get(key):
            pod_spec[key] = scheduling[key]


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


def engine_deployment(svc: ServiceSpec, role: str, config_text: str) -> Obj:
    role_spec = svc.role(role)
    replicas = None if role_spec.get("autoscaling") else role_spec["replicas"]
    template = engine_pod(svc, role, config_text)
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


# --------------------------------------------------------------------------- networking


def _service_port(name: str, port: int) -> Obj:
    return {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}


def api_service(svc: ServiceSpec, role: str) -> Obj:
    ports = [_service_port("http", svc.ports["http"])]
    if svc.ports.get("metrics") is not None and role != "router":
        ports.append(_service_port("metrics", svc.ports["metrics"]))
    if role == "router" and gateway.router_picks(svc):
        epp = _service_port(EPP_PORT_NAME, gateway.epp_port(svc))
        ports.append({**epp, "appProtocol": EPP_APP_PROTOCOL})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(svc, f"{svc.name}-{role}", labels(svc, role)),
        "spec": {"type": "ClusterIP", "selector": selector(svc, role), "ports": ports},
    }


def peers_service(svc: ServiceSpec, role: str) -> Obj:
    """Headless: DNS lists every pod of the role, ready or not, for the router and peers.

    Prefill/decode roles also name their pd-comm port (decode engines connect to prefill
    engines) and their sidecars' kv-transfer port (prefill sidecars push KV blocks to decode
    sidecars), so SRV records find both.
    """
    ports = [_service_port(PORT_HTTP, svc.ports["http"])]
    if role != "mixed":
        ports.append(_service_port(PORT_PD_COMM, svc.ports["pdComm"]))
        if svc.spec["cacheManager"]["enabled"]:
            ports.append(_service_port(PORT_KV_TRANSFER, svc.ports["kvTransfer"]))
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(svc, f"{svc.name}-{role}-peers", labels(svc, role)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector(svc, role),
            "ports": ports,
        },
    }


def disruption_budget(svc: ServiceSpec, role: str) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(svc, f"{svc.name}-{role}", labels(svc, role)),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(svc, role)}},
    }


def network_policy(svc: ServiceSpec) -> Obj:
    """Ingress to the InferenceService's pods: the API, metrics and cache-manager HTTP ports are
    open; the pod-to-pod ports of disaggregated serving (pd-comm, kv-transfer) only to this
    InferenceService's own pods; nothing else (the worker and cache queues are Unix sockets).
    """
    pods = {"matchLabels": {LABEL_INSTANCE: svc.name, LABEL_MANAGED_BY: MANAGER}}
    ports = svc.ports
    cache_manager = svc.spec["cacheManager"]["enabled"]
    public = [_policy_port(ports["http"])]
    if ports.get("metrics") is not None:
        public.append(_policy_port(ports["metrics"]))
    if cache_manager:  # the sidecar's /health and /metrics, like the engine's
        public.append(_policy_port(ports["cacheManager"]))
    if gateway.router_picks(svc):  # the gateway's proxies call the router's endpoint picker
        public.append(_policy_port(gateway.epp_port(svc)))
    ingress: list[Obj] = []
    if svc.disaggregated:  # decode -> prefill pd-comm; prefill sidecar -> decode kv-transfer
        internal = [_policy_port(ports["pdComm"])]
        if cache_manager:
            internal.append(_policy_port(ports["kvTransfer"]))
        ingress.append({"from": [{"podSelector": pods}], "ports": internal})
    ingress.append({"ports": public})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(svc, svc.name, instance_labels(svc)),
        "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _policy_port(port: int) -> Obj:
    return {"port": port, "protocol": "TCP"}


# --------------------------------------------------------------------------- all of it


def build(svc: ServiceSpec) -> list[Obj]:
    """Every child, in apply order: config first, then what selects pods, then the pods."""
    roles = list(svc.roles)
    pod_roles = [*roles, "router"] if has_router(svc) else roles
    configs = {role: role_config(svc, role) for role in roles}
    children: list[Obj] = [config_map(svc, configs), network_policy(svc)]
    for role in pod_roles:
        children.append(api_service(svc, role))
        if role != "router":
            children.append(peers_service(svc, role))
        children.append(disruption_budget(svc, role))
    children += [engine_deployment(svc, role, configs[role]) for role in roles]
    if has_router(svc):
        children.append(router_deployment(svc))
    children += [a for a in (autoscaler(svc, role) for role in roles) if a is not None]
    children += gateway.children(svc)
    return children


def service_url(svc: ServiceSpec) -> str:
    entry = "router" if svc.disaggregated else "mixed"
    return f"http://{svc.name}-{entry}.{svc.namespace}.svc.cluster.local:{svc.ports['http']}"
