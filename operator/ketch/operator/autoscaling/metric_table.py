"""Autoscaling: one table from the spec's metric types to the engine's metrics and their users.

``METRICS`` is the single source of truth for every name on the path
engine ``/metrics`` -> Prometheus -> prometheus-adapter (custom metrics API) -> HPA, and
engine ``/metrics`` -> Prometheus -> KEDA. From it come:

- the CRD's ``autoscaling.metrics[].type`` enum (``crd.autoscaling``);
- the HorizontalPodAutoscaler's ``Pods`` metric names and the ScaledObject's PromQL queries
  (``children.horizontalpodautoscaler`` / ``children.scaledobject``);
- the prometheus-adapter rules that expose the engine metrics under those names
  (``adapter_values()``, committed as ``manifests/metrics/prometheus-adapter-values.yaml``; a
  test fails when the file is stale, as for the CRD).

So a custom-metric name cannot drift between the adapter and the HPAs, and a test checks every
engine metric named here against the ``/metrics`` output of a live ``ketch serve``.

Targets are per-pod averages of the metric, in the metric's own unit, as Kubernetes quantities:
``RequestsWaiting: 4`` (requests), ``KVCacheUsage: 800m`` (the engine exports a fraction 0..1),
``TimeToFirstTokenP90: 2`` (seconds), ``CPU: 6`` (cores), ``Memory: 48Gi``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ketch.engine.metrics import PREFIX
from ketch.operator.quantity import canonical
from ketch.operator.yaml_text import dump_yaml

MODES = ("hpa", "keda", "ketch")  # ketch: the operator scales the roles itself (loop.py)
DEFAULT_MODE = "hpa"
CUSTOM_PREFIX = "ketch_"  # custom metric names may not contain ':' (they are URL path segments)
TTFT_QUANTILE = 0.9
RATE_WINDOW = "2m"


@dataclasses.dataclass(frozen=True)
class Metric:
    type: str  # spec.roles.<role>.autoscaling.metrics[].type
    description: str
    engine: str | None = None  # engine metric, without the "ketch:" prefix (None: a resource)
    resource: str | None = None  # "cpu" / "memory" for resource metrics
    quantile: float | None = None  # histogram quantile, for histogram metrics

    @property
    def series(self) -> str:
        """The Prometheus series the engine exports (a histogram's _bucket series)."""
        assert self.engine is not None
        return PREFIX + self.engine + ("_bucket" if self.quantile is not None else "")

    @property
    def custom_name(self) -> str:
        """The custom-metrics API name the adapter gives it (the HPA's ``Pods`` metric name)."""
        assert self.engine is not None
        suffix = f"_p{round(self.quantile * 100)}" if self.quantile is not None else ""
        return CUSTOM_PREFIX + self.engine + suffix


METRICS: tuple[Metric, ...] = (
    Metric(
        "RequestsWaiting",
        "requests waiting to be scheduled, per pod (queue depth; the default)",
        engine="num_requests_waiting",
    ),
    Metric(
        "RequestsRunning",
        "requests in the running batch, per pod",
        engine="num_requests_running",
    ),
    Metric(
        "KVCacheUsage",
        "fraction of KV cache blocks in use, per pod (0 to 1, e.g. 800m)",
        engine="kv_cache_usage_perc",
    ),
    Metric(
        "TimeToFirstTokenP90",
        "90th percentile of time to first token over the last 2 minutes, per pod, in seconds",
        engine="time_to_first_token_seconds",
        quantile=TTFT_QUANTILE,
    ),
    Metric("CPU", "CPU cores used, per pod", resource="cpu"),
    Metric("Memory", "memory used, per pod", resource="memory"),
)
BY_TYPE = {m.type: m for m in METRICS}
TYPES = tuple(BY_TYPE)
DEFAULT_METRICS = [{"type": "RequestsWaiting", "target": 4}]


def engine_metrics() -> set[str]:
    """Every engine metric family (``ketch:...``) the autoscaling pipeline reads."""
    return {PREFIX + m.engine for m in METRICS if m.engine is not None}


def target(value: Any) -> str:
    """A spec target (integer or quantity string) as a quantity string."""
    return str(value)


# --------------------------------------------------------------------------- HPA


def hpa_metric(entry: dict[str, Any]) -> dict[str, Any]:
    """One spec metric as an ``autoscaling/v2`` MetricSpec (per-pod average value)."""
    metric = BY_TYPE[entry["type"]]
    # A Quantity field of a built-in object: written as the API server stores it (KEDA's
    # threshold and value below are plain strings its scalers parse, so they stay as given).
    goal = {"type": "AverageValue", "averageValue": canonical(target(entry["target"]))}
    if metric.resource is not None:
        return {"type": "Resource", "resource": {"name": metric.resource, "target": goal}}
    return {"type": "Pods", "pods": {"metric": {"name": metric.custom_name}, "target": goal}}


def behavior(spec: dict[str, Any]) -> dict[str, Any] | None:
    """``autoscaling.behavior`` as an HPA behavior (the same shape; only what is set)."""
    out = {}
    for direction in ("scaleUp", "scaleDown"):
        rules = (spec.get("behavior") or {}).get(direction)
        if rules:
            out[direction] = dict(rules)
    return out or None


# --------------------------------------------------------------------------- KEDA


def promql(metric: Metric, namespace: str, deployment: str) -> str:
    """The PromQL a KEDA prometheus trigger runs. A gauge: the role's total (the HPA that KEDA
    makes divides it by the replica count for an AverageValue target, so the target is per pod).
    A histogram quantile: the role's quantile, with a Value target.

    Pods are picked by the ``namespace``/``pod`` target labels that every Kubernetes scrape
    config (PodMonitor, annotation-based) attaches; a Deployment's pods are named
    ``<deployment>-<replicaset hash>-<suffix>``."""
    pods = f'namespace="{namespace}",pod=~"{deployment}-[a-z0-9]+-[a-z0-9]+"'
    if metric.quantile is None:
        return f"sum({metric.series}{{{pods}}})"
    # A quantile is not a sum over pods: its trigger is a "Value" target (see keda_trigger).
    return (
        f"histogram_quantile({metric.quantile}, "
        f"sum(rate({metric.series}{{{pods}}}[{RATE_WINDOW}])) by (le))"
    )


def keda_trigger(
    entry: dict[str, Any], namespace: str, deployment: str, server: str | None
) -> dict[str, Any]:
    metric = BY_TYPE[entry["type"]]
    if metric.resource is not None:
        return {
            "type": metric.resource,
            "metricType": "AverageValue",
            "metadata": {"value": target(entry["target"])},
        }
    return {
        "type": "prometheus",
        "metricType": "AverageValue" if metric.quantile is None else "Value",
        "name": metric.custom_name.replace("_", "-"),
        "metadata": {
            "serverAddress": server or "",
            "query": promql(metric, namespace, deployment),
            "threshold": target(entry["target"]),
        },
    }


# --------------------------------------------------------------------------- adapter rules


def adapter_rules() -> list[dict[str, Any]]:
    """prometheus-adapter custom rules: each engine metric per pod, under its custom name."""
    resources = {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}}
    rules = []
    for metric in METRICS:
        if metric.engine is None:
            continue  # CPU and memory come from metrics-server (resource metrics API)
        if metric.quantile is None:
            query = "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"
        else:
            query = (
                f"histogram_quantile({metric.quantile}, sum(rate(<<.Series>>{{<<.LabelMatchers>>}}"
                f"[{RATE_WINDOW}])) by (le, <<.GroupBy>>))"
            )
        rules.append(
            {
                "seriesQuery": f'{metric.series}{{namespace!="",pod!=""}}',
                "resources": resources,
                "name": {"matches": f"^{metric.series}$", "as": metric.custom_name},
                "metricsQuery": query,
            }
        )
    return rules


ADAPTER_HEADER = """\
# prometheus-adapter rules for Ketch: the engine's Prometheus metrics as custom metrics, per pod,
# under the names the operator's HorizontalPodAutoscalers use. Generated by
# `ketch-operator adapter-rules` from ketch.operator.autoscaling.metric_table (never hand-edited;
# a test checks it is up to date). A values file of the prometheus-community/prometheus-adapter
# Helm chart:
#   helm install prometheus-adapter prometheus-community/prometheus-adapter \\
#     -n monitoring -f manifests/metrics/prometheus-adapter-values.yaml \\
#     --set prometheus.url=http://prometheus-operated.monitoring.svc
# Without Helm, copy the `rules.custom` list into the `rules:` of the adapter's config.yaml.
"""


def adapter_values() -> str:
    return ADAPTER_HEADER + dump_yaml({"rules": {"custom": adapter_rules()}})
