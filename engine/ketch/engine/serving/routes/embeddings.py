"""``POST /v1/embeddings``: the served decoder's final hidden states, pooled, in OpenAI's shape.

An embedding is the model's final-normed hidden state (after the last RMSNorm: what Hugging
Face's ``model.model(...).last_hidden_state`` holds) pooled over the prompt: the last token's
(``last``, the default of ``--embedding-pooling``) or the mean over every prompt token
(``mean``), then L2-normalised unless ``normalize`` is false. Each input is one engine request
that samples nothing and finishes when its prompt is computed (``SamplingParams.pooling``).

Accepted: ``model``, ``input`` (a string, a list of strings, a list of token ids or a list of
such lists), ``encoding_format`` (``float``, or ``base64``: the little-endian float32 bytes, as
OpenAI sends them and its client asks by default), ``user`` (ignored), ``dimensions`` only when
it equals the model's hidden size (the model has one size; anything else is a 400), and the
extensions ``pooling`` (``last`` | ``mean``) and ``normalize`` (default true). Inputs are at
most ``--max-choices`` per request and ``max_model_len`` tokens each (an embedding needs no
room for output).
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from ketch.engine.engine_client import EngineClient, EngineDeadError
from ketch.engine.outputs import RequestDelta, l2_normalized
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.serving.admission import Slot, check_prompts, read_body
from ketch.engine.serving.protocol import PromptField, ProtocolError, check_model, parse_request
from ketch.engine.serving.state import ServingState, serving_state
from ketch.engine.serving.text_offload import encode

router = APIRouter()


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings`` (see the module docstring for what each field does)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    input: PromptField
    encoding_format: Literal["float", "base64"] | None = None  # None: float
    dimensions: int | None = None
    user: str | None = None  # accepted and ignored
    # Extensions (vLLM has both under these names).
    pooling: Literal["last", "mean"] | None = None  # None: the server's --embedding-pooling
    normalize: bool | None = None  # None: true

    def check_dimensions(self, hidden_size: int) -> None:
        if self.dimensions is not None and self.dimensions != hidden_size:
            raise ProtocolError(
                400,
                f"dimensions={self.dimensions} is not available: this model's embeddings have "
                f"{hidden_size} dimensions (its hidden size); leave dimensions unset",
                param="dimensions",
            )


@router.post("/v1/embeddings")
async def _embeddings(request: Request) -> Response:
    state = serving_state(request)
    slot = state.admit()
    try:
        return await _embedded(state, request, slot)
    finally:
        slot.release()


async def _embedded(state: ServingState, request: Request, slot: Slot) -> JSONResponse:
    """The endpoint's work, inside the request's admission slot."""
    body = parse_request(EmbeddingRequest, await read_body(state.config, request))
    check_model(body.model, [state.model_name])
    body.check_dimensions(state.hidden_size)
    limit = state.config.max_choices
    if len(body.input) > limit:
        raise ProtocolError(
            400,
            f"input has {len(body.input)} items; this server embeds at most {limit} per "
            "request (--max-choices)",
            param="input",
        )
    try:
        slot.resize(len(body.input))
    except ProtocolError as exc:  # over --max-concurrency: the inputs are the sequences
        exc.param = "input" if exc.status_code == 400 else exc.param
        raise
    prompts = [p if isinstance(p, list) else await encode(state, p) for p in body.input]
    params = SamplingParams(pooling=body.pooling or state.config.embedding_pooling)
    check_prompts(state.prompt_limits, prompts, params, field="input")
    deltas = await _embed_all(state.engine, prompts, params)
    normalize = body.normalize is not False
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": _encoded(delta.embedding or [], normalize, body.encoding_format),
        }
        for i, delta in enumerate(deltas)
    ]
    tokens = sum(len(p) for p in prompts)
    return JSONResponse(
        {
            "id": f"embd-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": state.model_name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


async def _embed_all(
    engine: EngineClient, prompts: list[list[int]], params: SamplingParams
) -> list[RequestDelta]:
    """Every prompt's finishing delta, in order; the first failure cancels the rest (their
    engine requests are aborted)."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_embed(engine, prompt, params)) for prompt in prompts]
    except BaseExceptionGroup as failed:  # the first failure is the answer (a ProtocolError)
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


async def _embed(engine: EngineClient, prompt: list[int], params: SamplingParams) -> RequestDelta:
    request_id = f"embd-{uuid.uuid4().hex}"
    try:
        async for delta in engine.generate(request_id, prompt, params, final_only=True):
            if delta.error is not None:
                message = delta.error
                if delta.error_code >= 500:
                    message = f"the engine failed while serving this request: {message}"
                raise ProtocolError(delta.error_code, message)
            if delta.finished:
                if delta.embedding is None:
                    raise ProtocolError(500, "the engine finished without an embedding")
                return delta
    except EngineDeadError as exc:
        raise ProtocolError(503, f"the engine is not running: {exc}") from exc
    raise ProtocolError(500, "the engine ended the request without an answer")


def _encoded(vector: list[float], normalize: bool, encoding_format: str | None) -> Any:
    values = l2_normalized(vector) if normalize else vector
    if encoding_format == "base64":  # little-endian float32, as OpenAI's
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values
