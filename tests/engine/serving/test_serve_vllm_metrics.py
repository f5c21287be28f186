"""A live ``ketch serve`` exports GAIE's model-server protocol gauges by vLLM's names.

Pickers configured for engine type ``vllm`` scrape these; each must equal its ``ketch:`` twin in
the same scrape, under load (requests in flight) as well as idle (docs/observability.md).
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import wait_for

COPIES = {  # vllm name -> the ketch name it copies
    "num_requests_waiting": "num_requests_waiting",
    "num_requests_running": "num_requests_running",
    "kv_cache_usage_perc": "kv_cache_usage_perc",
    "gpu_cache_usage_perc": "kv_cache_usage_perc",
}


def _scrape(url: str) -> tuple[dict[str, list], dict[str, str]]:
    """One scrape: sample name -> [(labels, value)], and each family's declared type."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples: dict[str, list] = {}
    types = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples, types


def _check_copies(samples: dict[str, list], types: dict[str, str]) -> dict[str, float]:
    got = {}
    for vllm_name, ketch_name in COPIES.items():
        [(labels, value)] = samples["vllm:" + vllm_name]
        [(ketch_labels, ketch_value)] = samples["ketch:" + ketch_name]
        assert labels == {"model_name": "tiny", "engine": "0"}, labels
        assert ketch_labels["model_name"] == labels["model_name"]
        assert value == ketch_value, (vllm_name, value, ketch_value)
        assert types["vllm:" + vllm_name] == "gauge"
        got[vllm_name] = value
    assert 0 <= got["kv_cache_usage_perc"] <= 1
    [(info_labels, info)] = samples["vllm:cache_config_info"]
    assert info == 1 and types["vllm:cache_config_info"] == "gauge"
    assert info_labels["block_size"] == "16"  # serve_harness starts it with --block-size 16
    [(_, blocks)] = samples["ketch:max_kv_block_num"]
    assert info_labels["num_gpu_blocks"] == str(int(blocks)) and blocks > 0
    return got


def test_vllm_names_equal_the_ketch_ones_under_load(server):
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
        busy = _check_copies(*_scrape(server.url))
        assert busy["num_requests_running"] + busy["num_requests_waiting"] >= 1
        assert busy["kv_cache_usage_perc"] > 0

    def idle():
        got = _check_copies(*_scrape(server.url))
        return got["num_requests_running"] + got["num_requests_waiting"] == 0

    wait_for(idle, 30, "the aborted request to leave the batch")
    assert _check_copies(*_scrape(server.url))["kv_cache_usage_perc"] == 0
