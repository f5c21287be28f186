"""Reading engine metrics out of a /metrics page (operator/scrape.py)."""

from __future__ import annotations

import pytest

from ketch.engine.metrics import EngineMetrics
from ketch.operator import autoscaling, scrape


def test_quantile_is_prometheus_histogram_quantile():
    buckets = [(0.1, 0.0), (0.5, 50.0), (1.0, 100.0), (float("inf"), 100.0)]
    assert scrape.quantile(buckets, 0.9) == pytest.approx(0.9)
    assert scrape.quantile(buckets, 0.5) == pytest.approx(0.5)
    assert scrape.quantile([(1.0, 0.0), (float("inf"), 0.0)], 0.9) is None


def test_extract_reads_every_engine_metric_type():
    text = """
# TYPE ketch:num_requests_waiting gauge
ketch:num_requests_waiting{model_name="m"} 7
# TYPE ketch:kv_cache_usage_perc gauge
ketch:kv_cache_usage_perc{model_name="m"} 0.25
# TYPE ketch:time_to_first_token_seconds histogram
ketch:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 10
ketch:time_to_first_token_seconds_bucket{le="2.0",model_name="m"} 20
ketch:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 20
ketch:time_to_first_token_seconds_sum{model_name="m"} 25
ketch:time_to_first_token_seconds_count{model_name="m"} 20
"""
    got = scrape.extract(
        text, ["RequestsWaiting", "KVCacheUsage", "TimeToFirstTokenP90", "RequestsRunning"]
    )
    assert got == {
        "RequestsWaiting": 7.0,
        "KVCacheUsage": 0.25,
        "TimeToFirstTokenP90": pytest.approx(1.8),
    }


def test_extract_understands_the_engines_own_exposition():
    from prometheus_client import generate_latest

    metrics = EngineMetrics("tiny")
    text = generate_latest(metrics.registry).decode()
    types = [m.type for m in autoscaling.METRICS if m.engine is not None]
    assert set(scrape.extract(text, types)) == set(types)


def test_pod_ready():
    pod = {
        "metadata": {"name": "p"},
        "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    assert scrape.pod_ready(pod)
    assert not scrape.pod_ready({**pod, "metadata": {"name": "p", "deletionTimestamp": "x"}})
    assert not scrape.pod_ready({"metadata": {"name": "p"}, "status": {"podIP": "10.0.0.1"}})
