"""The ``spec`` of the InferenceService CRD: the roles and their pods, the router, access
control, the gateway (``crd.gateway``), and the rules that tie the parts together (either
``mixed`` or ``prefill`` and ``decode``; what disaggregated serving needs; one GPU per
tensor-parallel rank).

The parts that run in an engine pod are in ``crd.engine``, autoscaling in ``crd.autoscaling``.
"""

from __future__ import annotations

from typing import Any

from ketch.operator.api_names import ROLE_NAMES
from ketch.operator.crd.autoscaling import coordinated_schema, role_autoscaling_schema
from ketch.operator.crd.engine import (
    cache_manager_schema,
    engine_schema,
    model_schema,
    ports_schema,
)
from ketch.operator.crd.gateway import EPP_PORT_RULE, gateway_schema
from ketch.operator.crd.schema import (
    MAX_TOLERATIONS,
    NAME_MAX_LENGTH,
    QUANTITY_MAX_LENGTH,
    QUANTITY_PATTERN,
    free_form,
    integer,
    obj,
    string,
    string_map,
)

ROUTER_POLICIES = ("least-requests", "round-robin", "prefix-hash")


def _resources() -> dict[str, Any]:
    return obj(
        "Compute resources of each engine pod of this role.",
        {
            "gpus": integer(
                "GPUs (gpuResourceName) per pod. 0 (the default) runs the engine on the CPU, "
                "where engine.tensorParallelSize is the number of worker processes in the engine "
                "container. Above 0 it must equal engine.tensorParallelSize: one GPU worker per "
                "tensor-parallel rank. GPU workers have not been run anywhere (no paddle GPU "
                "build installs where Ketch is built and tested); while the engine build does "
                "not run them, the operator refuses gpus above 0 (InvalidSpec).",
                default=0,
                minimum=0,
                maximum=16,
            ),
            "gpuResourceName": string(
                "Extended resource name of the GPUs (for GPU workers, not run yet: see gpus).",
                default="nvidia.com/gpu",
                maxLength=253,
            ),
            "cpu": string(
                "CPU request and limit of the engine container, e.g. '8'. On a CPU role (gpus "
                "0) it also sizes the model's threads: each of the engine.tensorParallelSize "
                "worker processes gets (whole CPUs - 1) / tensorParallelSize threads, rounded "
                "down, at least 1 (one CPU is left to the API server and the engine), unless "
                "engine.numThreads is set; with tensorParallelSize above 1 it must be at least "
                "that many CPUs.",
                pattern=QUANTITY_PATTERN,
                maxLength=QUANTITY_MAX_LENGTH,
            ),
            "memory": string(
                "Memory request and limit of the engine container, e.g. '64Gi'. It must hold "
                "the weights at their precision (engine.dtype, engine.quantization), the KV "
                "cache (its /dev/shm segment is memory-backed) and a headroom: checked for the "
                "built-in tiny model, and by 'ketch-operator check-wiring --model-config'.",
                pattern=QUANTITY_PATTERN,
                maxLength=QUANTITY_MAX_LENGTH,
            ),
        },
        default={},
    )


def _scheduling() -> dict[str, Any]:
    return obj(
        "Where the role's pods may run.",
        {
            "nodeSelector": string_map("Node labels the pods require (pod spec.nodeSelector)."),
            "tolerations": {
                "type": "array",
                "description": "Taints the pods tolerate (pod spec.tolerations), "
                "e.g. of GPU node pools.",
                "items": free_form("A core/v1 Toleration."),
                "maxItems": MAX_TOLERATIONS,
            },
            "affinity": free_form("Pod affinity rules (a core/v1 Affinity)."),
            "priorityClassName": string("PriorityClass of the pods.", maxLength=253),
        },
    )


def _role(name: str) -> dict[str, Any]:
    what = {
        "mixed": "Engine pods that both prefill and decode (the simple deployment).",
        "prefill": "Engine pods that only prefill prompts and hand the KV cache to decode pods.",
        "decode": "Engine pods that decode, with the KV cache received from prefill pods.",
    }[name]
    return obj(
        what,
        {
            "replicas": integer(
                "Pods of this role (ignored while autoscaling is set).", default=1, minimum=0
            ),
            "resources": _resources(),
            "scheduling": _scheduling(),
            "autoscaling": role_autoscaling_schema(),
        },
        default=None,
    )


