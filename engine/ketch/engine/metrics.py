"""Prometheus metrics for one engine, under the names fixed in DESIGN.md ("Engine metrics").

``EngineMetrics`` turns the engine's plain records (``ketch.engine.stats``) into metrics: feed it
each finished request's ``RequestMetrics`` and an ``EngineSnapshot`` after each step, then serve
``render()`` on ``/metrics``. The autoscaler and router query these names verbatim.

It keeps its own state and its own ``CollectorRegistry`` (never the global one), so several
engines or tests in one process do not collide. It exposes its state through a custom collector
rather than ``prometheus_client.Counter``/``Histogram`` objects, for two reasons:

* no ``*_created`` samples, without flipping prometheus_client's process-wide
  ``disable_created_metrics()`` switch;
* the exposed sample names are exactly the DESIGN.md ones. prometheus_client always appends
  ``_total`` to a counter, so the two counters DESIGN.md names without ``_total``
  (``requests_number``, ``prefix_cache_token_num``) are exposed as ``untyped``; PromQL's
  ``rate()``/``increase()`` work on them as on any counter.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    UnknownMetricFamily,
)
from prometheus_client.utils import floatToGoString

from ketch.engine.metrics_vllm import cache_config_labels, vllm_families
from ketch.engine.stats import EngineSnapshot, RequestMetrics

PREFIX = "ketch:"

# Bucket upper bounds. Latencies in seconds: TTFT spans a prefix-cache hit on a short prompt
# (~1 ms) to a long prefill behind a full queue (~60 s); TPOT spans one fast decode step (~1 ms)
# to a heavily batched CPU step (~2.5 s); e2e and queue time reach a 10-minute generation.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0,
)  # fmt: skip
TPOT_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 600.0,
)  # fmt: skip
# Token counts: powers of two from 1 to 64k, the longest context we expect to serve.
TOKEN_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(17))

# Always exposed (at 0 until seen) so rate() queries per reason have a series from the start.
FINISH_REASONS = ("stop", "length", "abort")

_GAUGES = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV cache blocks in use (0 to 1).",
    "free_kv_block_num": "Free KV cache blocks.",
    "max_kv_block_num": "Usable KV cache blocks in total.",
    "batch_size": "Requests in the last step's batch.",
    "max_batch_size": "Most requests one step may batch (max_num_seqs).",
    "hit_token_rate": "Prefix cache hit tokens / looked-up prompt tokens, since start.",
}


@dataclass
class _Histogram:
    """Bucket counts and sum of one histogram; the last count is the +Inf bucket."""

    name: str
    documentation: str
    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        # bisect_left puts a value equal to a bound in that bound's bucket: Prometheus' `le`.
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def family(self, model_name: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(
            PREFIX + self.name, self.documentation, labels=["model_name"]
        )
        family.add_metric([model_name], self._cumulative_buckets(), self.total)
        return family

    def _cumulative_buckets(self) -> list[tuple[str, float]]:
        bounds = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        running, buckets = 0, []
        for bound, count in zip(bounds, self.counts, strict=True):
            running += count
            buckets.append((bound, float(running)))
        return buckets


def _histograms() -> dict[str, _Histogram]:
    specs = [
        ("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS),
        ("time_per_output_token_seconds", "Mean time per token after the first.", TPOT_BUCKETS),
        ("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS),
        ("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS),
        ("request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS),
        ("request_generation_tokens", "Generated tokens per finished request.", TOKEN_BUCKETS),
        (
            "kv_handover_seconds",
            "Decode role: the prefill peer's end of prefill to this instance taking the request "
            "over (KV transfer and hand-over).",
            TTFT_BUCKETS,
        ),
    ]
    return {name: _Histogram(name, doc, bounds) for name, doc, bounds in specs}


class EngineMetrics:
    """All of one engine's Prometheus metrics, with their own registry.

    Thread-safe: the engine loop and HTTP handlers may feed it and render it concurrently.
    Every metric carries the constant label ``model_name``.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._gauges = dict.fromkeys(_GAUGES, 0.0)
        self._histograms = _histograms()
        self._requests = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._success = dict.fromkeys(FINISH_REASONS, 0)
        self._prefix_cache_tokens = 0
        self._last_hit_tokens = 0
        self._http: dict[tuple[str, str], int] = {}
        self._precision: tuple[str, str, str] | None = None
        self._weight_bytes = 0
        self._speculative = False
        self._block_size: int | None = None
        self._spec = dict.fromkeys(_SPEC_COUNTERS, 0)  # totals, advanced like the hit counter
        self._last_spec = dict.fromkeys(_SPEC_COUNTERS, 0)
        self.registry.register(self)

    def set_model(self, dtype: str, quantization: str, kv_cache_dtype: str, weight_bytes: int):
        """How the engine computes: exposed as ``model_weight_bytes`` with these as labels."""
        with self._lock:
            self._precision = (dtype, quantization, kv_cache_dtype)
            self._weight_bytes = weight_bytes

    def set_block_size(self, block_size: int) -> None:
        """Tokens per KV block: with the block count, exposed as ``vllm:cache_config_info``."""
        cache_config_labels(block_size, 1, "float32")  # type and range checks
        with self._lock:
            self._block_size = block_size

    def observe_finished(self, metrics: RequestMetrics) -> None:
        """Records one finished request (any finish reason, aborts included)."""
        with self._lock:
            self._requests += 1
            self._prompt_tokens += metrics.num_prompt_tokens
            self._generation_tokens += metrics.num_generation_tokens
            reason = metrics.finish_reason
            self._success[reason] = self._success.get(reason, 0) + 1
            self._observe_latencies(metrics)
            self._histograms["request_prompt_tokens"].observe(metrics.num_prompt_tokens)
            self._histograms["request_generation_tokens"].observe(metrics.num_generation_tokens)

    def _observe_latencies(self, metrics: RequestMetrics) -> None:
        # A request aborted before its first token has no TTFT; one with a single token no TPOT.
        latencies = {
            "time_to_first_token_seconds": metrics.time_to_first_token,
            "time_per_output_token_seconds": metrics.time_per_output_token,
            "e2e_request_latency_seconds": metrics.e2e_latency,
            "request_queue_time_seconds": metrics.queue_time,
            "kv_handover_seconds": metrics.kv_handover_seconds,
        }
        for name, value in latencies.items():
            if value is not None:
                self._histograms[name].observe(value)

    def update(self, snapshot: EngineSnapshot) -> None:
        """Sets the gauges from the engine's state after a step and advances the hit counter."""
        with self._lock:
            self._gauges.update(_gauge_values(snapshot))
            # The snapshot's count is cumulative: add only what is new, so repeated updates with
            # the same snapshot never double count (and a restarted engine never subtracts).
            self._prefix_cache_tokens += max(0, snapshot.prefix_hit_tokens - self._last_hit_tokens)
            self._last_hit_tokens = snapshot.prefix_hit_tokens
            self._speculative = snapshot.speculative
            for name, (field, _) in _SPEC_COUNTERS.items():
                now = getattr(snapshot, field)
                self._spec[name] += max(0, now - self._last_spec[name])
                self._last_spec[name] = now

    def observe_http(self, path: str, status_code: int) -> None:
        """Counts one HTTP request served (pass a route template, not a raw URL, for `path`)."""
        key = (path, str(status_code))
        with self._lock:
            self._http[key] = self._http.get(key, 0) + 1

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every metric, and its Content-Type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def collect(self) -> Iterator[Metric]:
        """The prometheus_client collector protocol; called by the registry on each scrape."""
        with self._lock:
            families = [
                *self._gauge_families(),
                *(h.family(self.model_name) for h in self._histograms.values()),
                *self._counter_families(),
                *vllm_families(self.model_name, self._gauges, self._cache_config()),
            ]
        yield from families

    def _cache_config(self) -> dict[str, str] | None:
        blocks = int(self._gauges["max_kv_block_num"])
        if self._block_size is None or blocks <= 0:
            return None  # not known yet: no info rather than a wrong one
        dtype = self._precision[2] if self._precision is not None else "auto"
        return cache_config_labels(self._block_size, blocks, dtype)

    def _gauge_families(self) -> Iterator[Metric]:
        for name, doc in _GAUGES.items():
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], self._gauges[name])
            yield family
        if self._precision is not None:
            family = GaugeMetricFamily(
                PREFIX + "model_weight_bytes",
                "Bytes of the model's weights in memory (every tensor-parallel rank's), at "
                "the precision the labels name: dtype (the weights'), quantization (of the "
                "linear layers) and kv_cache_dtype.",
                labels=["model_name", "dtype", "quantization", "kv_cache_dtype"],
            )
            family.add_metric([self.model_name, *self._precision], self._weight_bytes)
            yield family
        if self._speculative:
            spec = self._spec
            drafted, steps = spec["spec_decode_num_draft_tokens_total"], spec["_drafted_steps"]
            accepted = spec["spec_decode_num_accepted_tokens_total"]
            emitted = spec["spec_decode_num_emitted_tokens_total"]
            yield self._gauge(
                "spec_decode_draft_acceptance_rate",
                "Speculative decoding: proposed tokens the model kept, of all proposed.",
                accepted / drafted if drafted else 0.0,
            )
            yield self._gauge(
                "spec_decode_mean_accepted_length",
                "Speculative decoding: tokens emitted per request-step that had proposals "
                "(the proposals kept plus the model's own token; 1 = none kept).",
                emitted / steps if steps else 0.0,
            )

    def _counter_families(self) -> Iterator[Metric]:
        yield self._untyped("requests_number", "Finished requests.", self._requests)
        yield self._counter("prompt_tokens_total", "Prompt tokens.", self._prompt_tokens)
        yield self._counter("generation_tokens_total", "Generated tokens.", self._generation_tokens)
        yield self._untyped(
            "prefix_cache_token_num",
            "Prompt tokens served from the prefix cache.",
            self._prefix_cache_tokens,
        )
        success = CounterMetricFamily(
            PREFIX + "request_success_total",
            "Finished requests by finish reason.",
            labels=["model_name", "finish_reason"],
        )
        for reason, count in self._success.items():
            success.add_metric([self.model_name, reason], count)
        yield success
        http = CounterMetricFamily(
            PREFIX + "http_requests_total",
            "HTTP requests served.",
            labels=["model_name", "path", "status_code"],
        )
        for (path, status), count in sorted(self._http.items()):
            http.add_metric([self.model_name, path, status], count)
        yield http
        if self._speculative:
            for name, (_, doc) in _SPEC_COUNTERS.items():
                if doc:
                    yield self._counter(name.removesuffix("_total"), doc, self._spec[name])

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _untyped(self, name: str, doc: str, value: float) -> Metric:
        family = UnknownMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family


