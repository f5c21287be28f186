"""What runs in an engine pod, as the CRD's schema: ``spec.engine``, ``spec.ports``,
``spec.model`` and ``spec.cacheManager``.

The engine, port and model-name fields are generated from ``EngineConfig`` and ``ServerConfig``
(``engine_fields.config_field_schemas``), so a CRD field and the ``ketch serve`` flag it sets
share their name, type, default, bounds and description; the fields written here are the ones
the operator handles itself (image, env, extraArgs, the model URI and its credentials, the
sidecar).
"""

from __future__ import annotations

from typing import Any

from ketch.engine.models.architectures import SUPPORTED_ARCHITECTURES
from ketch.operator.crd.engine_fields import config_field_schemas, owned_flags
from ketch.operator.crd.schema import (
    ENV_VALUE_MAX_LENGTH,
    MAX_ENV,
    NAME_MAX_LENGTH,
    QUANTITY_MAX_LENGTH,
    QUANTITY_PATTERN,
    TEXT_MAX_LENGTH,
    boolean,
    cel_rule,
    free_form,
    obj,
    string,
)
from ketch.operator.pod_layout import FETCH_CREDENTIAL_KEYS

DEFAULT_IMAGE = "ghcr.io/ketch-dev/ketch-engine:0.1.0"

# Units both Kubernetes (the sidecar's memory limit) and 'ketch cache-manager --swap-space' read
# alike: a plain number is bytes to one and GiB to the other, 'm' milli to one, mega to the other.
SWAP_SPACE_PATTERN = r"^(0|[0-9]+(\.[0-9]+)?(Ki|Mi|Gi))$"
MODEL_URI_PATTERN = (
    r"^(tiny|file:///.+|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?|hf://[^/]+/.+|s3://[^/]+/.+)$"
)


# What tensorParallelSize means in a pod, after the engine's own help text.
TENSOR_PARALLEL_IN_PODS = (
    "In an InferenceService: on a CPU role (roles.<role>.resources.gpus 0) the worker processes "
    "run in the engine container, whose cores are the whole CPUs of roles.<role>.resources.cpu "
    "when that is set (see there); on a GPU role it must equal resources.gpus, one GPU per rank. "
    "Tensor parallelism across CPU worker processes is what has been run and tested; GPU "
    "workers have not been run anywhere. The operator refuses a size this engine build or the "
    "built-in tiny model cannot split (InvalidSpec); a checkpoint's own shape is checked by the "
    "engine at start-up."
)


# What speculativeConfig means in a pod, after the engine's own help text.
SPECULATIVE_IN_PODS = (
    "In an InferenceService: an object whose keys are those names in camelCase "
    "(numSpeculativeTokens), not JSON text; the operator writes it into the role config file "
    "of mixed and decode pods. Prefill pods do not decode, so theirs omits it. Unset: no "
    "speculation."
)
# Where a draft model can be in the engine container: the operator fetches no second model.
DRAFT_MODEL_PATTERN = r"^(tiny|/.+)$"
DRAFT_MODEL_IN_PODS = (
    "In an InferenceService: 'tiny' or an absolute path in the engine container, either a "
    "directory baked into engine.image or one on the claim of a pvc:// model.uri, which is "
    "mounted whole (read-only) at /models. The operator fetches no second model: hf:// and "
    "s3:// are not accepted here."
)
# The cross-field rules of SpeculativeConfig.__post_init__, for the API server (the operator's
# own check is the engine's: spec.parse builds the EngineConfig).
SPECULATIVE_RULES = (
    (
        "self.method != 'draft' || has(self.model)",
        "model is required for method 'draft': the path of a smaller checkpoint with the "
        "same tokenizer",
        ".model",
    ),
    (
        "!has(self.model) || self.method == 'draft'",
        "model is for method 'draft' only",
        ".model",
    ),
    (
        "!has(self.promptLookupMin) || !has(self.promptLookupMax) || "
        "self.promptLookupMin <= self.promptLookupMax",
        "promptLookupMin must not exceed promptLookupMax",
        ".promptLookupMin",
    ),
)


def speculative_schema(generated: dict[str, Any]) -> dict[str, Any]:
    """``engine.speculativeConfig``: the object generated from ``SpeculativeConfig`` (names,
    types, defaults, enum, bounds, required keys, descriptions), plus what only a pod needs
    said: where a draft model can be, and the cross-field rules as CEL."""
    props = dict(generated["properties"])
    draft = props["model"]
    props["model"] = {
        **draft,
        "description": f"{draft['description']} {DRAFT_MODEL_IN_PODS}",
        "pattern": DRAFT_MODEL_PATTERN,
        "maxLength": TEXT_MAX_LENGTH,
    }
    return {
        **generated,
        "description": f"{generated['description']} {SPECULATIVE_IN_PODS}",
        "properties": props,
        "x-kubernetes-validations": [cel_rule(*rule) for rule in SPECULATIVE_RULES],
    }


def engine_schema() -> dict[str, Any]:
    props = config_field_schemas("engine")
    tp = props["tensorParallelSize"]  # replaced below, not edited: config_fields() is cached
    props["tensorParallelSize"] = {
        **tp,
        "description": f"{tp['description']} {TENSOR_PARALLEL_IN_PODS}",
    }
    props["speculativeConfig"] = speculative_schema(props["speculativeConfig"])
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
    (``spec.checks.extra_args_problems``) refuses abbreviations with ``=`` too. Bounded items and
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
            cel_rule(
                rule,
                "extraArgs may not set (or abbreviate) a flag that the operator sets; use the "
                "spec field (e.g. spec.ports.http for --port, spec.model.uri for --model)",
            )
        ],
    }


def ports_schema() -> dict[str, Any]:
    props = config_field_schemas("ports")
    names = list(props)
    required_ports = [n for n in names if "default" in props[n]]
    optional_ports = [n for n in names if "default" not in props[n]]
    listed = "[" + ", ".join(f"self.{n}" for n in required_ports) + "]"
    for n in optional_ports:
        listed += f" + (has(self.{n}) ? [self.{n}] : [])"
    rule = f"({listed}).all(p, ({listed}).filter(q, q == p).size() == 1)"
    # The default spells out every defaulted port: the API server checks a default against
    # the object's CEL rules as written (nested defaults not applied), and `{}` has no
    # self.http for the rule to read.
    return obj(
        "Container ports of the engine pods; they must be distinct.",
        props,
        default={n: props[n]["default"] for n in required_ports},
        rules=((rule, "ports must be distinct"),),
    )


def model_schema() -> dict[str, Any]:
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
    return obj(
        "The model to serve: a Hugging Face checkpoint directory (config.json, *.safetensors, "
        f"tokenizer.json) of one of these architectures: {', '.join(SUPPORTED_ARCHITECTURES)}.",
        props,
        required=("uri",),
    )


def cache_manager_schema() -> dict[str, Any]:
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