def _router() -> dict[str, Any]:
    return obj(
        "The router: in front of prefill and decode pods (disaggregated mode), and with "
        "spec.gateway the gateway's endpoint picker (in mixed mode too).",
        {
            "replicas": integer("Router pods.", default=1, minimum=1),
            "policy": string(
                "How the router picks pods: least-requests, round-robin, or prefix-hash (the "
                "same prompt prefix goes to the same prefill pod, for prefix-cache hits).",
                default="least-requests",
                enum=list(ROUTER_POLICIES),
            ),
        },
        default={},
    )


def _auth() -> dict[str, Any]:
    return obj(
        "API access control.",
        {
            "apiKeySecretRef": obj(
                "A Secret holding the API key; clients must then send 'Authorization: Bearer "
                "<key>'.",
                {
                    "name": string("Secret name (same namespace).", minLength=1, maxLength=253),
                    "key": string(
                        "Key in the Secret.",
                        default="api-key",
                        minLength=1,
                        maxLength=NAME_MAX_LENGTH,
                    ),
                },
                required=("name",),
            ),
            "peerKeySecretRef": obj(
                "A Secret holding the key the prefill and decode pods authenticate each other "
                "with (HMAC-SHA256 on pd-comm and kv-transfer); required when disaggregated. "
                "Any random string of 16+ bytes, e.g. 'openssl rand -hex 32'.",
                {
                    "name": string("Secret name (same namespace).", minLength=1, maxLength=253),
                    "key": string(
                        "Key in the Secret.",
                        default="peer-key",
                        minLength=1,
                        maxLength=NAME_MAX_LENGTH,
                    ),
                },
                required=("name",),
            ),
        },
    )


def _tp_rule(role: str) -> tuple[str, str, str]:
    gpus = f"self.roles.{role}.resources.gpus"
    return (
        f"!has(self.roles.{role}) || {gpus} == 0 || self.engine.tensorParallelSize == {gpus}",
        f"engine.tensorParallelSize must equal roles.{role}.resources.gpus when that is above 0 "
        "(one GPU per tensor-parallel rank); with gpus 0 the ranks are worker processes on "
        "the CPU",
        ".engine.tensorParallelSize",
    )


# Also checked in Python (``spec.parse``), whatever the API server did: fail closed on an old CRD.
PEER_KEY_REQUIRED = (
    "roles.prefill/decode (disaggregated serving) need auth.peerKeySecretRef: a Secret "
    "with the key their pd-comm and kv-transfer ports authenticate peers with"
)


def spec_schema() -> dict[str, Any]:
    roles = obj(
        "The engine pods: either 'mixed', or 'prefill' and 'decode' together (prefill/decode "
        "disaggregation, with a router in front).",
        {name: _role(name) for name in ROLE_NAMES},
        rules=(
            (
                "has(self.mixed) != (has(self.prefill) || has(self.decode))",
                "set either roles.mixed, or roles.prefill and roles.decode (not both, not neither)",
            ),
            (
                "has(self.prefill) == has(self.decode)",
                "roles.prefill and roles.decode go together",
            ),
        ),
    )
    return obj(
        "The desired serving deployment.",
        {
            "model": model_schema(),
            "engine": engine_schema(),
            "roles": roles,
            "cacheManager": cache_manager_schema(),
            "router": _router(),
            "ports": ports_schema(),
            "auth": _auth(),
            "autoscaling": coordinated_schema(),
            "gateway": gateway_schema(),
        },
        required=("model", "roles"),
        rules=(
            *tuple(_tp_rule(r) for r in ROLE_NAMES),
            (
                "!(has(self.roles.prefill) || has(self.roles.decode)) || self.cacheManager.enabled",
                "roles.prefill/decode (disaggregated serving) need cacheManager.enabled: true: the "
                "KV cache moves between the pods' cache-manager sidecars",
                ".cacheManager.enabled",
            ),
            (
                "!has(self.roles.prefill) || (has(self.auth) && has(self.auth.peerKeySecretRef))",
                PEER_KEY_REQUIRED,
                ".auth",
            ),
            EPP_PORT_RULE,
        ),
    )
