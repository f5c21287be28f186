"""One step's flattened model inputs and the runner's copy of each live request: what the model
runner builds and what speculative decoding's runner side reads (``spec_decode.runner_side``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ketch.engine.models.attention import SequenceSpan
from ketch.engine.worker.pooling import HiddenRows, Pooler
from ketch.engine.worker.sampler import SamplingState


@dataclass
class StepInputs:
    """One step's flattened model inputs."""

    input_ids: np.ndarray
    positions: np.ndarray
    spans: list[SequenceSpan] = field(default_factory=list)
    sampling_ids: list[str] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    # prompt_logprobs: the rows whose logits score prompt tokens, and per request
    # (request id, index of the first prompt token scored, how many), in row order.
    prompt_rows: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[str, int, int]] = field(default_factory=list)
    hidden: HiddenRows = field(default_factory=HiddenRows)  # embedding requests'
    # Speculative decoding: per request, its drafts and the index in ``spec_rows`` of the row
    # scoring the first (each draft's position has a row: it scores the token after it).
    drafts: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    spec_rows: list[int] = field(default_factory=list)
    # The request of each span (``spans``' order), for proposers that read hidden states.
    span_ids: list[str] = field(default_factory=list)


@dataclass
class RequestState:
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingState
    next_prompt_logprob: int = 1  # the next prompt token to score (prompt_logprobs)
    pooler: Pooler | None = None  # an embedding request's (SamplingParams.pooling)


def add_prompt_rows(
    batch: StepInputs, request_id: str, state: RequestState, start: int, n: int
) -> None:
    """Rows of this chunk (positions begin..begin+n-1, from row ``start``) whose logits score a
    prompt token not scored yet: position j scores token j + 1. A request resumed after a
    preemption recomputes its prompt without scoring it twice."""
    begin = state.num_computed_tokens
    first = max(state.next_prompt_logprob, begin + 1)
    last = min(state.sampling.num_prompt_tokens - 1, begin + n)  # inclusive
    if first > last:
        return
    batch.prompt_rows.extend(range(start + first - 1 - begin, start + last - begin))
    batch.prompt_spans.append((request_id, first, last - first + 1))
    state.next_prompt_logprob = last + 1
