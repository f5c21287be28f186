"""The monitoring stack for real autoscaling, deployed into a running local cluster as pods.

What a platform team runs so that ``mode: hpa`` autoscalers work: Prometheus scraping the engine
pods by their ``prometheus.io/*`` annotations, and prometheus-adapter serving the custom metrics
API (``custom.metrics.k8s.io``) from it with the operator's own rules (``ketch-operator
adapter-rules``), so the real HPA controller in kube-controller-manager reads
``ketch_num_requests_waiting`` and friends. The objects are plain manifests
(``manifests/metrics-prometheus.yaml``, ``manifests/metrics-adapter.yaml``); this module adds the
adapter's ConfigMap, applies them with kubectl and waits for the API.

From Python (a pytest fixture)::

    deploy_monitoring(cluster_dir / "admin.kubeconfig", cluster_dir)
    wait_custom_metrics(cluster_dir / "admin.kubeconfig")
    custom_metric(kubeconfig, "default", "ketch_num_requests_waiting")  # {pod: value}

By hand: ``PYTHONPATH=hack .venv/bin/python -m localcluster.metrics deploy --dir D``
(``wait``, ``delete``, ``config`` likewise).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from localcluster import controlplane

NAMESPACE = "monitoring"
MANIFESTS = Path(__file__).resolve().parent / "manifests"
PROMETHEUS_MANIFEST = MANIFESTS / "metrics-prometheus.yaml"
ADAPTER_MANIFEST = MANIFESTS / "metrics-adapter.yaml"
ADAPTER_CONFIGMAP = "prometheus-adapter-config"
CUSTOM_METRICS_PATH = "/apis/custom.metrics.k8s.io/v1beta1"
# The upstream images, tagged with the versions of the wrapper modules (hack/prometheus,
# hack/prometheus-adapter) that hack/build-control-plane.sh builds: the node agent's image table
# maps each to its binary (``image_entries``).
PROMETHEUS_REPO = "quay.io/prometheus/prometheus"
ADAPTER_REPO = "registry.k8s.io/prometheus-adapter/prometheus-adapter"


@dataclass(frozen=True)
class MonitoringSettings:
    """What a test may tune. The defaults suit tests: metrics reach an HPA within seconds."""

    scrape_interval: str = "2s"
    relist_interval: str = "5s"  # the adapter rediscovers series (new pods) this often
    prometheus_url: str = f"http://prometheus.{NAMESPACE}.svc:9090"
    adapter_values: str | None = None  # Helm values with rules.custom; None: ask ketch-operator
    # More Prometheus scrape jobs (scrape_config dicts) after the pod-annotation one: e.g. the
    # cache-manager sidecars' and routers' ports, or the operator (tests/operator/
    # test_dashboards_real.py).
    extra_scrape_configs: tuple[dict[str, Any], ...] = ()


# --------------------------------------------------------------------------- images


def prometheus_version() -> str:
    """Prometheus' release (v3.16.0) from its Go module's version (v0.316.0)."""
    module = controlplane.module_version("prometheus", "github.com/prometheus/prometheus")
    minor, patch = module.removeprefix("v0.").split(".", 1)
    return f"v{minor[0]}.{int(minor[1:])}.{patch}"


def adapter_version() -> str:
    return controlplane.module_version("prometheus-adapter", "sigs.k8s.io/prometheus-adapter")


def image_entries() -> list[dict[str, Any]]:
    """The node agent's image-table entries for the two images: each runs the binary that
    hack/build-control-plane.sh built, with the image's ENTRYPOINT and CMD (upstream's
    Dockerfiles); the manifests give only ``args``, as on a real cluster."""
    cache = controlplane.bin_cache()
    prom, adapter = prometheus_version(), adapter_version()
    return [
        {
            "image": f"{PROMETHEUS_REPO}:{prom}",
            "path": [str(cache / "prometheus" / prom / "bin")],
            "entrypoint": ["prometheus"],
            "cmd": [
                "--config.file=/etc/prometheus/prometheus.yml",
                "--storage.tsdb.path=/prometheus",
            ],
        },
        {
            "image": f"{ADAPTER_REPO}:{adapter}",
            "path": [str(cache / "prometheus-adapter" / adapter / "bin")],
            "entrypoint": ["adapter"],
        },
    ]


# --------------------------------------------------------------------------- rendering


def operator_adapter_values() -> str:
    """``ketch-operator adapter-rules``: the operator's prometheus-adapter Helm values."""
    return _run([_ketch_operator(), "adapter-rules"]).stdout


