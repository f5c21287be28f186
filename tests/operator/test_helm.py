"""charts/ketch without a cluster: `helm lint --strict`, `helm template` equal to the kustomize
overlays object by object, the values schema refusing bad values, and the optional pieces
(PodMonitor, prometheus-adapter rules, Grafana dashboards). test_helm_install.py installs it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import operator_rbac
import pytest
import yaml
from helmchart import (
    CHART,
    HELM_ONLY_ANNOTATIONS,
    ROOT,
    compare,
    differences,
    helm,
    key,
    render,
    template_result,
)

from localcluster import metrics

# The settings under which the chart renders exactly what manifests/overlays/<name> does
# (docs/helm.md): the release in ketch-system (helmchart.RELEASE_NAMESPACE), with the Namespace.
SAME_AS_KUSTOMIZE = ("--set", "namespace.create=true")

# Each configuration docs/helm.md documents, as a values file.
CONFIGURATIONS = {
    "default": {},
    "as-kustomize": {"namespace": {"create": True}},
    "single-namespace": {"watchNamespace": "llm"},
    "monitoring": {
        "metrics": {
            "podMonitor": {
                "enabled": True,
                "namespace": "monitoring",
                "labels": {"release": "kps"},
            },
            "adapterRules": {"enabled": True, "namespace": "monitoring"},
        },
        "dashboards": {"enabled": True, "annotations": {"grafana_folder": "Ketch"}},
    },
    "everything": {
        "watchNamespace": "team-a",
        "crds": {"install": True, "keep": False},
        "image": {"digest": "sha256:" + "ab" * 32, "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "registry"}],
        "replicas": 3,
        "logLevel": "DEBUG",
        "extraArgs": ["--resync-seconds", "600"],
        "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops"}],
        "affinity": {"podAntiAffinity": {}},
        "priorityClassName": "system-cluster-critical",
        "podAnnotations": {"example.com/team": "llm"},
        "commonLabels": {"example.com/team": "llm"},
    },
    "no-crds": {"crds": {"install": False, "keep": False}},
}


def values_file(tmp_path: Path, values: dict, name: str = "values.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(values))
    return str(path)


@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_lint_strict_is_clean(tmp_path, name):
    result = helm("lint", "--strict", str(CHART), "-f", values_file(tmp_path, CONFIGURATIONS[name]))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout
    render("-f", values_file(tmp_path, CONFIGURATIONS[name]))  # and it renders


@pytest.mark.parametrize(
    ("overlay", "namespace"),
    [("cluster-wide", None), ("single-namespace", "llm"), ("single-namespace", "team-a")],
)
def test_template_equals_kustomize_object_by_object(tmp_path, overlay, namespace):
    kustomized = operator_rbac.overlay_for(namespace, tmp_path)
    args = [*SAME_AS_KUSTOMIZE] + (["--set", f"watchNamespace={namespace}"] if namespace else [])
    chart = render(*args)
    diffs = compare(chart, kustomized)
    assert not diffs, f"charts/ketch differs from manifests/overlays/{overlay}:\n" + "\n".join(
        diffs
    )
    # the only Helm-only item removed before comparing is there, on the InferenceService CRD
    crd = next(d for d in chart if d["metadata"]["name"] == "inferenceservices.serving.ketch.dev")
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert set(HELM_ONLY_ANNOTATIONS) == {"CustomResourceDefinition"}


@pytest.mark.parametrize(
    "args",
    [
        ("--set", "replicas=3"),
        ("--set", "logLevel=INFO"),
        ("--set", "resources.limits.memory=513Mi"),
        ("--set", "commonLabels.team=a"),
        ("--set", "crds.install=false"),
        ("--set", "namespace.create=false"),
        ("--set", "image.tag=0.1.1"),
    ],
)
def test_comparison_fails_on_any_other_difference(tmp_path, args):
    kustomized = operator_rbac.overlay_for(None, tmp_path)
    assert compare(render(*SAME_AS_KUSTOMIZE, *args), kustomized), args


def test_inferenceservice_crd_is_the_generated_file_and_kept():
    generated = yaml.safe_load(
        (ROOT / "crds" / "inferenceservices.serving.ketch.dev.yaml").read_text()
    )
    name = generated["metadata"]["name"]

    def crd(*args: str) -> list[dict]:
        return [d for d in render(*args) if d["metadata"]["name"] == name]

    [kept] = crd()
    assert kept["metadata"].pop("annotations") == {"helm.sh/resource-policy": "keep"}
    assert kept == generated
    assert crd("--set", "crds.keep=false") == [generated]
    assert crd("--set", "crds.install=false") == []
    # one copy: the chart links to the generated CRD and to manifests/crds' kopf CRDs
    links = {
        CHART / "files" / "inferenceservices.serving.ketch.dev.yaml": ROOT / "crds",
        CHART / "crds" / "kopfpeerings.kopf.dev.yaml": ROOT / "manifests" / "crds",
        CHART / "crds" / "clusterkopfpeerings.kopf.dev.yaml": ROOT / "manifests" / "crds",
        CHART / "files" / "prometheus-adapter-values.yaml": ROOT / "manifests" / "metrics",
    }
    for link, directory in links.items():
        assert link.is_symlink() and link.resolve() == directory / link.name, link


def test_kopf_crds_come_from_the_crds_directory():
    """Helm installs crds/ before the templates (the peering object needs its CRD) and never
    upgrades it; --skip-crds leaves them out, as documented."""
    names = {d["metadata"]["name"] for d in render() if d["kind"] == "CustomResourceDefinition"}
    assert {"kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"} <= names
    plain = helm("template", "ketch", str(CHART), "-n", "ketch-system")
    assert plain.returncode == 0 and "kopfpeerings.kopf.dev" not in plain.stdout


def nested(depth: int) -> dict:
    value: dict = {"leaf": "x"}
    for _ in range(depth):
        value = {"k": value}
    return value


BAD_VALUES = {
    "replicas-string": ({"replicas": "2"}, "/replicas", "want integer"),
    "replicas-float": ({"replicas": 2.5}, "/replicas", "want integer"),
    "replicas-huge": ({"replicas": 10**20}, "/replicas", "maximum"),
    "replicas-negative": ({"replicas": -1}, "/replicas", "minimum"),
    "unknown-key": ({"replica": 2}, "additional properties 'replica' not allowed", ""),
    "unknown-nested-key": (
        {"metrics": {"podMonitor": {"enable": True}}},
        "/metrics/podMonitor",
        "'enable' not allowed",
    ),
    "bool-as-string": ({"crds": {"keep": "yes"}}, "/crds/keep", "want boolean"),
    "namespace-invalid": ({"watchNamespace": "Team_A"}, "/watchNamespace", "pattern"),
    "namespace-long": ({"watchNamespace": "a" * 64}, "/watchNamespace", "maxLength"),
    "log-level": ({"logLevel": "TRACE"}, "/logLevel", "value must be one of"),
    "cpu-word": ({"resources": {"limits": {"cpu": "lots"}}}, "/resources/limits/cpu", "pattern"),
    "memory-huge": ({"resources": {"limits": {"memory": 1e300}}}, "/resources/limits/memory", ""),
    "resource-unknown": ({"resources": {"limits": {"gpu": 1}}}, "/resources/limits", "'gpu'"),
    "digest": ({"image": {"digest": "sha256:xyz"}}, "/image/digest", "pattern"),
    "tag-huge": ({"image": {"tag": "t" * 10_000}}, "/image/tag", "maxLength"),
    "args-many": ({"extraArgs": ["--x"] * 10_000}, "/extraArgs", "maxItems"),
    "args-type": ({"extraArgs": "--resync-seconds 60"}, "/extraArgs", "want array"),
    "labels-deep": ({"commonLabels": nested(200)}, "/commonLabels", "want string"),
    "labels-many": ({"commonLabels": {f"k{i}": "v" for i in range(1000)}}, "/commonLabels", ""),
    "interval": ({"metrics": {"podMonitor": {"interval": "forever"}}}, "/interval", "pattern"),
    "toleration": ({"tolerations": [{"operator": "Maybe"}]}, "/tolerations/0/operator", ""),
    "values-not-a-map": ({"resources": ["cpu"]}, "/resources", "want object"),
}


@pytest.mark.parametrize("name", BAD_VALUES)
def test_schema_rejects_bad_values_clearly(tmp_path, name):
    values, where, what = BAD_VALUES[name]
    result = template_result("-f", values_file(tmp_path, values))
    assert result.returncode != 0, f"{name}: accepted"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    assert where in result.stderr and what in result.stderr, result.stderr[:2000]
    assert len(result.stderr) < 20_000  # an error, not a dump of the values


@pytest.mark.parametrize("flag", ["--namespace=x", "-n", "--metrics-port", "--priority=5"])
def test_extra_args_cannot_override_what_the_chart_sets(tmp_path, flag):
    result = template_result("-f", values_file(tmp_path, {"extraArgs": [flag]}))
    assert result.returncode != 0
    assert "extraArgs" in result.stderr and flag.split("=")[0] in result.stderr, result.stderr


def test_operator_arguments_follow_the_values():
    def container(*args: str) -> dict:
        [deployment] = [d for d in render(*args) if d["kind"] == "Deployment"]
        return deployment["spec"]["template"]["spec"]["containers"][0]

    assert "args" not in container()
    got = container("--set", "logLevel=DEBUG", "--set-json", 'extraArgs=["--resync-seconds","60"]')
    assert got["args"] == ["--log-level", "DEBUG", "--resync-seconds", "60"]
    got = container("--set", "watchNamespace=llm", "--set", "logLevel=ERROR")
    assert got["args"] == ["--namespace", "$(WATCH_NAMESPACE)", "--log-level", "ERROR"]
    assert got["env"][0] == {"name": "WATCH_NAMESPACE", "value": "llm"}
    got = container("--set", "image.digest=sha256:" + "0" * 64)
    assert got["image"] == "ghcr.io/ketch-dev/ketch-operator@sha256:" + "0" * 64


def test_podmonitor_and_adapter_rules_are_manifests_metrics(tmp_path):
    assert not [d for d in render() if d["kind"] in ("PodMonitor", "ConfigMap")]  # off by default
    docs = render("-f", values_file(tmp_path, CONFIGURATIONS["monitoring"]))
    [monitor] = [d for d in docs if d["kind"] == "PodMonitor"]
    source = yaml.safe_load((ROOT / "manifests/metrics/podmonitor/podmonitor.yaml").read_text())
    assert monitor["metadata"].pop("namespace") == "monitoring"
    assert monitor["metadata"]["labels"].pop("release") == "kps"
    assert monitor == source
    [adapter] = [
        d for d in docs if key(d)[1:] == ("ConfigMap", "monitoring", "ketch-prometheus-adapter")
    ]
    config = yaml.safe_load(adapter["data"]["config.yaml"])
    values = yaml.safe_load((ROOT / "manifests/metrics/prometheus-adapter-values.yaml").read_text())
    assert config == {"rules": values["rules"]["custom"]} and config["rules"]
    # the --config the real prometheus-adapter of test_hpa_real.py runs with
    source = (ROOT / "manifests/metrics/prometheus-adapter-values.yaml").read_text()
    assert config == yaml.safe_load(metrics.adapter_config(source))


def chart_copy(tmp_path: Path, dashboards: dict[str, str] | None) -> Path:
    """charts/ketch copied (links resolved) with exactly `dashboards` in dashboards/."""
    chart = tmp_path / "ketch"
    shutil.copytree(CHART, chart, symlinks=False)
    shutil.rmtree(chart / "dashboards", ignore_errors=True)
    if dashboards is not None:
        (chart / "dashboards").mkdir()
        for name, text in dashboards.items():
            (chart / "dashboards" / name).write_text(text)
    return chart


def dashboard_maps(chart: Path, *args: str) -> list[dict]:
    return [
        d
        for d in render("--set", "dashboards.enabled=true", *args, chart=chart)
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "ketch-dashboards"
    ]


def test_dashboards_configmap(tmp_path):
    assert dashboard_maps(chart_copy(tmp_path / "none", None)) == []
    assert dashboard_maps(chart_copy(tmp_path / "empty", {})) == []
    boards = {
        "engine.json": json.dumps({"title": "Ketch engine", "panels": []}),
        "router.json": json.dumps({"title": "Ketch router", "panels": [{"id": 1}]}),
        "notes.txt": "not a dashboard",
    }
    chart = chart_copy(tmp_path / "two", boards)
    [config] = dashboard_maps(chart, "--set", "dashboards.annotations.grafana_folder=Ketch")
    assert config["metadata"]["namespace"] == "ketch-system"
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config["metadata"]["annotations"] == {"grafana_folder": "Ketch"}
    assert config["data"] == {k: v for k, v in boards.items() if k.endswith(".json")}
    [config] = dashboard_maps(chart, "--set", "dashboards.sidecarLabels=null")
    assert "grafana_dashboard" not in config["metadata"]["labels"]
    [config] = dashboard_maps(chart, "--set", "dashboards.namespace=grafana")
    assert config["metadata"]["namespace"] == "grafana"
    off = render(chart=chart)
    assert not [d for d in off if d["kind"] == "ConfigMap"]
    huge = chart_copy(tmp_path / "huge", {"big.json": json.dumps({"x": "y" * 1_100_000})})
    result = template_result("--set", "dashboards.enabled=true", chart=huge)
    assert result.returncode != 0 and "more than a ConfigMap takes" in result.stderr


def test_the_charts_own_dashboards_render_as_json():
    """Whatever charts/ketch/dashboards holds (possibly nothing) lands in the ConfigMap whole."""
    files = sorted((CHART / "dashboards").glob("*.json")) if (CHART / "dashboards").is_dir() else []
    maps = dashboard_maps(CHART)
    if not files:
        assert maps == []
        return
    [config] = maps
    assert sorted(config["data"]) == [f.name for f in files]
    for f in files:
        assert json.loads(config["data"][f.name]) == json.loads(f.read_text())


def test_chart_versions():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    base = yaml.safe_load_all((ROOT / "manifests/base/deployment.yaml").read_text())
    [deployment] = [d for d in base if d]
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert chart["apiVersion"] == "v2"
    assert image == f"ghcr.io/ketch-dev/ketch-operator:{chart['appVersion']}"
    assert os.path.exists(CHART / "values.schema.json")


def test_differences_are_strict_but_for_json_numbers():
    assert differences({"a": 30.0}, {"a": 30}) == []
    assert differences({"a": "1"}, {"a": 1}) and differences({"a": True}, {"a": 1})
    assert differences({"a": [1, 2]}, {"a": [2, 1]}) and differences({"a": None}, {})


def test_packaged_chart_renders_the_same(tmp_path):
    """`helm package` resolves the links into crds/ and manifests/: the archive is whole."""
    packaged = helm("package", str(CHART), "-d", str(tmp_path))
    assert packaged.returncode == 0, packaged.stderr
    [archive] = tmp_path.glob("ketch-*.tgz")
    assert render(chart=archive) == render()
