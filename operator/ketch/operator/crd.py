"""The InferenceService CRD, generated from Python: one definition for the schema and the flags.

The ``spec.engine``, ``spec.ports`` and ``spec.model.name`` fields are not written here: they are
generated from ``EngineConfig`` and ``ServerConfig`` (``ketch.engine``), whose field metadata also
generates ``ketch serve``'s flags. A CRD field and the flag it sets therefore share their name,
type, default, bounds and description (the table is ``engine_fields.py``, which also walks the
metadata the other way, turning a spec back into the engine's config file).

``crds/`` holds the output of ``ketch-operator crd``; a test fails when it is stale.
"""

from __future__ import annotations

from typing import Any

from ketch.operator.engine_fields import config_field_schemas, owned_flags

GROUP = "serving.ketch.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["kisvc"]
API_VERSION = f"{GROUP}/{VERSION}"
CRD_NAME = f"{PLURAL}.{GROUP}"

ROLE_NAMES = ("mixed", "prefill", "decode")
DEFAULT_IMAGE = "ghcr.io/ketch-dev/ketch-engine:0.1.0"
ROUTER_POLICIES = ("least-requests", "round-robin", "prefix-hash")
# Longest suffix the operator adds to the name: "-prefill-peers" (Service names are DNS-1035
# labels of at most 63 characters).
LONGEST_CHILD_SUFFIX = len("-prefill-peers")
MAX_NAME_LENGTH = 63 - LONGEST_CHILD_SUFFIX

# What the model-fetch init container reads, per URI scheme: the keys of
# model.credentialsSecretRef it gets as environment variables. An endpoint comes from the same
# Secret as the credentials it receives, so no spec field can send them elsewhere.
FETCH_CREDENTIAL_KEYS = {
    "hf": ("HF_TOKEN", "HF_ENDPOINT"),
    "s3": (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_ENDPOINT_URL",
    ),
}

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"
# Units both Kubernetes (the sidecar's memory limit) and 'ketch cache-manager --swap-space' read
# alike: a plain number is bytes to one and GiB to the other, 'm' milli to one, mega to the other.
SWAP_SPACE_PATTERN = r"^(0|[0-9]+(\.[0-9]+)?(Ki|Mi|Gi))$"
MODEL_URI_PATTERN = (
    r"^(tiny|file:///.+|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?|hf://[^/]+/.+|s3://[^/]+/.+)$"
)

# Bounds on every string, list and map of the spec. kube-apiserver prices each CEL rule at CRD
# creation, sizing what a rule may read without maxLength/maxItems/maxProperties from the 3 MiB
# request limit, and the root's rules may read anything. tests/kubeemu/crd_budget.py prices the
# rules the way it does; tests/operator/test_crd.py keeps the spec bounded.
NAME_MAX_LENGTH = 253  # DNS-1123 subdomain: object names, Secret keys, extended resource names
LABEL_VALUE_MAX_LENGTH = 63
QUANTITY_MAX_LENGTH = 64
TEXT_MAX_LENGTH = 1024  # URIs, image references, flags
ENV_VALUE_MAX_LENGTH = 32768
MAX_ENV = 256
MAX_TOLERATIONS = 64
MAX_NODE_SELECTOR = 64


# --------------------------------------------------------------------------- schema helpers