def adapter_config(values_text: str) -> str:
    """The adapter's ``--config`` file from the Helm values the operator prints.

    The chart nests the custom rules as ``rules.custom``; the adapter's own config has them as
    ``rules:`` (its ``externalRules`` and ``resourceRules`` are not used here)."""
    values = yaml.safe_load(values_text) or {}
    rules = (values.get("rules") or {}).get("custom")
    if not rules:
        raise ValueError("no rules.custom in the prometheus-adapter values")
    return yaml.safe_dump({"rules": rules}, sort_keys=False)


def render(settings: MonitoringSettings) -> list[dict[str, Any]]:
    """Every object of the stack, as applied: the two manifests with the settings filled in and
    the adapter's ConfigMap."""
    objects = _load(PROMETHEUS_MANIFEST) + _load(ADAPTER_MANIFEST)
    values = settings.adapter_values or operator_adapter_values()
    for obj in objects:
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == "prometheus-config":
            obj["data"]["prometheus.yml"] = _prometheus_config(
                obj["data"]["prometheus.yml"],
                settings.scrape_interval,
                settings.extra_scrape_configs,
            )
        if obj["kind"] == "Deployment" and obj["metadata"]["name"] == "prometheus":
            container = obj["spec"]["template"]["spec"]["containers"][0]
            container["image"] = f"{PROMETHEUS_REPO}:{prometheus_version()}"
        if obj["kind"] == "Deployment" and obj["metadata"]["name"] == "prometheus-adapter":
            container = obj["spec"]["template"]["spec"]["containers"][0]
            container["image"] = f"{ADAPTER_REPO}:{adapter_version()}"
            container["args"] = _set_flags(
                container["args"],
                {
                    "--prometheus-url": settings.prometheus_url,
                    "--metrics-relist-interval": settings.relist_interval,
                },
            )
    objects.append(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": ADAPTER_CONFIGMAP, "namespace": NAMESPACE},
            "data": {"config.yaml": adapter_config(values)},
        }
    )
    return objects


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _prometheus_config(
    text: str, interval: str, extra_jobs: tuple[dict[str, Any], ...] = ()
) -> str:
    """The config with its global intervals replaced (as text: its comments stay), and any
    extra scrape jobs appended (then re-written as YAML, without the comments)."""
    pattern = r"^(\s+(?:scrape_interval|scrape_timeout|evaluation_interval)): \S+"
    text = re.sub(pattern, rf"\1: {interval}", text, flags=re.MULTILINE)
    if not extra_jobs:
        return text
    config = yaml.safe_load(text)
    names = [job["job_name"] for job in config["scrape_configs"]]
    for job in extra_jobs:
        if not isinstance(job, dict) or not isinstance(job.get("job_name"), str):
            raise ValueError(f"a scrape config needs a job_name: {job!r}")
        if job["job_name"] in names:
            raise ValueError(f"duplicate scrape job name {job['job_name']!r}")
        names.append(job["job_name"])
        config["scrape_configs"].append(job)
    return yaml.safe_dump(config, sort_keys=False)


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings (the config files in ConfigMaps) as literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(objects: list[dict[str, Any]]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False)


def _set_flags(args: list[str], flags: dict[str, str]) -> list[str]:
    kept = [a for a in args if a.split("=", 1)[0] not in flags]
    return kept + [f"{name}={value}" for name, value in flags.items()]


