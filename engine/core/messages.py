"""Messages between the API server and the engine process: small, typed, JSON on the wire.

Nothing here is pickled: each message encodes itself to a tagged JSON object and decodes back,
so either side can be replaced (or inspected with a plain ZMQ client) without sharing objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ketch.engine import wire
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.stats import EngineSnapshot, RequestMetrics


@dataclass
class AddRequest:
    """Queue a tokenised request; outputs stream back as ``RequestDelta`` messages.

    ``prefill``/``decode_host`` (decode role): the prefill peer's pd-comm "host:port" and the
    address it reaches this instance at, as the router paired them."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    final_only: bool = False
    prefill: str | None = None
    decode_host: str | None = None


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class RequestDelta:
    """What is new for one request since its last delta (or its rejection, in ``error``)."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # (token id, logprob, [(token id, logprob), ...]) per new token, when asked for.
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    error: str | None = None
    error_code: int | None = None  # the HTTP status for ``error`` when it is not a 400
    metrics: RequestMetrics | None = None  # on the finishing delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class StepOutputs:
    """Everything one engine step produced, and the engine's state after it."""

    deltas: list[RequestDelta]
    snapshot: EngineSnapshot | None = None


@dataclass
class EngineReady:
    """Sent once the model is loaded and the engine accepts requests."""

    max_model_len: int
    num_kv_blocks: int


@dataclass
class EngineFailed:
    """Sent instead of ``EngineReady`` when the engine cannot start (bad model, bad config)."""

    error: str


Message = AddRequest | AbortRequests | StepOutputs | EngineReady | EngineFailed
_TYPES = wire.registry(AddRequest, AbortRequests, StepOutputs, EngineReady, EngineFailed)


def encode(message: Message) -> bytes:
    return wire.encode(message)


def decode(data: bytes) -> Message:
    return wire.decode(data, _TYPES, _convert, "engine")


def _convert(kind: type, body: dict[str, Any]) -> dict[str, Any]:
    if kind is AddRequest:
        body["params"] = SamplingParams(**body["params"])
    elif kind is StepOutputs:
        snapshot = body.get("snapshot")
        body["deltas"] = [_delta(d) for d in body["deltas"]]
        body["snapshot"] = None if snapshot is None else EngineSnapshot(**snapshot)
    return body


def _delta(body: dict[str, Any]) -> RequestDelta:
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = [(t, lp, [tuple(x) for x in top]) for t, lp, top in logprobs]
    metrics = body.get("metrics")
    return RequestDelta(
        **{
            **body,
            "logprobs": logprobs,
            "metrics": None if metrics is None else RequestMetrics(**metrics),
        }
    )
