"""The API server's spans for a request (tracing on only; imports OpenTelemetry through
``ketch.engine.tracing_otel``).

A traced request's server span (``chat <model>``, ``text_completion <model>``,
``embeddings <model>``) gets OTel GenAI attributes when it ends, and one child span per phase
of each of its engine requests: ``engine.queue`` (arrival to first scheduled), ``engine.prefill``
(to the first token) and ``engine.decode`` (to the end). Their times are the engine process's
own (``RequestMetrics``), made wall-clock epoch nanoseconds with the offset the engine sent
along; nothing is recorded per token.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI
from opentelemetry.trace import Span

from ketch.engine.choices import Choice, usage_counts
from ketch.engine.stats import RequestMetrics
from ketch.engine.tracing_otel import RequestTrace, Tracing

OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
}


def install(app: FastAPI, tracing: Tracing, model: str) -> None:
    """Adds the tracing middleware to ``ketch serve``'s app."""
    routes = {path: f"{op} {model}" for path, op in OPERATIONS.items()}

    def finish(record: RequestTrace, span: Span) -> None:
        operation = OPERATIONS.get(_route(span), "")
        span.set_attribute("gen_ai.operation.name", operation)
        span.set_attribute("gen_ai.request.model", model)
        if record.choices:
            describe(tracing, record, span, record.choices, model)

    app.add_middleware(tracing.middleware(routes, finish))


def _route(span: Span) -> str:
    attributes = getattr(span, "attributes", None) or {}
    return str(attributes.get("http.route", ""))


def describe(
    tracing: Tracing, record: RequestTrace, span: Span, choices: list[Choice], model: str
) -> None:
    """The request's GenAI attributes and its engine requests' phase spans."""
    params = choices[0].params
    prompt, output, cached = usage_counts(choices)
    attributes: dict[str, Any] = {
        "gen_ai.response.model": model,
        "gen_ai.request.id": choices[0].request_id,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.choice.count": len(choices),
        "gen_ai.usage.input_tokens": prompt,
        "gen_ai.usage.output_tokens": output,
        "ketch.usage.cached_tokens": cached,
        "gen_ai.response.finish_reasons": [c.finish_reason or "abort" for c in choices],
    }
    if params.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = params.max_tokens
    if len(choices) > 1:
        attributes["ketch.request_ids"] = [c.request_id for c in choices]
    if choices[0].prefill_peer:
        attributes["ketch.prefill.peer"] = choices[0].prefill_peer
    first = choices[0].metrics
    if first is not None:
        attributes.update(latencies(first))
    span.set_attributes(attributes)
    if record.complete and any(c.finish_reason is None for c in choices):
        record.incomplete_reason = "an engine request did not finish (failed or aborted)"
    for choice in choices:
        if choice.metrics is not None:
            phases(tracing, span, choice, choice.metrics)


def latencies(m: RequestMetrics) -> dict[str, float | int]:
    """vLLM's ``gen_ai.latency.*`` attributes (seconds) from one engine request's timeline."""
    out: dict[str, float | int] = {"gen_ai.latency.e2e": m.e2e_latency}
    if m.queue_time is not None:
        out["gen_ai.latency.time_in_queue"] = m.queue_time
    if m.time_to_first_token is not None:
        out["gen_ai.latency.time_to_first_token"] = m.time_to_first_token
    if m.first_scheduled_time is not None:
        out["gen_ai.latency.time_in_model_inference"] = m.finished_time - m.first_scheduled_time
        if m.first_token_time is not None:
            out["gen_ai.latency.time_in_model_prefill"] = (
                m.first_token_time - m.first_scheduled_time
            )
    if m.first_token_time is not None:
        out["gen_ai.latency.time_in_model_decode"] = m.finished_time - m.first_token_time
    if m.time_per_output_token is not None:
        out["ketch.latency.time_per_output_token"] = m.time_per_output_token
    if m.kv_handover_seconds is not None:
        out["ketch.latency.kv_handover"] = m.kv_handover_seconds
    out["ketch.num_preemptions"] = m.num_preemptions
    return out


def phases(tracing: Tracing, parent: Span, choice: Choice, m: RequestMetrics) -> None:
    """``engine.queue``, ``engine.prefill``, ``engine.decode`` under ``parent``: as far as the
    engine request got (an aborted one ends in the phase it was in, marked an error)."""
    offset = m.epoch_offset_ns
    if offset is None:  # an engine that sent none: the same host's monotonic clock
        offset = time.time_ns() - time.monotonic_ns()

    def ns(t: float) -> int:
        return int(t * 1e9) + offset

    common = {"gen_ai.request.id": choice.request_id, "ketch.choice.index": choice.index}
    marks = [("engine.queue", m.arrival_time), ("engine.prefill", m.first_scheduled_time)]
    marks.append(("engine.decode", m.first_token_time))
    reached = [(name, t) for name, t in marks if t is not None]
    ends = [t for _, t in reached[1:]] + [m.finished_time]
    for i, ((name, start), end) in enumerate(zip(reached, ends, strict=True)):
        attributes: dict[str, Any] = dict(common)
        if name == "engine.prefill":
            attributes["gen_ai.usage.input_tokens"] = m.num_prompt_tokens
            attributes["ketch.usage.cached_tokens"] = m.num_cached_tokens
        elif name == "engine.decode":
            attributes["gen_ai.usage.output_tokens"] = m.num_generation_tokens
        last = i == len(reached) - 1
        if last:
            attributes["gen_ai.response.finish_reasons"] = [m.finish_reason]
        error = "aborted" if last and m.finish_reason == "abort" else None
        tracing.child(parent, name, ns(start), ns(end), attributes, error)