# --------------------------------------------------------------------------- the cluster


def deploy_monitoring(
    kubeconfig: Path | str,
    cluster_dir: Path | str | None = None,
    *,
    settings: MonitoringSettings = MonitoringSettings(),
    timeout: float = 180,
) -> None:
    """Apply the stack and wait until Prometheus and the adapter are ready (not yet until the
    aggregated API answers: see ``wait_custom_metrics``). The applied objects are written to
    ``<cluster_dir>/monitoring.yaml`` for a human to read."""
    text = dump(render(settings))
    if cluster_dir is not None:
        (Path(cluster_dir) / "monitoring.yaml").write_text(text)
    kubectl(
        kubeconfig,
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=ketch-localcluster",
        "-f",
        "-",
        input=text,
    )
    deadline = time.monotonic() + timeout
    while not _ready(kubeconfig):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the monitoring stack is not ready after {timeout:.0f}s\n{_diagnose(kubeconfig)}"
            )
        time.sleep(1)


# A pod in one of these states will not get better by waiting.
HOPELESS = {"ErrImagePull", "ImagePullBackOff", "CrashLoopBackOff", "CreateContainerConfigError"}


def _ready(kubeconfig: Path | str) -> bool:
    """Both Deployments are available; RuntimeError as soon as a pod cannot start (an image
    the node agent's table lacks: see ``image_entries``)."""
    pods = json.loads(kubectl(kubeconfig, "-n", NAMESPACE, "get", "pods", "-o", "json").stdout)
    for pod in pods["items"]:
        for status in pod.get("status", {}).get("containerStatuses", []):
            waiting = status.get("state", {}).get("waiting") or {}
            if waiting.get("reason") in HOPELESS:
                raise RuntimeError(
                    f"pod {NAMESPACE}/{pod['metadata']['name']}: {waiting['reason']}: "
                    f"{waiting.get('message', '')} (image {status.get('image')}; a local "
                    "cluster's node agent needs localcluster.metrics.image_entries())"
                )
    deployments = json.loads(
        kubectl(kubeconfig, "-n", NAMESPACE, "get", "deployments", "-o", "json").stdout
    )["items"]
    available = {
        d["metadata"]["name"]
        for d in deployments
        if d.get("status", {}).get("replicas") == d["spec"]["replicas"]
        and d.get("status", {}).get("updatedReplicas") == d["spec"]["replicas"]
        and d.get("status", {}).get("availableReplicas") == d["spec"]["replicas"]
        and d.get("status", {}).get("observedGeneration") == d["metadata"]["generation"]
    }
    return {"prometheus", "prometheus-adapter"} <= available


def wait_custom_metrics(kubeconfig: Path | str, timeout: float = 120) -> dict[str, Any]:
    """Wait until the custom metrics API answers through the kube-apiserver (the APIService is
    Available and the adapter has listed Prometheus' series once); returns its resource list."""
    deadline = time.monotonic() + timeout
    while True:
        result = kubectl(kubeconfig, "get", "--raw", CUSTOM_METRICS_PATH, check=False)
        if result.returncode == 0:
            return json.loads(result.stdout)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{CUSTOM_METRICS_PATH} did not answer in {timeout:.0f}s: "
                f"{result.stderr.strip()}\n{_diagnose(kubeconfig)}"
            )
        time.sleep(2)


def custom_metric(
    kubeconfig: Path | str, namespace: str, metric: str, selector: str | None = None
) -> dict[str, float]:
    """The per-pod values of one custom metric, as the HPA controller reads them; empty while
    the adapter has seen no series of it (its answer then is NotFound, until the next relist
    after Prometheus first scraped a pod that exports it)."""
    path = f"{CUSTOM_METRICS_PATH}/namespaces/{namespace}/pods/*/{metric}"
    if selector:
        path += f"?labelSelector={selector}"
    result = kubectl(kubeconfig, "get", "--raw", path, check=False)
    if result.returncode != 0:
        if "could not find the metric" in result.stderr:
            return {}
        raise RuntimeError(f"GET {path}: {result.stderr.strip()}")
    items = json.loads(result.stdout)["items"]
    return {item["describedObject"]["name"]: quantity(item["value"]) for item in items}


