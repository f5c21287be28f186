"""The engine's bookkeeping of each request's outputs between its deltas (``LLMEngine``).

``OutputState`` holds what a request's next ``TokenDelta`` will carry (its logprobs and prompt
logprobs since the last one, how many tokens went out) and its timeline for ``request_metrics``,
what its end reports. The engine makes no text: the API server does (``output_processor``).
Embedding requests (``SamplingParams.pooling``) end with one delta carrying the pooled vector
the runner sent, checked here against the model's hidden size before it goes anywhere.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ketch.engine.core.request import Request
from ketch.engine.models.config import ModelConfig
from ketch.engine.outputs import TokenDelta, TokenLogprob
from ketch.engine.stats import RequestMetrics


@dataclass
class OutputState:
    """Engine-side bookkeeping for one request's outputs: what its next delta will carry."""

    logprobs: list[TokenLogprob] | None  # of the tokens since the last delta
    final_only: bool = False  # one delta, at the end
    prompt_logprobs: list[TokenLogprob] | None = None  # sent with the first delta
    emitted_tokens: int = 0
    first_token_time: float | None = None
    kv_handover_seconds: float | None = None
    pooling: bool = False  # an embedding request: its one delta carries ``embedding``
    embedding: list[float] | None = None


def take_embeddings(
    states: dict[str, OutputState], pooled: dict[str, list[float]], model: ModelConfig
) -> dict[str, str]:
    """Keeps each finished embedding request's vector; returns those that cannot be one
    (request id -> why): they fail."""
    bad = {}
    for request_id, vector in pooled.items():
        mine = states.get(request_id)
        if mine is None or not mine.pooling:
            continue
        problem = embedding_problem(vector, model.hidden_size)
        if problem is None:
            mine.embedding = vector
        else:
            bad[request_id] = problem
    return bad


def embedding_problem(vector: list[float], hidden_size: int) -> str | None:
    """Why a pooled vector from the runner cannot be an embedding of this model, or None."""
    if len(vector) != hidden_size:
        return f"the runner pooled {len(vector)} values; the model's hidden size is {hidden_size}"
    if not all(map(math.isfinite, vector)):
        return "the pooled hidden state is not finite"
    return None


def embedding_delta(request: Request, state: OutputState) -> TokenDelta:
    """The one delta of a finished embedding request: no tokens, its vector."""
    return TokenDelta(
        request_id=request.request_id,
        finish_reason=request.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        embedding=state.embedding,
        metrics=request_metrics(request, state),
    )


def request_metrics(request: Request, state: OutputState) -> RequestMetrics:
    """What a request's end reports (an embedding request has no first token: no TTFT)."""
    return RequestMetrics(
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=state.first_token_time,
        finished_time=time.monotonic(),
        num_prompt_tokens=request.num_prompt_tokens,
        num_generation_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_cached_tokens,
        num_preemptions=request.num_preemptions,
        finish_reason=request.finish_reason or "abort",
        kv_handover_seconds=state.kv_handover_seconds,
        epoch_offset_ns=time.time_ns() - time.monotonic_ns(),
    )
