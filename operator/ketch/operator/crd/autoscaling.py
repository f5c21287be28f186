"""Autoscaling, as the CRD's schema: ``spec.roles.<role>.autoscaling`` (which autoscaler, the
replica bounds, the metrics and their targets, the scaling speed) and ``spec.autoscaling`` (the
coordinated autoscaler of ``mode: ketch``: its period, cool-down, prefill:decode ratio and
advisory switch).

The metric types and modes come from ``autoscaling.metric_table``, the coordinated defaults from
``autoscaling.decisions``.
"""

from __future__ import annotations

from typing import Any

from ketch.operator.autoscaling import decisions, metric_table
from ketch.operator.crd.schema import QUANTITY_MAX_LENGTH, boolean, cel_rule, integer, obj, string

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


def role_autoscaling_schema() -> dict[str, Any]:
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
                    cel_rule(
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


def coordinated_schema() -> dict[str, Any]:
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
