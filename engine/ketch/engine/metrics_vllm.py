"""vLLM-named copies of the gauges GAIE's model-server protocol reads, beside the ``ketch:`` ones.

Endpoint pickers of the Gateway API Inference Extension (GAIE) and llm-d's scheduler scrape a
model server's ``/metrics`` by vLLM's names when its engine type is ``vllm``. The protocol
(GAIE ``docs/proposals/003-model-server-protocol``) asks for:

==========================  ===============================  ================================
GAIE protocol field         vLLM name exported here          fed from (ketch: name)
==========================  ===============================  ================================
TotalQueuedRequests         ``vllm:num_requests_waiting``    ``ketch:num_requests_waiting``
TotalRunningRequests        ``vllm:num_requests_running``    ``ketch:num_requests_running``
KVCacheUtilization          ``vllm:kv_cache_usage_perc``     ``ketch:kv_cache_usage_perc``
(same; older pickers)       ``vllm:gpu_cache_usage_perc``    ``ketch:kv_cache_usage_perc``
BlockSize (optional)        ``vllm:cache_config_info``       ``--block-size``
                            label ``block_size``
NumGPUBlocks (optional)     ``vllm:cache_config_info``       ``ketch:max_kv_block_num``
                            label ``num_gpu_blocks``
==========================  ===============================  ================================

Labels follow vLLM: ``model_name`` (the served model name) and ``engine`` (vLLM's engine index;
one engine per Ketch server, so always ``"0"``). ``vllm:cache_config_info`` is an info-style
gauge, always 1, its facts in string labels. LoRA (``vllm:lora_requests_info``) is not exported:
the protocol asks for it only of servers that serve LoRA adapters, and Ketch serves none.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric

VLLM_PREFIX = "vllm:"
ENGINE_INDEX = "0"

# vLLM name -> (the ketch gauge it copies, help)
VLLM_GAUGES: dict[str, tuple[str, str]] = {
    "num_requests_waiting": (
        "num_requests_waiting",
        "Requests waiting to be scheduled "
        "(GAIE TotalQueuedRequests; = ketch:num_requests_waiting).",
    ),
    "num_requests_running": (
        "num_requests_running",
        "Requests in the running batch (GAIE TotalRunningRequests; = ketch:num_requests_running).",
    ),
    "kv_cache_usage_perc": (
        "kv_cache_usage_perc",
        "KV cache usage, 0 to 1 (GAIE KVCacheUtilization; = ketch:kv_cache_usage_perc).",
    ),
    "gpu_cache_usage_perc": (
        "kv_cache_usage_perc",
        "KV cache usage, 0 to 1: vLLM's older name of vllm:kv_cache_usage_perc, which pickers "
        "written for GAIE before v1.0 read.",
    ),
}


def vllm_families(
    model_name: str,
    gauges: Mapping[str, float],
    cache_config: Mapping[str, str] | None,
) -> Iterator[Metric]:
    """The vLLM-named families from the ketch gauge values (and the cache facts, once known)."""
    labels = ["model_name", "engine"]
    for name, (source, doc) in VLLM_GAUGES.items():
        family = GaugeMetricFamily(VLLM_PREFIX + name, doc, labels=labels)
        family.add_metric([model_name, ENGINE_INDEX], gauges[source])
        yield family
    if cache_config is not None:
        keys = sorted(cache_config)
        family = GaugeMetricFamily(
            VLLM_PREFIX + "cache_config_info",
            "Information of the KV cache configuration, in labels (always 1): block_size "
            "(tokens per block) and num_gpu_blocks (blocks in the device KV cache).",
            labels=[*labels, *keys],
        )
        family.add_metric([model_name, ENGINE_INDEX, *(cache_config[k] for k in keys)], 1.0)
        yield family


def cache_config_labels(block_size: int, num_blocks: int, cache_dtype: str) -> dict[str, str]:
    """vllm:cache_config_info's labels, checked: positive ints and a plain dtype name."""
    for name, value in (("block_size", block_size), ("num_gpu_blocks", num_blocks)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        if not 0 < value < 2**53:
            raise ValueError(f"{name} must be a positive integer below 2**53, not {value}")
    if not isinstance(cache_dtype, str) or not cache_dtype or len(cache_dtype) > 64:
        raise ValueError("cache_dtype must be a non-empty string of at most 64 characters")
    return {
        "block_size": str(block_size),
        "num_gpu_blocks": str(num_blocks),
        "cache_dtype": cache_dtype,
    }
