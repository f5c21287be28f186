"""Messages between the API server and the engine process: small, typed, JSON on the wire.

Each step's ``RequestDelta``s (``ketch.engine.outputs``, what the engine emits) travel as they
are, in one ``StepOutputs``.

Nothing here is pickled: each message encodes itself to a tagged JSON object and decodes back,
so either side can be replaced (or inspected with a plain ZMQ client) without sharing objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from ketch.engine import wire
from ketch.engine.outputs import RequestDelta
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.stats import EngineSnapshot


@dataclass
class AddRequest:
    """Queue a tokenised request; outputs stream back as ``RequestDelta`` messages.

    ``prefill`` (decode role): the prefill peer's pd-comm "host:port", as the router paired
    them. Where the peer pushes the KV is this instance's configuration, never the request's."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    final_only: bool = False
    prefill: str | None = None


@dataclass
class AbortRequests:
    request_ids: list[str]


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
    vocab_size: int = 0  # the model's: the API server checks token ids against it
    hidden_size: int = 0  # the model's: the size of its embeddings (/v1/embeddings)


@dataclass
class EngineFailed:
    """Sent instead of ``EngineReady`` when the engine cannot start (bad model, bad config)."""

    error: str


__all__ = [
    "AbortRequests", "AddRequest", "EngineFailed", "EngineReady", "RequestDelta", "StepOutputs",
    "decode", "encode",
]  # fmt: skip

Message = AddRequest | AbortRequests | StepOutputs | EngineReady | EngineFailed
_TYPES = wire.registry(AddRequest, AbortRequests, StepOutputs, EngineReady, EngineFailed)


def encode(message: Message) -> bytes:
    return wire.encode(message)


def decode(data: bytes) -> Message:
    """Parses one message; raises wire.MessageError on anything malformed."""
    return wire.decode(data, _TYPES, "engine")
