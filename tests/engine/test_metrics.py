"""EngineMetrics exposes the DESIGN.md metric names, fed from a real engine's stats."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ketch.engine import LLM, SamplingParams
from ketch.engine.metrics import EngineMetrics
from ketch.engine.outputs import RequestOutput
from ketch.engine.stats import EngineSnapshot, RequestMetrics

# Copied from DESIGN.md ("Engine metrics") on purpose, not imported: these are the names the
# autoscaler and router query, so a rename in the module must fail here.
GAUGES = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "free_kv_block_num",
    "max_kv_block_num", "batch_size", "max_batch_size", "hit_token_rate",
]  # fmt: skip
HISTOGRAMS = [
    "time_to_first_token_seconds", "time_per_output_token_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prompt_tokens",
    "request_generation_tokens",
    "kv_handover_seconds",  # prefill/decode (issue 5); not one of FastDeploy's names
]  # fmt: skip
COUNTERS = [
    "requests_number", "request_success_total", "prompt_tokens_total",
    "generation_tokens_total", "prefix_cache_token_num", "http_requests_total",
]  # fmt: skip

# GAIE's model-server protocol, by vLLM's names (docs/observability.md): vllm name -> ketch name.
VLLM_COPIES = {
    "num_requests_waiting": "num_requests_waiting",
    "num_requests_running": "num_requests_running",
    "kv_cache_usage_perc": "kv_cache_usage_perc",
    "gpu_cache_usage_perc": "kv_cache_usage_perc",
}
VLLM_INFO = "cache_config_info"

MODEL = "tiny-served"
# Long enough to fill several 16-token blocks, so later prompts reuse them from the cache.
SHARED_PREFIX = "Once upon a time, in a land far away, there lived a quiet old fox " * 3


@dataclass
class Run:
    """What a real engine did, and the metrics fed from it."""

    outputs: list[RequestOutput]
    snapshot: EngineSnapshot
    metrics: EngineMetrics

    @property
    def finished(self) -> list[RequestMetrics]:
        return [o.metrics for o in self.outputs if o.metrics is not None]


def samples(metrics: EngineMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Exposed sample name -> [(labels, value)], parsed back from render()."""
    body, _ = metrics.render()
    parsed: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            parsed.setdefault(s.name, []).append((s.labels, s.value))
    return parsed


def value(parsed: dict, name: str, **labels: str) -> float:
    matches = [v for lab, v in parsed["ketch:" + name] if labels.items() <= lab.items()]
    assert len(matches) == 1, (name, labels, parsed.get("ketch:" + name))
    return matches[0]


def generate(llm: LLM, metrics: EngineMetrics, prompts: list[str], params: list) -> list:
    outputs = llm.generate(prompts, params)
    for output in outputs:
        metrics.observe_finished(output.metrics)
        metrics.observe_http("/v1/completions", 200)  # as the server will
    metrics.update(llm.engine.snapshot())
    return outputs


@pytest.fixture(scope="module")
def run() -> Run:
    llm = LLM(model="tiny", block_size=16, kv_cache_memory="64MiB")
    metrics = EngineMetrics(MODEL)
    metrics.set_block_size(16)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # First the shared prefix alone, so its blocks are cached before the others arrive.
    outputs = generate(llm, metrics, [SHARED_PREFIX + "and"], [greedy])
    stop_at = outputs[0].outputs[0].token_ids[3]
    stopping = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_at])
    prompts = [SHARED_PREFIX + "and", SHARED_PREFIX + "but", "The quick brown fox"]
    outputs += generate(llm, metrics, prompts, [stopping, greedy, greedy])
    metrics.update(llm.engine.snapshot())  # a repeated update must not count hits twice
    return Run(outputs, llm.engine.snapshot(), metrics)


def test_every_design_name_is_exposed_with_the_model_label(run: Run):
    parsed = samples(run.metrics)
    names = [*GAUGES, *COUNTERS, *(f"{h}_{s}" for h in HISTOGRAMS for s in ("bucket", "sum"))]
    names += [f"{h}_count" for h in HISTOGRAMS]
    for name in names:
        assert "ketch:" + name in parsed, name
        assert all(labels["model_name"] == MODEL for labels, _ in parsed["ketch:" + name])
    assert not [name for name in parsed if name.endswith("_created")]