def delete_monitoring(kubeconfig: Path | str, timeout: float = 120) -> None:
    """Remove the stack. The APIServices go first: an aggregated API without its server makes
    discovery fail for every client (namespace deletion and garbage collection included)."""
    objects = _load(PROMETHEUS_MANIFEST) + _load(ADAPTER_MANIFEST)
    first = [o for o in objects if o["kind"] == "APIService"]
    rest = [o for o in objects if o["kind"] != "APIService"]
    for batch in (first, rest):
        kubectl(
            kubeconfig,
            "delete",
            "--ignore-not-found",
            "--wait=true",
            f"--timeout={int(timeout)}s",
            "-f",
            "-",
            input=dump(batch),
            timeout=timeout + 10,
        )


def quantity(text: str) -> float:
    """A Kubernetes quantity as the custom metrics API writes values (``1500m``, ``2``, ``3k``)."""
    suffixes = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    if text and text[-1] in suffixes:
        return float(text[:-1]) * suffixes[text[-1]]
    return float(text)


def _diagnose(kubeconfig: Path | str) -> str:
    """What a failed wait shows: the APIServices' conditions and the stack's pods."""
    out = []
    for args in (
        ("get", "apiservices", "-o", "wide"),
        ("-n", NAMESPACE, "get", "pods", "-o", "wide"),
    ):
        result = kubectl(kubeconfig, *args, check=False)
        out.append(result.stdout + result.stderr)
    return "\n".join(out)


# --------------------------------------------------------------------------- processes


def kubectl(
    kubeconfig: Path | str,
    *args: str,
    input: str | None = None,
    check: bool = True,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    return _run(
        [os.environ.get("KUBECTL", "kubectl"), f"--kubeconfig={kubeconfig}", *args],
        input=input,
        check=check,
        timeout=timeout,
    )


def _run(
    cmd: list[str], *, input: str | None = None, check: bool = True, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed: {result.stderr.strip()}")
    return result


def _ketch_operator() -> str:
    """The venv's console script beside this interpreter, else the one on PATH."""
    beside = Path(sys.executable).parent / "ketch-operator"
    found = str(beside) if beside.exists() else shutil.which("ketch-operator")
    if not found:
        raise RuntimeError("ketch-operator not found: `make setup-test` installs it in .venv")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m localcluster.metrics", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("command", choices=("deploy", "wait", "delete", "config"))
    parser.add_argument("--dir", type=Path, help="the cluster directory (its admin.kubeconfig)")
    parser.add_argument("--kubeconfig", type=Path, help="default: <dir>/admin.kubeconfig")
    parser.add_argument("--scrape-interval", default=MonitoringSettings.scrape_interval)
    parser.add_argument("--relist-interval", default=MonitoringSettings.relist_interval)
    args = parser.parse_args(argv)
    settings = MonitoringSettings(args.scrape_interval, args.relist_interval)
    if args.command == "config":  # what would be applied
        sys.stdout.write(dump(render(settings)))
        return 0
    kubeconfig = args.kubeconfig or (args.dir / "admin.kubeconfig" if args.dir else None)
    if kubeconfig is None:
        parser.error("--dir or --kubeconfig is needed")
    if args.command == "deploy":
        deploy_monitoring(kubeconfig, args.dir, settings=settings)
        args.command = "wait"
    if args.command == "wait":
        resources = wait_custom_metrics(kubeconfig)
        names = sorted(r["name"] for r in resources.get("resources", []))
        print(f"custom metrics API ready: {len(names)} resources", *names, sep="\n  ")
    elif args.command == "delete":
        delete_monitoring(kubeconfig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
