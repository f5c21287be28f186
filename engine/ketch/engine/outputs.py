"""What the engine hands back for each request, and what the API server makes of it.

The engine emits ``TokenDelta``s (what is new for a request since its last one: token ids,
logprobs, a finish reason; never text); the engine process sends them to the API server as they
are. There the output processor (``ketch.engine.output_processor``, also ``LLM``'s) turns each
into a ``RequestDelta``: the same with its text, cut at a stop string. A streamed response turns
each ``RequestDelta`` into a chunk. Only a response that needs the whole sequence
(``LLM.generate``, a non-streaming HTTP response, a tool call parsed at its end) adds them up,
in place (``choices.Choice``), into a ``CompletionOutput``. ``TokenLogprob`` is the one shape of
a log-probability from the engine to the HTTP body, on every wire in between.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ketch.engine.stats import RequestMetrics

MAX_EMBEDDING_SIZE = 1 << 16
"""Most values an embedding may have on a wire (the engine checks the model's hidden size)."""


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
class TokenDelta:
    """What the engine has new for one request since its last delta (or its rejection, in
    ``error``): tokens, never text.

    ``logprobs`` (when asked for) has one entry per token of ``new_token_ids``;
    ``prompt_logprobs`` (when asked for) comes on the request's first delta only;
    ``stop_reason`` is the stop token id that ended it, if one did.
    An embedding request (``SamplingParams.pooling``) has one delta, its finishing one, with
    no tokens and its pooled vector in ``embedding``.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    # One per prompt token after the first.
    prompt_logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    error_code: int = 400  # the HTTP status ``error`` maps to (503: the engine failed)
    metrics: RequestMetrics | None = None  # on the finishing delta
    embedding: list[float] | None = None

    def __post_init__(self) -> None:
        _check(self.error_code, self.embedding)  # decoded from the engine process

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class RequestDelta:
    """A ``TokenDelta`` with its text, as the API server's endpoints and ``LLM`` see it.

    ``stop_reason`` is the stop token id or the stop string that ended the output; a stop
    string is not in ``new_text``, nor are the tokens after it in ``new_token_ids``.
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
    embedding: list[float] | None = None

    def __post_init__(self) -> None:
        _check(self.error_code, self.embedding)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def _check(error_code: int, embedding: list[float] | None) -> None:
    if not 400 <= error_code <= 599:  # relayed to a client as its HTTP status
        raise ValueError(f"error_code must be an HTTP error status, got {error_code}")
    if embedding is not None:  # bounded, finite
        if not 0 < len(embedding) <= MAX_EMBEDDING_SIZE:
            raise ValueError(f"embedding must have 1 to {MAX_EMBEDDING_SIZE} values")
        if not all(map(math.isfinite, embedding)):
            raise ValueError("embedding values must be finite")


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


@dataclass
class EmbeddingOutput:
    """A prompt's embedding, as ``LLM.embed`` returns it: the pooled final-normed hidden
    state (L2-normalised unless asked not to)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    embedding: list[float]
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None

    @property
    def outputs(self) -> EmbeddingOutput:
        """Itself: vLLM's ``LLM.embed`` outputs are read as ``output.outputs.embedding``."""
        return self


def l2_normalized(values: list[float]) -> list[float]:
    """``values`` scaled to unit length (a zero vector stays zero)."""
    norm = math.sqrt(math.fsum(v * v for v in values))
    return [v / max(norm, 1e-12) for v in values]