_SPEC_COUNTERS = {
    # metric name -> (EngineSnapshot field, help; none: kept for the gauges only)
    "spec_decode_num_draft_tokens_total": (
        "spec_draft_tokens",
        "Speculative decoding: tokens proposed (and computed by the model to check them).",
    ),
    "spec_decode_num_accepted_tokens_total": (
        "spec_accepted_tokens",
        "Speculative decoding: proposed tokens the model agreed with (kept).",
    ),
    "spec_decode_num_emitted_tokens_total": (
        "spec_emitted_tokens",
        "Speculative decoding: tokens emitted by request-steps that had proposals.",
    ),
    "spec_decode_steps_off_total": (
        "spec_steps_off",
        "Speculative decoding: steps that did not speculate, the batch being larger than "
        "disable_by_batch_size.",
    ),
    "_drafted_steps": ("spec_drafted_steps", ""),
}


def _gauge_values(snapshot: EngineSnapshot) -> dict[str, float]:
    query = snapshot.prefix_query_tokens
    return {
        "num_requests_running": snapshot.num_requests_running,
        "num_requests_waiting": snapshot.num_requests_waiting,
        "kv_cache_usage_perc": snapshot.kv_cache_usage,
        "free_kv_block_num": snapshot.free_kv_blocks,
        "max_kv_block_num": snapshot.total_kv_blocks,
        "batch_size": snapshot.batch_size,
        "max_batch_size": snapshot.max_batch_size,
        "hit_token_rate": snapshot.prefix_hit_tokens / query if query else 0.0,
    }