def _prop(kind: str, description: str, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": kind, "description": description}
    out.update({k: v for k, v in extra.items() if v is not None})
    return out


def string(description: str, **extra: Any) -> dict[str, Any]:
    return _prop("string", description, **extra)


def integer(description: str, **extra: Any) -> dict[str, Any]:
    return _prop("integer", description, **extra)


def boolean(description: str, **extra: Any) -> dict[str, Any]:
    return _prop("boolean", description, **extra)


def obj(
    description: str,
    properties: dict[str, Any],
    *,
    required: tuple[str, ...] = (),
    rules: tuple[tuple[str, str] | tuple[str, str, str], ...] = (),
    default: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An object schema. ``rules`` are CEL rules: (rule, message[, fieldPath])."""
    out: dict[str, Any] = {"type": "object", "description": description, "properties": properties}
    if required:
        out["required"] = list(required)
    if default is not None:
        out["default"] = default
    if rules:
        out["x-kubernetes-validations"] = [_rule(*r) for r in rules]
    return out


def _rule(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    out = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


def free_form(description: str) -> dict[str, Any]:
    """A Kubernetes-typed value (affinity, toleration, valueFrom): kept as given."""
    return {
        "type": "object",
        "description": description,
        "x-kubernetes-preserve-unknown-fields": True,
    }


def string_map(description: str) -> dict[str, Any]:
    return {
        "type": "object",
        "description": description,
        "additionalProperties": {
            "type": "string",
            "description": "A label value.",
            "maxLength": LABEL_VALUE_MAX_LENGTH,
        },
        "maxProperties": MAX_NODE_SELECTOR,
    }


# --------------------------------------------------------------------------- the spec


def _resources() -> dict[str, Any]:
    return obj(
        "Compute resources of each engine pod of this role.",
        {
            "gpus": integer(
                "GPUs (gpuResourceName) per pod. Today the engine runs on the CPU only, so 0 is "
                "the only value the operator accepts (InvalidSpec otherwise). Planned (issue "
                "17): GPU workers, one per tensor-parallel rank, engine.tensorParallelSize "
                "not exceeding this.",
                default=0,
                minimum=0,
                maximum=16,
            ),
            "gpuResourceName": string(
                "Extended resource name of the GPUs (for the planned GPU workers).",
                default="nvidia.com/gpu",
                maxLength=253,
            ),
            "cpu": string(
                "CPU request and limit of the engine container, e.g. '8'.",
                pattern=QUANTITY_PATTERN,
                maxLength=QUANTITY_MAX_LENGTH,
            ),
            "memory": string(
                "Memory request and limit of the engine container, e.g. '64Gi'.",
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


POSITIVE_QUANTITY_PATTERN = (
    r"^([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"
)


def _scaling_rules(direction: str, default_window: str) -> dict[str, Any]:
    return obj(
        f"How fast to scale {direction}.",
        {
            "stabilizationWindowSeconds": integer(
                f"Seconds of past recommendations to consider before scaling {direction} "
                f"(the autoscaler picks the {'lowest' if direction == 'up' else 'highest'} "
                f"one); the Kubernetes default is {default_window}.",
                minimum=0,
                maximum=3600,
            ),
        },
    )


def _autoscaling() -> dict[str, Any]:
    from ketch.operator.autoscaling import metric_table

    metric_types = "; ".join(f"{m.type}: {m.description}" for m in metric_table.METRICS)
    return obj(
        "Scale this role on the engine's metrics. When set, the operator leaves the "
        "Deployment's replicas to the autoscaler (spec.roles.*.replicas is then ignored), so "
        "re-applying the InferenceService never resets them.",
        {
            "mode": string(
                "Which autoscaler: 'hpa' (a HorizontalPodAutoscaler on custom metrics from "
                "prometheus-adapter, see manifests/metrics) or 'keda' (a KEDA ScaledObject that "
                "queries Prometheus itself; needs KEDA and prometheusAddress) or 'ketch' (the "
                "operator scrapes the pods' /metrics and sets the replicas itself, keeping the "
                "prefill:decode ratio of spec.autoscaling; engine metrics only).",
                default=metric_table.DEFAULT_MODE,
                enum=list(metric_table.MODES),
            ),
            "minReplicas": integer("Fewest pods.", default=1, minimum=1),
            "maxReplicas": integer("Most pods.", minimum=1),
            "metrics": {
                "type": "array",
                "description": "What to scale on; the autoscaler takes the largest pod count "
                "any of them asks for. Defaults to RequestsWaiting with a target of 4.",
                "items": obj(
                    "A metric and its target, a per-pod average.",
                    {
                        "type": string(
                            f"The metric. {metric_types}.", enum=list(metric_table.TYPES)
                        ),
                        "target": {
                            "description": "Target per-pod average of the metric, in its own "
                            "unit: an integer or a positive quantity such as 800m or 48Gi.",
                            "anyOf": [{"type": "integer"}, {"type": "string"}],
                            "x-kubernetes-int-or-string": True,
                            "minimum": 1,
                            "pattern": POSITIVE_QUANTITY_PATTERN,
                            "maxLength": QUANTITY_MAX_LENGTH,
                        },
                    },
                    required=("type", "target"),
                ),
                "minItems": 1,
                "maxItems": len(metric_table.TYPES),
                "default": metric_table.DEFAULT_METRICS,
                "x-kubernetes-validations": [
                    _rule(
                        "self.all(m, self.exists_one(n, n.type == m.type))",
                        "each metric type may appear once",
                    )
                ],
            },
            "behavior": obj(
                "Scaling speed (the HorizontalPodAutoscaler's behavior).",
                {
                    "scaleUp": _scaling_rules("up", "0"),
                    "scaleDown": _scaling_rules("down", "300"),
                },
            ),
            "prometheusAddress": string(
                "Prometheus URL that KEDA queries (mode 'keda' only), e.g. "
                "http://prometheus-operated.monitoring.svc:9090.",
                pattern=r"^https?://.+",
                maxLength=1024,
            ),
        },
        required=("maxReplicas",),
        rules=(
            (
                "self.minReplicas <= self.maxReplicas",
                "minReplicas must not exceed maxReplicas",
                ".minReplicas",
            ),
            (
                "self.mode != 'keda' || has(self.prometheusAddress) || "
                "self.metrics.all(m, m.type == 'CPU' || m.type == 'Memory')",
                "mode 'keda' needs prometheusAddress to scale on engine metrics",
                ".prometheusAddress",
            ),
            (
                "self.mode != 'ketch' || "
                "self.metrics.all(m, m.type != 'CPU' && m.type != 'Memory')",
                "mode 'ketch' scales on engine metrics only (not CPU or Memory)",
                ".metrics",
            ),
        ),
    )


def _coordinated() -> dict[str, Any]:
    from ketch.operator.autoscaling import decisions

    ratio_bound = {
        "type": "number",
        "description": "",
        "minimum": 0.01,
        "maximum": 100,
    }
    return obj(
        "Coordinated autoscaling, for roles with autoscaling.mode 'ketch': how often the "
        "operator scrapes and decides, the prefill:decode ratio it keeps, and whether it applies.",
        {
            "syncPeriodSeconds": integer(
                "Seconds between two scrapes and decisions.",
                default=int(decisions.DEFAULT_SYNC),
                minimum=1,
                maximum=300,
            ),
            "cooldownSeconds": integer(
                "Seconds after a change during which no change the other way is made.",
                default=int(decisions.DEFAULT_COOLDOWN),
                minimum=0,
                maximum=3600,
            ),
            "advisory": boolean(
                "Compute and record decisions in status.autoscaling without changing replicas.",
                default=False,
            ),
            "ratio": obj(
                "Bounds of prefill pods / decode pods (disaggregated mode). The smaller side is "
                "raised to stay within them, e.g. {min: 0.5, max: 2}.",
                {
                    "min": {**ratio_bound, "description": "Fewest prefill pods per decode pod."},
                    "max": {**ratio_bound, "description": "Most prefill pods per decode pod."},
                },
                rules=(
                    (
                        "!has(self.min) || !has(self.max) || self.min <= self.max",
                        "ratio.min must not exceed ratio.max",
                        ".min",
                    ),
                ),
            ),
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
            "autoscaling": _autoscaling(),
        },
        default=None,
    )


def _engine() -> dict[str, Any]:
    props = config_field_schemas("engine")
    props.update(
        {
            "image": string(
                "Engine container image.",
                default=DEFAULT_IMAGE,
                minLength=1,
                maxLength=TEXT_MAX_LENGTH,
            ),
            "imagePullPolicy": string(
                "When to pull the image.",
                default="IfNotPresent",
                enum=["Always", "IfNotPresent", "Never"],
            ),
            "shmSize": string(
                "Size of the memory-backed /dev/shm shared by the engine, its workers and the "
                "cache manager.",
                default="2Gi",
                pattern=QUANTITY_PATTERN,
                maxLength=QUANTITY_MAX_LENGTH,
            ),
            "extraArgs": _extra_args(),
            "env": {
                "type": "array",
                "description": "Extra environment variables of the engine container (not of "
                "the model-fetch init container, which gets model.credentialsSecretRef only). "
                "A valueFrom.secretKeyRef may name any Secret of the namespace: whoever may "
                "create an InferenceService may read every Secret there, as with a Pod.",
                "items": obj(
                    "A core/v1 EnvVar.",
                    {
                        "name": string("Variable name.", minLength=1, maxLength=NAME_MAX_LENGTH),
                        "value": string("Variable value.", maxLength=ENV_VALUE_MAX_LENGTH),
                        "valueFrom": free_form("A core/v1 EnvVarSource."),
                    },
                    required=("name",),
                ),
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["name"],
                "maxItems": MAX_ENV,
            },
        }
    )
    return obj(
        "Engine settings. Each field sets the 'ketch serve' flag named in its description.",
        props,
        default={},
    )


def _extra_args() -> dict[str, Any]:
    """``engine.extraArgs``, with a CEL rule that refuses the flags the operator owns, as
    written, as ``--flag=value`` or abbreviated (without ``=``). The operator's own check
    (``spec.extra_args_problems``) refuses abbreviations with ``=`` too. Bounded items and
    prefix tests keep the rule's estimated cost far below the API server's budget, which a
    regex over unbounded strings exceeds."""
    owned = "[" + ", ".join(f"'{flag}'" for flag in owned_flags()) + "]"
    rule = (
        "self.all(a, !a.startsWith('--') || a.size() < 3 || "
        f"!{owned}.exists(f, f.startsWith(a) || a.startsWith(f + '=')))"
    )
    return {
        "type": "array",
        "description": "More 'ketch serve' flags, for settings this spec does not name. Flags "
        "the operator sets (every engine setting, e.g. --port, --model, --pd-prefill-peers, "
        "--config), also abbreviated or as --flag=value, are refused here.",
        "items": {"type": "string", "description": "A flag or a flag's value.", "maxLength": 1024},
        "maxItems": 64,
        "x-kubernetes-validations": [
            _rule(
                rule,
                "extraArgs may not set (or abbreviate) a flag that the operator sets; use the "
                "spec field (e.g. spec.ports.http for --port, spec.model.uri for --model)",
            )
        ],
    }


def _ports() -> dict[str, Any]:
    props = config_field_schemas("ports")
    names = list(props)
    required_ports = [n for n in names if "default" in props[n]]
    optional_ports = [n for n in names if "default" not in props[n]]
    listed = "[" + ", ".join(f"self.{n}" for n in required_ports) + "]"
    for n in optional_ports:
        listed += f" + (has(self.{n}) ? [self.{n}] : [])"
    rule = f"({listed}).all(p, ({listed}).filter(q, q == p).size() == 1)"
    return obj(
        "Container ports of the engine pods; they must be distinct.",
        props,
        default={},
        rules=((rule, "ports must be distinct"),),
    )


def _model() -> dict[str, Any]:
    props = {
        "uri": string(
            "Where the weights are: 'tiny' (the built-in test model), file:///path/in/image, "
            "pvc://claim-name/path, hf://org/name or s3://bucket/prefix.",
            pattern=MODEL_URI_PATTERN,
            maxLength=1024,
        ),
    }
    props.update(config_field_schemas("model"))
    keys = "; ".join(f"{s}://: {', '.join(k)}" for s, k in FETCH_CREDENTIAL_KEYS.items())
    props["credentialsSecretRef"] = obj(
        "A Secret with the model-fetch init container's credentials (hf:// and s3:// models), "
        f"under these keys, each optional: {keys}. Only that container gets them, and it gets "
        "nothing else (not engine.env): an endpoint comes from the same Secret as the "
        "credentials sent to it.",
        {"name": string("Secret name (same namespace).", minLength=1, maxLength=253)},
        required=("name",),
    )
    return obj("The model to serve.", props, required=("uri",))


def _cache_manager() -> dict[str, Any]:
    return obj(
        "The cache-manager sidecar ('ketch cache-manager') in every engine pod: host memory as "
        "swap space for KV blocks evicted from the prefix cache, and the KV transfer from prefill "
        "pods to decode pods (sidecar to sidecar). Disaggregated serving needs it.",
        {
            "enabled": boolean(
                "Run the cache-manager sidecar in every engine pod (required with roles.prefill "
                "and roles.decode).",
                default=True,
            ),
            "hostSwapSpace": string(
                "Host memory for KV blocks evicted from the GPU prefix cache (ketch "
                "cache-manager --swap-space): a binary quantity such as 4Gi or 512Mi; 0 disables "
                "swapping.",
                default="4Gi",
                pattern=SWAP_SPACE_PATTERN,
                maxLength=QUANTITY_MAX_LENGTH,
            ),
            "cpu": string(
                "CPU request and limit of the sidecar.",
                default="1",
                pattern=QUANTITY_PATTERN,
                maxLength=QUANTITY_MAX_LENGTH,
            ),
            "memory": string(
                "Memory request and limit of the sidecar; defaults to hostSwapSpace + 1Gi.",
                pattern=QUANTITY_PATTERN,
                maxLength=QUANTITY_MAX_LENGTH,
            ),
        },
        default={},
    )


def _router() -> dict[str, Any]:
    return obj(
        "The router in front of prefill and decode pods (disaggregated mode only).",
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
        f"!has(self.roles.{role}) || {gpus} == 0 || self.engine.tensorParallelSize <= {gpus}",
        f"engine.tensorParallelSize must not exceed roles.{role}.resources.gpus (one GPU per "
        "tensor-parallel rank)",
        ".engine.tensorParallelSize",
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
            "model": _model(),
            "engine": _engine(),
            "roles": roles,
            "cacheManager": _cache_manager(),
            "router": _router(),
            "ports": _ports(),
            "auth": _auth(),
            "autoscaling": _coordinated(),
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
                "roles.prefill/decode (disaggregated serving) need auth.peerKeySecretRef: a Secret "
                "with the key their pd-comm and kv-transfer ports authenticate peers with",
                ".auth",
            ),
            (
                "!has(self.roles.mixed) || self.engine.tensorParallelSize == 1 "
                "|| self.roles.mixed.resources.gpus > 0",
                "engine.tensorParallelSize > 1 needs GPUs (roles.*.resources.gpus)",
                ".engine.tensorParallelSize",
            ),
        ),
    )


def status_schema() -> dict[str, Any]:
    condition = obj(
        "A condition of the InferenceService.",
        {
            "type": string("Ready, Progressing or Degraded."),
            "status": string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": string("Why, in one CamelCase word."),
            "message": string("What to do about it."),
            "lastTransitionTime": string("When status last changed.", format="date-time"),
            "observedGeneration": integer("The generation this condition describes."),
        },
        required=("type", "status"),
    )
    role_status = obj(
        "Replicas of one role.",
        {
            "desired": integer("Pods the role should have."),
            "ready": integer("Pods that pass their readiness probe."),
            "updated": integer("Pods running the current pod template."),
        },
    )
    decision = obj(
        "One autoscaling decision.",
        {
            "time": string("When it was made.", format="date-time"),
            "from": integer("Replicas before."),
            "to": integer("Replicas decided (not applied in advisory mode)."),
            "metrics": {
                "type": "object",
                "description": "Per metric type, the per-pod average it was based on.",
                "additionalProperties": {"type": "number", "description": "A per-pod average."},
            },
            "rule": string("Why: the metric, then stabilisation, cool-down or ratio."),
        },
    )
    autoscaling_status = obj(
        "Coordinated autoscaling (roles with autoscaling.mode 'ketch').",
        {
            "advisory": boolean("Decisions are recorded, not applied."),
            "roles": {
                "type": "object",
                "description": "Per coordinated role: its last decisions.",
                "additionalProperties": obj(
                    "One role's autoscaling.",
                    {
                        "decisions": {
                            "type": "array",
                            "description": "The last 10 decisions, oldest first.",
                            "items": decision,
                        }
                    },
                ),
            },
        },
    )
    return obj(
        "What the operator observed.",
        {
            "observedGeneration": integer("The spec generation the status describes."),
            "mode": string("mixed or disaggregated."),
            "url": string("In-cluster URL of the OpenAI-compatible API."),
            "replicas": string("Ready/desired engine pods over all roles, e.g. '2/2'."),
            "roles": {
                "type": "object",
                "description": "Per role: desired, ready and updated pods.",
                "additionalProperties": role_status,
            },
            "autoscaling": autoscaling_status,
            "conditions": {
                "type": "array",
                "description": "Ready, Progressing and Degraded; ScalingActive with coordinated "
                "autoscaling.",
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
        },
    )


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object, as applied to a cluster."""
    root = {
        "type": "object",
        "description": "An LLM served by Ketch engine pods: the model, the engine settings and "
        "the pods of each role.",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            # Declared so that the root's rules see bounded names (an undeclared metadata.name
            # is an unbounded string to kube-apiserver's cost estimate before v1.37).
            "metadata": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": NAME_MAX_LENGTH},
                    "generateName": {"type": "string", "maxLength": NAME_MAX_LENGTH},
                },
            },
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "required": ["spec"],
        "x-kubernetes-validations": [
            _rule(
                f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
                f"metadata.name must be at most {MAX_NAME_LENGTH} characters: the operator "
                f"names children after it with suffixes of up to {LONGEST_CHILD_SUFFIX}",
            ),
            _rule(
                "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
                "metadata.name must start with a letter and hold only lowercase letters, digits "
                "and '-' (it names Services)",
            ),
        ],
    }
    ready = '.status.conditions[?(@.type=="Ready")].status'
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "ketch", "app.kubernetes.io/part-of": "ketch"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["ketch", "all"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": "Ready", "type": "string", "jsonPath": ready},
                        {"name": "Mode", "type": "string", "jsonPath": ".status.mode"},
                        {"name": "Replicas", "type": "string", "jsonPath": ".status.replicas"},
                        {"name": "URL", "type": "string", "jsonPath": ".status.url"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }
