"""Autoscaling: HPAs and KEDA ScaledObjects per role, and the metrics pipeline manifests.

The live check that every metric named here is one ``ketch serve`` exports is in
tests/engine/serving/test_serve_autoscaling_metrics.py (it needs a running engine).
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from test_builders import UID, _validator, children

from ketch.operator.autoscaling import metric_table
from ketch.operator.cli import main as operator_main
from ketch.operator.cli import render_object
from ketch.operator.spec.parse import InvalidSpec, parse

ROOT = Path(__file__).resolve().parents[2]
ADAPTER_FILE = ROOT / "manifests" / "metrics" / "prometheus-adapter-values.yaml"
PODMONITOR_DIR = ROOT / "manifests" / "metrics" / "podmonitor"
PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"

ALL_METRICS = [
    {"type": "RequestsWaiting", "target": 4},
    {"type": "RequestsRunning", "target": "24"},
    {"type": "KVCacheUsage", "target": "800m"},
    {"type": "TimeToFirstTokenP90", "target": "1500m"},
    {"type": "CPU", "target": 6},
    {"type": "Memory", "target": "48Gi"},
]

# A minimal schema of KEDA's ScaledObject (keda.sh/v1alpha1), written for this test: the fields
# the operator sets, with their types, and nothing else allowed. kubernetes-validate has no
# schema for custom kinds.
SCALED_OBJECT_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                    },
                },
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"behavior": {"type": "object"}},
                        }
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["type", "metadata"],
                        "properties": {
                            "type": {"enum": ["prometheus", "cpu", "memory"]},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            # KEDA trigger metadata is a map of strings.
                            "metadata": {
                                "type": "object",
                                "additionalProperties": {"type": "string"},
                            },
                        },
                    },
                },
            },
        },
    },
}


def body(autoscaling_spec: dict | None = None, *, disaggregated: bool = False) -> dict:
    spec = yaml.safe_load((ROOT / "examples" / "mixed.yaml").read_text())
    spec["metadata"]["name"] = "chat"
    scaling = {"minReplicas": 2, "maxReplicas": 6, **(autoscaling_spec or {})}
    if disaggregated:
        spec["spec"]["roles"] = {"prefill": {"autoscaling": scaling}, "decode": {}}
        spec["spec"]["auth"] = {"peerKeySecretRef": {"name": "chat-peer-key"}}
    else:
        spec["spec"]["roles"] = {"mixed": {"autoscaling": scaling}}
    return spec


# --------------------------------------------------------------------------- HPA mode


def test_default_mode_is_an_hpa_on_requests_waiting():
    kids = children(body())
    hpa = kids[("HorizontalPodAutoscaler", "chat-mixed")]
    assert ("ScaledObject", "chat-mixed") not in kids
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"] == {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "chat-mixed"},
        "minReplicas": 2,
        "maxReplicas": 6,
        "metrics": [
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": "ketch_num_requests_waiting"},
                    "target": {"type": "AverageValue", "averageValue": "4"},
                },
            }
        ],
    }
    assert hpa["metadata"]["ownerReferences"][0]["uid"] == UID
    assert "replicas" not in kids[("Deployment", "chat-mixed")]["spec"]


def test_every_metric_type_maps_to_an_hpa_metric():
    scaling = {
        "metrics": ALL_METRICS,
        "behavior": {
            "scaleUp": {"stabilizationWindowSeconds": 0},
            "scaleDown": {"stabilizationWindowSeconds": 600},
        },
    }
    hpa = children(body(scaling))[("HorizontalPodAutoscaler", "chat-mixed")]["spec"]
    assert [m["type"] for m in hpa["metrics"]] == ["Pods"] * 4 + ["Resource"] * 2
    pods = [m["pods"]["metric"]["name"] for m in hpa["metrics"][:4]]
    assert pods == [
        "ketch_num_requests_waiting",
        "ketch_num_requests_running",
        "ketch_kv_cache_usage_perc",
        "ketch_time_to_first_token_seconds_p90",
    ]
    assert hpa["metrics"][4]["resource"] == {
        "name": "cpu",
        "target": {"type": "AverageValue", "averageValue": "6"},
    }
    assert hpa["metrics"][5]["resource"]["name"] == "memory"
    assert hpa["behavior"] == scaling["behavior"]
    assert set(metric_table.TYPES) == {m["type"] for m in ALL_METRICS}


def test_only_autoscaled_roles_get_an_autoscaler():
    kids = children(body(disaggregated=True))
    autoscalers = {k for k in kids if k[0] in ("HorizontalPodAutoscaler", "ScaledObject")}
    assert autoscalers == {("HorizontalPodAutoscaler", "chat-prefill")}
    assert "replicas" not in kids[("Deployment", "chat-prefill")]["spec"]
    assert kids[("Deployment", "chat-decode")]["spec"]["replicas"] == 1
    assert kids[("Deployment", "chat-router")]["spec"]["replicas"] == 1


@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_generated_hpas_pass_kubernetes_validate_strict(version, tmp_path):
    bodies = [
        body({"metrics": ALL_METRICS}),
        body({"behavior": {"scaleDown": {"stabilizationWindowSeconds": 60}}}, disaggregated=True),
    ]
    hpas = [
        c for b in bodies for c in render_object(b, owner_uid=UID)
        if c["kind"] == "HorizontalPodAutoscaler"
    ]  # fmt: skip
    assert len(hpas) == 2
    path = tmp_path / "hpas.yaml"
    path.write_text(yaml.safe_dump_all(hpas))
    result = subprocess.run(
        [_validator(), "--strict", "-k", version, str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(hpas)


# --------------------------------------------------------------------------- KEDA mode


def keda_body(**extra) -> dict:
    return body({"mode": "keda", "prometheusAddress": PROMETHEUS, "metrics": ALL_METRICS, **extra})


def test_keda_mode_is_a_scaled_object_and_no_hpa():
    kids = children(keda_body(behavior={"scaleDown": {"stabilizationWindowSeconds": 120}}))
    assert ("HorizontalPodAutoscaler", "chat-mixed") not in kids
    so = kids[("ScaledObject", "chat-mixed")]
    jsonschema.validate(so, SCALED_OBJECT_SCHEMA)
    spec = so["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "chat-mixed",
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 6)
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == {
        "scaleDown": {"stabilizationWindowSeconds": 120}
    }
    triggers = spec["triggers"]
    assert [t["type"] for t in triggers] == ["prometheus"] * 4 + ["cpu", "memory"]
    waiting = triggers[0]
    assert waiting["metricType"] == "AverageValue"
    assert waiting["metadata"] == {
        "serverAddress": PROMETHEUS,
        "query": 'sum(ketch:num_requests_waiting{namespace="default",'
        'pod=~"chat-mixed-[a-z0-9]+-[a-z0-9]+"})',
        "threshold": "4",
    }
    ttft = triggers[3]
    assert ttft["metricType"] == "Value"  # a quantile is not divided by the pod count
    assert ttft["metadata"]["query"].startswith("histogram_quantile(0.9, sum(rate(")
    assert triggers[4] == {"type": "cpu", "metricType": "AverageValue", "metadata": {"value": "6"}}
    assert ("Deployment", "chat-mixed") in kids
    assert "replicas" not in kids[("Deployment", "chat-mixed")]["spec"]


def test_keda_pod_regex_picks_only_the_roles_pods():
    query = children(keda_body())[("ScaledObject", "chat-mixed")]["spec"]["triggers"][0]
    regex = re.search(r'pod=~"([^"]+)"', query["metadata"]["query"]).group(1)
    assert re.fullmatch(regex, "chat-mixed-7d9f8c6b5-x2k4q")
    assert not re.fullmatch(regex, "chat-mixed-peers-abc-def-ghi")
    assert not re.fullmatch(regex, "chatbot-mixed-7d9f8c6b5-x2k4q")


def test_keda_with_only_resource_metrics_needs_no_prometheus():
    b = body({"mode": "keda", "metrics": [{"type": "CPU", "target": 4}]})
    so = children(b)[("ScaledObject", "chat-mixed")]
    jsonschema.validate(so, SCALED_OBJECT_SCHEMA)
    assert so["spec"]["triggers"] == [
        {"type": "cpu", "metricType": "AverageValue", "metadata": {"value": "4"}}
    ]


# --------------------------------------------------------------------------- spec validation


@pytest.mark.parametrize(
    ("scaling", "field"),
    [
        ({"mode": "coordinated"}, "spec.roles.mixed.autoscaling.mode"),
        (
            {"mode": "ketch", "metrics": [{"type": "CPU", "target": 1}]},
            "spec.roles.mixed.autoscaling.metrics",
        ),
        ({"mode": "keda"}, "spec.roles.mixed.autoscaling.prometheusAddress"),
        (
            {"metrics": [{"type": "CPU", "target": 1}, {"type": "CPU", "target": 2}]},
            "spec.roles.mixed.autoscaling.metrics",
        ),
        ({"metrics": [{"type": "GPU", "target": 1}]}, "spec.roles.mixed.autoscaling.metrics[0]"),
        ({"metrics": [{"type": "CPU", "target": "0"}]}, "spec.roles.mixed.autoscaling.metrics[0]"),
        ({"metrics": [{"type": "CPU", "target": 0}]}, "spec.roles.mixed.autoscaling.metrics[0]"),
        ({"metrics": [{"type": "CPU", "target": "lots"}]}, "metrics[0].target"),
        ({"metrics": [{"type": "CPU"}]}, "target"),
        ({"metrics": []}, "spec.roles.mixed.autoscaling.metrics"),
        (
            {"behavior": {"scaleDown": {"stabilizationWindowSeconds": -1}}},
            "spec.roles.mixed.autoscaling.behavior.scaleDown.stabilizationWindowSeconds",
        ),
    ],
)
def test_invalid_autoscaling_is_refused_naming_the_field(scaling, field):
    with pytest.raises(InvalidSpec) as info:
        parse(body(scaling) | {"metadata": {"name": "chat", "namespace": "d", "uid": UID}})
    assert field in str(info.value)


def test_targets_accept_integers_and_quantities():
    for value in (1, "4", "0.8", "800m", "1500m", "48Gi"):
        b = body({"metrics": [{"type": "Memory", "target": value}]})
        parse(b | {"metadata": {"name": "chat", "namespace": "d", "uid": UID}})


# --------------------------------------------------------------------------- pipeline manifests


def test_adapter_rules_file_is_up_to_date(capsys):
    assert operator_main(["adapter-rules"]) == 0
    generated = capsys.readouterr().out
    assert ADAPTER_FILE.read_text() == generated, (
        "stale: run `.venv/bin/ketch-operator adapter-rules > "
        "manifests/metrics/prometheus-adapter-values.yaml`"
    )


def test_adapter_rules_expose_every_pods_metric_an_hpa_uses():
    rules = yaml.safe_load(ADAPTER_FILE.read_text())["rules"]["custom"]
    exposed = {r["name"]["as"]: r for r in rules}
    hpa = children(body({"metrics": ALL_METRICS}))[("HorizontalPodAutoscaler", "chat-mixed")]
    used = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert used == set(exposed)
    for name, rule in exposed.items():
        series = rule["seriesQuery"].split("{", 1)[0]
        assert re.fullmatch(rule["name"]["matches"], series), name
        assert series.removesuffix("_bucket") in metric_table.engine_metrics()
        # the adapter maps the series to pods through these labels
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
        assert "<<.GroupBy>>" in rule["metricsQuery"]
        assert ":" not in name  # custom metric names are URL path segments


def test_podmonitor_overlay_selects_engine_pods():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run(
        [kubectl, "kustomize", str(PODMONITOR_DIR)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    [monitor] = [d for d in yaml.safe_load_all(result.stdout) if d]
    # A CRD kind (Prometheus Operator): checked structurally here, not by kubernetes-validate.
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["kind"] == "PodMonitor"
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    engine, sidecar = spec["podMetricsEndpoints"]
    assert engine["path"] == sidecar["path"] == "/metrics"
    # It selects every pod Deployment the operator builds (engines and the router), on a port
    # they name: the engine's and the sidecar's, the router's own metrics on `http`.
    kids = children(body(disaggregated=True))
    deployments = [(n, c) for (k, n), c in kids.items() if k == "Deployment"]
    assert {n for n, _ in deployments} >= {"chat-prefill", "chat-decode", "chat-router"}
    for name, child in deployments:
        template = child["spec"]["template"]
        pod_labels = template["metadata"]["labels"]
        selected = spec["selector"]["matchLabels"].items() <= pod_labels.items() and all(
            pod_labels.get(e["key"]) in e["values"]
            for e in spec["selector"].get("matchExpressions", [])
        )
        assert selected, name
        containers = {c["name"]: c for c in template["spec"]["containers"]}
        if name == "chat-router":
            assert engine["port"] in {p["name"] for p in containers["router"]["ports"]}
            continue
        assert engine["port"] in {p["name"] for p in containers["engine"]["ports"]}
        assert sidecar["port"] in {p["name"] for p in containers["cache-manager"]["ports"]}


def test_example_is_autoscaled_with_an_hpa():
    b = yaml.safe_load((ROOT / "examples" / "autoscaled.yaml").read_text())
    kids = children(copy.deepcopy(b))
    hpa = kids[("HorizontalPodAutoscaler", "llama-chat-mixed")]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "llama-chat-mixed"
    assert ("Deployment", "llama-chat-mixed") in kids
    assert (hpa["apiVersion"], hpa["kind"], hpa["metadata"]["name"]) == (
        "autoscaling/v2",
        "HorizontalPodAutoscaler",
        "llama-chat-mixed",
    )


# --------------------------------------------------------------------------- mode ketch


def test_mode_ketch_builds_no_autoscaler_and_leaves_replicas_out():
    b = body({"mode": "ketch"}, disaggregated=True)
    b["spec"]["roles"]["decode"] = {"autoscaling": {"mode": "ketch", "maxReplicas": 4}}
    b["spec"]["autoscaling"] = {"syncPeriodSeconds": 1, "ratio": {"min": 0.5, "max": 2}}
    got = children(b)
    assert not [k for k in got if k[0] in ("HorizontalPodAutoscaler", "ScaledObject")]
    for role in ("prefill", "decode"):
        assert "replicas" not in got[("Deployment", f"chat-{role}")]["spec"]
    svc = parse(b | {"metadata": {"name": "chat", "namespace": "d", "uid": UID}})
    assert svc.spec["autoscaling"]["cooldownSeconds"] == 30
    assert svc.spec["autoscaling"]["advisory"] is False


@pytest.mark.parametrize(
    ("coordinated", "field"),
    [
        ({"ratio": {"min": 2, "max": 1}}, "spec.autoscaling.ratio"),
        ({"ratio": {"min": 0}}, "spec.autoscaling.ratio.min"),
        ({"syncPeriodSeconds": 0}, "spec.autoscaling.syncPeriodSeconds"),
    ],
)
def test_invalid_coordinated_settings_are_refused(coordinated, field):
    b = body({"mode": "ketch"}) | {"metadata": {"name": "chat", "namespace": "d", "uid": UID}}
    b["spec"]["autoscaling"] = coordinated
    with pytest.raises(InvalidSpec) as info:
        parse(b)
    assert field in str(info.value)
