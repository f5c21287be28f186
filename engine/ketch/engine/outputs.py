"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field

from ketch.engine.stats import RequestMetrics


@dataclass
class TokenLogprob:
    """One position's log-probability: of the token there, and of the most likely ones."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One generated sequence. Cumulative fields, plus what is new since the last output."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None  # set when finished
    # With SamplingParams.prompt_logprobs: one entry per prompt token after the first.
    prompt_logprobs: list[TokenLogprob] | None = None
