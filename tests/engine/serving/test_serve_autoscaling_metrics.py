"""Every metric the autoscaling pipeline reads is one a live ``ketch serve`` exports.

The pipeline's names come from ketch.operator.autoscaling.metric_table (HPA Pods metrics, the
committed prometheus-adapter rules, KEDA PromQL queries); this scrapes the shared real server's
/metrics after a request, so histograms have observations.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ketch.operator.autoscaling import metric_table
from ketch.operator.cli import render_object

ROOT = Path(__file__).resolve().parents[3]
ADAPTER_FILE = ROOT / "manifests" / "metrics" / "prometheus-adapter-values.yaml"
ALL_METRICS = [{"type": t, "target": 1} for t in metric_table.TYPES]


def _live_series(url: str) -> set[str]:
    httpx.post(
        f"{url}/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
        timeout=30,
    ).raise_for_status()
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def _rendered(mode: str) -> dict:
    body = yaml.safe_load((ROOT / "examples" / "mixed.yaml").read_text())
    body["spec"]["roles"] = {
        "mixed": {
            "autoscaling": {
                "mode": mode,
                "maxReplicas": 3,
                "metrics": ALL_METRICS,
                "prometheusAddress": "http://prometheus:9090",
            }
        }
    }
    kind = "ScaledObject" if mode == "keda" else "HorizontalPodAutoscaler"
    [child] = [c for c in render_object(body, owner_uid="u") if c["kind"] == kind]
    return child


def test_every_metric_the_pipeline_reads_is_exported(server):
    live = _live_series(server.url)
    # The table itself.
    for metric in metric_table.METRICS:
        if metric.engine is not None:
            assert metric.series in live, metric.series
    # The committed adapter rules, and the HPA Pods metrics they back.
    rules = yaml.safe_load(ADAPTER_FILE.read_text())["rules"]["custom"]
    exposed = {}
    for rule in rules:
        series = rule["seriesQuery"].split("{", 1)[0]
        assert series in live, series
        assert re.fullmatch(rule["name"]["matches"], series)
        exposed[rule["name"]["as"]] = series
    hpa = _rendered("hpa")
    for entry in hpa["spec"]["metrics"]:
        if entry["type"] == "Pods":
            assert entry["pods"]["metric"]["name"] in exposed
        else:
            assert entry["resource"]["name"] in ("cpu", "memory")
    # Every series a KEDA query names.
    so = _rendered("keda")
    queried = {
        name
        for t in so["spec"]["triggers"]
        if t["type"] == "prometheus"
        for name in re.findall(r"ketch:[a-z_]+", t["metadata"]["query"])
    }
    assert len(queried) == 4
    assert queried <= live, queried - live
