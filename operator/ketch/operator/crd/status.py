"""The ``status`` of the InferenceService CRD: what the operator observed (conditions, replicas
per role, the coordinated autoscaler's last decisions)."""

from __future__ import annotations

from typing import Any

from ketch.operator.crd.schema import boolean, integer, obj, string


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
