"""/metrics on a real server: DESIGN.md's names, parsed by prometheus_client (acceptance 6)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import metric, scrape, wait_for

GAUGES = [
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "free_kv_block_num",
    "max_kv_block_num",
    "batch_size",
    "max_batch_size",
    "hit_token_rate",
]
HISTOGRAMS = [
    "time_to_first_token_seconds",
    "time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
]
COUNTERS = [
    "requests_number",
    "request_success_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "prefix_cache_token_num",
    "http_requests_total",
]


def _sample_names(url: str) -> set[str]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_design_metric_is_exposed(server):
    httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
        timeout=30,
    )
    names = _sample_names(server.url)
    for name in GAUGES + COUNTERS:
        assert "ketch:" + name in names, name
    for name in HISTOGRAMS:
        for suffix in ("_bucket", "_count", "_sum"):
            assert f"ketch:{name}{suffix}" in names, name + suffix
    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")


def test_metrics_move_under_load(server):
    def idle():
        s = scrape(server.url)
        return (
            s if metric(s, "num_requests_running") + metric(s, "num_requests_waiting") == 0 else 0
        )

    before = wait_for(idle, 30, "no request running")
    prompts = ["The Rabbit said", "Alice thought", "The Queen shouted", "The Dodo ran"]
    max_tokens = 7
    sent_prompt_tokens = 0
    for i, prompt in enumerate(prompts):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        body["stream"] = i % 2 == 0
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
        if not body["stream"]:
            sent_prompt_tokens += response.json()["usage"]["prompt_tokens"]
    after = scrape(server.url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    n = len(prompts)
    assert delta("requests_number") == n
    assert delta("request_success_total", finish_reason="length") == n
    assert delta("generation_tokens_total") == n * max_tokens
    assert delta("prompt_tokens_total") >= sent_prompt_tokens > 0
    assert delta("time_to_first_token_seconds_count") == n
    assert delta("e2e_request_latency_seconds_count") == n
    assert delta("request_generation_tokens_count") == n
    assert delta("request_generation_tokens_sum") == n * max_tokens
    assert delta("time_to_first_token_seconds_sum") > 0
    assert delta("http_requests_total", path="/v1/completions", status_code="200") == n
    for gauge in ("num_requests_running", "num_requests_waiting", "batch_size"):
        assert metric(after, gauge) >= 0
    assert 0 <= metric(after, "kv_cache_usage_perc") <= 1
    assert metric(after, "max_batch_size") == 64
    assert metric(after, "max_kv_block_num") > 0


def test_running_gauge_counts_a_request_in_flight(server):
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 480,
        "ignore_eos": True,
        "n": 3,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert any(line.startswith("data: ") for line in lines)  # generation has started
        running = metric(scrape(server.url), "num_requests_running")
        waiting = metric(scrape(server.url), "num_requests_waiting")
        assert running + waiting >= 1
        assert metric(scrape(server.url), "kv_cache_usage_perc") > 0

    def settled():
        s = scrape(server.url)
        return metric(s, "num_requests_running") == 0 and metric(s, "free_kv_block_num") == (
            metric(s, "max_kv_block_num")
        )

    wait_for(settled, 30, "the aborted request to leave the batch")


def test_http_errors_are_counted(server):
    before = scrape(server.url)
    key = ("ketch:http_requests_total", (("path", "/v1/completions"), ("status_code", "400")))
    httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": ""})
    after = scrape(server.url)
    assert after[key] - before.get(key, 0) == 1
