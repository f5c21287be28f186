"""Reading engine metrics out of a /metrics page (operator/ketch/operator/autoscaling/scrape.py)."""

from __future__ import annotations

import pytest

from ketch.engine.metrics import EngineMetrics
from ketch.operator.autoscaling import metric_table, scrape


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
    types = [m.type for m in metric_table.METRICS if m.engine is not None]
    assert set(scrape.extract(text, types)) == set(types)


def test_pod_ready():
    pod = {
        "metadata": {"name": "p"},
        "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    assert scrape.pod_ready(pod)
    assert not scrape.pod_ready({**pod, "metadata": {"name": "p", "deletionTimestamp": "x"}})
    assert not scrape.pod_ready({"metadata": {"name": "p"}, "status": {"podIP": "10.0.0.1"}})


def _page(fast: int, slow: int) -> str:
    name = "ketch:time_to_first_token_seconds"
    return (
        f"# TYPE {name} histogram\n"
        f'{name}_bucket{{le="0.5"}} {fast}\n'
        f'{name}_bucket{{le="4.0"}} {fast + slow}\n'
        f'{name}_bucket{{le="+Inf"}} {fast + slow}\n'
        f"{name}_sum 0\n{name}_count {fast + slow}\n"
    )


def test_ttft_quantile_is_over_the_last_two_minutes():
    windows = scrape.Windows(120)
    types = ["TimeToFirstTokenP90"]

    def p90(t: float, fast: int, slow: int) -> float:
        got = scrape.extract(_page(fast, slow), types, windows=windows, pod="p", now=t)
        return got["TimeToFirstTokenP90"]

    # a long fast history: since start, p90 is low
    assert p90(0, 1000, 0) <= 0.5
    # then only slow requests: the window sees them although the pod's totals are mostly fast
    assert p90(60, 1000, 50) > 3.0
    assert p90(130, 1000, 100) > 3.0
    # nothing new in the last two minutes: no latency to report
    assert p90(300, 1000, 100) == 0.0
    # counters reset (the engine restarted): the new totals count
    assert p90(310, 10, 0) <= 0.5
    windows.forget(set())
    assert not windows.snapshots
