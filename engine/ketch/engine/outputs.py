"""What the engine hands back for each request: a delta per step, added up only where needed.

The engine emits ``RequestDelta``s (what is new for a request since its last one); the engine
process sends them to the API server as they are, and a streamed response turns each into a
chunk. Only a response that needs the whole sequence (``LLM.generate``, a non-streaming HTTP
response, a tool call parsed at its end) adds them up, in place (``choices.Choice``), into a
``CompletionOutput``. ``TokenLogprob`` is the one shape of a log-probability from the engine to
the HTTP body, on every wire in between.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ketch.engine.stats import RequestMetrics


@dataclass
class TokenLogprob:
    """One position's log-probability: of the token there, and of the most likely ones."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.token_id < 0:  # decoded from a peer: a token id, not an index from the end
            raise ValueError(f"token_id must be >= 0, got {self.token_id}")


@dataclass
class RequestDelta:
    """What is new for one request since its last delta (or its rejection, in ``error``).

    ``logprobs`` (when asked for) has one entry per token of ``new_token_ids``;
    ``prompt_logprobs`` (when asked for) comes on the request's first delta only.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    # One per prompt token after the first.
    prompt_logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    error_code: int = 400  # the HTTP status ``error`` maps to (503: the engine failed)
    metrics: RequestMetrics | None = None  # on the finishing delta

    def __post_init__(self) -> None:
        if not 400 <= self.error_code <= 599:  # relayed to a client as its HTTP status
            raise ValueError(f"error_code must be an HTTP error status, got {self.error_code}")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class CompletionOutput:
    """One generated sequence, whole: its deltas added up."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A prompt's finished choices (``n`` of them), as ``LLM.generate`` returns them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None  # the first choice's
    # With SamplingParams.prompt_logprobs: one entry per prompt token after the first.
    prompt_logprobs: list[TokenLogprob] | None = None