def family_name(sample_name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        base = sample_name.removesuffix(suffix)
        if base != sample_name and base.removeprefix("ketch:") in HISTOGRAMS:
            return base
    return sample_name


def test_exposed_names_are_exactly_the_design_ones(run: Run):
    families = {family_name(name) for name in samples(run.metrics)}
    ketch = {"ketch:" + n for n in GAUGES + HISTOGRAMS + COUNTERS}
    vllm = {"vllm:" + n for n in [*VLLM_COPIES, VLLM_INFO]}
    assert families == ketch | vllm


def test_counters_count_what_happened(run: Run):
    parsed = samples(run.metrics)
    finished = run.finished
    assert len(finished) == len(run.outputs) == 4
    assert value(parsed, "requests_number") == 4
    assert value(parsed, "prompt_tokens_total") == sum(len(o.prompt_token_ids) for o in run.outputs)
    generated = sum(len(o.outputs[0].token_ids) for o in run.outputs)
    assert value(parsed, "generation_tokens_total") == generated
    reasons = Counter(o.outputs[0].finish_reason for o in run.outputs)
    assert reasons["stop"] >= 1 and reasons["length"] >= 1
    for reason in ("stop", "length", "abort"):
        assert value(parsed, "request_success_total", finish_reason=reason) == reasons[reason]


def test_histograms_observe_each_finished_request(run: Run):
    parsed = samples(run.metrics)
    for name in HISTOGRAMS:
        if name == "kv_handover_seconds":  # decode role only
            assert value(parsed, name + "_count") == 0
        elif name != "time_per_output_token_seconds":
            assert value(parsed, name + "_count") == 4, name
            assert value(parsed, name + "_bucket", le="+Inf") == 4, name
    with_tpot = sum(m.time_per_output_token is not None for m in run.finished)
    assert value(parsed, "time_per_output_token_seconds_count") == with_tpot
    prompt_tokens = sum(m.num_prompt_tokens for m in run.finished)
    assert value(parsed, "request_prompt_tokens_sum") == prompt_tokens
    buckets = [v for lab, v in parsed["ketch:request_generation_tokens_bucket"]]
    assert buckets == sorted(buckets)  # cumulative
    assert value(parsed, "request_generation_tokens_bucket", le="8.0") == 4


def test_gauges_reflect_the_snapshot(run: Run):
    parsed, snap = samples(run.metrics), run.snapshot
    assert value(parsed, "max_kv_block_num") == snap.total_kv_blocks > 0
    assert value(parsed, "free_kv_block_num") == snap.total_kv_blocks  # all finished
    assert value(parsed, "num_requests_running") == value(parsed, "num_requests_waiting") == 0
    assert value(parsed, "max_batch_size") == snap.max_batch_size
    assert value(parsed, "batch_size") == snap.batch_size
    assert value(parsed, "kv_cache_usage_perc") == pytest.approx(snap.kv_cache_usage)


def test_prefix_hits_give_a_rate_and_are_counted_once(run: Run):
    parsed, snap = samples(run.metrics), run.snapshot
    assert snap.prefix_hit_tokens > 0
    rate = snap.prefix_hit_tokens / snap.prefix_query_tokens
    assert 0 < value(parsed, "hit_token_rate") == pytest.approx(rate)
    assert value(parsed, "prefix_cache_token_num") == snap.prefix_hit_tokens


def snapshot(hit: int, query: int) -> EngineSnapshot:
    return EngineSnapshot(0, 0, 0.0, 10, 10, 0, 4, 0, query, hit)


def test_prefix_counter_adds_only_deltas():
    metrics = EngineMetrics(MODEL)
    for hit in (0, 16, 16, 48):
        metrics.update(snapshot(hit, 100))
    assert value(samples(metrics), "prefix_cache_token_num") == 48
    assert value(samples(metrics), "hit_token_rate") == pytest.approx(0.48)
    metrics.update(snapshot(0, 0))
    assert value(samples(metrics), "hit_token_rate") == 0


def test_instances_do_not_collide(run: Run):
    other = EngineMetrics("other-model")
    other.observe_http("/health", 200)
    parsed = samples(other)
    assert value(parsed, "requests_number") == 0
    assert {lab["model_name"] for lab, _ in parsed["ketch:requests_number"]} == {"other-model"}
    assert value(samples(run.metrics), "requests_number") == 4
    paths = {lab["path"] for lab, _ in samples(run.metrics)["ketch:http_requests_total"]}
    assert paths == {"/v1/completions"}
    assert EngineMetrics(MODEL).registry is not run.metrics.registry


def test_http_requests_are_counted_by_path_and_status():
    metrics = EngineMetrics(MODEL)
    for path, status in [("/v1/completions", 200), ("/v1/completions", 200),
                         ("/v1/completions", 400), ("/metrics", 200)]:  # fmt: skip
        metrics.observe_http(path, status)
    parsed = samples(metrics)
    assert value(parsed, "http_requests_total", path="/v1/completions", status_code="200") == 2
    assert value(parsed, "http_requests_total", path="/v1/completions", status_code="400") == 1
    assert value(parsed, "http_requests_total", path="/metrics", status_code="200") == 1


def test_render_returns_the_prometheus_text_content_type():
    body, content_type = EngineMetrics(MODEL).render()
    assert content_type.startswith("text/plain")
    assert body.startswith(b"# HELP ketch:")


# --- GAIE's model-server protocol: the vLLM-named copies (docs/observability.md) ---------------


def vllm_samples(metrics: EngineMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    return {k: v for k, v in samples(metrics).items() if k.startswith("vllm:")}


def test_vllm_gauges_copy_the_ketch_ones_with_vllm_labels(run: Run):
    parsed = samples(run.metrics)
    for vllm_name, ketch_name in VLLM_COPIES.items():
        [(labels, got)] = parsed["vllm:" + vllm_name]
        assert labels == {"model_name": MODEL, "engine": "0"}
        assert got == value(parsed, ketch_name)


def test_vllm_gauges_follow_a_loaded_snapshot():
    metrics = EngineMetrics(MODEL)
    metrics.set_block_size(64)
    # 3 running, 5 waiting, 40% of 250 blocks in use: what a busy engine reports.
    metrics.update(EngineSnapshot(3, 5, 0.4, 150, 250, 3, 8, 0, 0, 0))
    parsed = samples(metrics)
    for vllm_name, ketch_name in VLLM_COPIES.items():
        [(_, got)] = parsed["vllm:" + vllm_name]
        assert got == value(parsed, ketch_name)
    assert [v for _, v in parsed["vllm:num_requests_waiting"]] == [5]
    assert [v for _, v in parsed["vllm:num_requests_running"]] == [3]
    assert [v for _, v in parsed["vllm:kv_cache_usage_perc"]] == [pytest.approx(0.4)]
    [(labels, info)] = parsed["vllm:cache_config_info"]
    assert info == 1
    assert labels["block_size"] == "64" and labels["num_gpu_blocks"] == "250"
    assert labels["model_name"] == MODEL and labels["engine"] == "0"


def test_cache_config_info_names_the_real_engine_blocks(run: Run):
    parsed = samples(run.metrics)
    [(labels, info)] = parsed["vllm:cache_config_info"]
    assert info == 1
    assert labels["block_size"] == "16"
    assert labels["num_gpu_blocks"] == str(run.snapshot.total_kv_blocks)
    assert int(labels["num_gpu_blocks"]) == value(parsed, "max_kv_block_num") > 0


def test_cache_config_info_waits_for_both_facts():
    metrics = EngineMetrics(MODEL)  # neither block size nor block count yet
    assert "vllm:cache_config_info" not in samples(metrics)
    metrics.update(EngineSnapshot(0, 0, 0.0, 10, 10, 0, 4, 0, 0, 0))
    assert "vllm:cache_config_info" not in samples(metrics)  # still no block size
    metrics.set_block_size(32)
    [(labels, _)] = samples(metrics)["vllm:cache_config_info"]
    assert (labels["block_size"], labels["num_gpu_blocks"]) == ("32", "10")
    # The protocol's required gauges are there from the start, at 0.
    assert {n.removeprefix("vllm:") for n in vllm_samples(EngineMetrics(MODEL))} == set(VLLM_COPIES)


@pytest.mark.parametrize("bad", [0, -16, 2**53, 10**100, 16.0, "16", None, True, [16]])
def test_set_block_size_rejects_bad_values(bad):
    metrics = EngineMetrics(MODEL)
    with pytest.raises((TypeError, ValueError), match="block_size"):
        metrics.set_block_size(bad)
    assert "vllm:cache_config_info" not in samples(metrics)  # nothing half-set


def test_hostile_model_names_stay_parseable():
    name = 'a"b\\c\nd{e}=,' + "x" * 10_000
    metrics = EngineMetrics(name)
    metrics.set_block_size(16)
    metrics.update(EngineSnapshot(1, 2, 0.5, 5, 10, 1, 4, 0, 0, 0))
    parsed = vllm_samples(metrics)
    assert len(parsed) == len(VLLM_COPIES) + 1
    assert all(labels["model_name"] == name for v in parsed.values() for labels, _ in v)
