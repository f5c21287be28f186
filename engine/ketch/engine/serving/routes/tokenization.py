"""``POST /tokenize``, ``POST /detokenize`` and ``GET /version``, in vLLM's shapes.

``/tokenize`` takes either a completions-style ``prompt`` (``add_special_tokens`` defaults to
true) or chat ``messages`` rendered with the model's chat template (``add_generation_prompt``,
default true, and ``chat_template_kwargs`` as in chat completions; ``add_special_tokens``
defaults to false, as the template adds them) and answers
``{"count", "max_model_len", "tokens"}`` (and ``"token_strs"`` with ``return_token_strs``).
``/detokenize`` takes ``{"tokens": [...]}`` and answers ``{"prompt": <text>}`` (special tokens
included, so a rendered chat round-trips).

These run in the API server only (the engine is not asked), behind the same API key, body-size
limit, read timeout and admission (a slot of ``--max-concurrency``; 503 while paused or
draining) as the completions endpoints. As in vLLM, a prompt longer than ``max_model_len`` is
tokenised, not refused: the count is what a client asks for; but ``return_token_strs`` gives
the tokens' strings for at most ``max_model_len`` tokens. Long texts are worked on a thread
(``text_offload``).
"""

from __future__ import annotations

import json
from importlib import metadata
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from ketch.engine.request_checks import RequestCheckError, check_token_ids
from ketch.engine.serving.admission import read_body
from ketch.engine.serving.protocol import (
    ChatMessage,
    ProtocolError,
    check_model,
    parse_request,
)
from ketch.engine.serving.state import ServingState, serving_state
from ketch.engine.serving.template_kwargs import TemplateKwargs
from ketch.engine.serving.text_offload import INLINE_TOKENS, decode, encode, render_chat

router = APIRouter()


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None
    add_special_tokens: bool | None = None  # default: true for prompt, false for messages
    return_token_strs: bool | None = False

    def check(self) -> None:
        """400 unless exactly one input is given (and a chat has a message)."""
        if (self.prompt is None) == (self.messages is None):
            message = "give exactly one of 'prompt' (text) and 'messages' (a chat)"
            raise ProtocolError(400, message, param="prompt")
        if self.messages is not None and not self.messages:
            raise ProtocolError(400, "messages must not be empty", param="messages")


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    tokens: list[int]


def ketch_version() -> str:
    """The installed distribution's version ("unknown" when run from a bare source tree)."""
    try:
        return metadata.version("ketch")
    except metadata.PackageNotFoundError:
        return "unknown"


@router.post("/tokenize")
async def _tokenize(request: Request) -> Response:
    state = serving_state(request)
    slot = state.admit()  # as the generation endpoints: counted, and refused while draining
    try:
        return await _tokenized(state, request)
    finally:
        slot.release()


async def _tokenized(state: ServingState, request: Request) -> Response:
    """The endpoint's work, inside the request's admission slot."""
    raw = await read_body(state.config, request)
    body = parse_request(TokenizeRequest, raw)
    body.check()
    _check_model(state, body.model)
    if body.messages is not None:
        special = bool(body.add_special_tokens)
        tokens = await render_chat(
            state, body.messages, body.add_generation_prompt, len(raw), special,
            body.chat_template_kwargs,
        )  # fmt: skip
    else:
        text = body.prompt or ""
        special = body.add_special_tokens is not False
        tokens = await encode(state, text, special) if text else []
    reply: dict[str, Any] = {
        "count": len(tokens),
        "max_model_len": state.max_model_len,
        "tokens": tokens,
    }
    if body.return_token_strs:
        reply["token_strs"] = await _token_strs(state, tokens)
    return await _json(state, reply, len(tokens))


async def _json(state: ServingState, reply: dict[str, Any], size: int) -> Response:
    """``reply`` as a JSON response; built on a thread, a slice at a time, when it holds
    many tokens (one ``json.dumps`` of 300 k of them holds the GIL for 50 ms)."""
    if size <= INLINE_TOKENS:
        return JSONResponse(reply)
    body = await state.text_jobs.run(_dumps_in_slices, reply)
    return Response(body, media_type="application/json")


_SLICE = 4096


def _dumps_in_slices(reply: dict[str, Any]) -> bytes:
    """Compact JSON of ``reply`` (as JSONResponse writes it), its long lists dumped a slice at
    a time so that the thread doing it lets the event loop run in between."""

    def dumps(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))

    fields = []
    for key, value in reply.items():
        if isinstance(value, list) and len(value) > _SLICE:
            parts = [dumps(value[i : i + _SLICE])[1:-1] for i in range(0, len(value), _SLICE)]
            text = "[" + ",".join(parts) + "]"
        else:
            text = dumps(value)
        fields.append(f"{dumps(key)}:{text}")
    return ("{" + ",".join(fields) + "}").encode("utf-8")


async def _token_strs(state: ServingState, tokens: list[int]) -> list[str]:
    """Each token's string, for at most ``max_model_len`` tokens (a 400 past that: a list of
    strings as long as the whole body helps nobody, and costs a response many times its
    size)."""
    limit = state.max_model_len
    if len(tokens) > limit:
        raise ProtocolError(
            400,
            f"return_token_strs is available for at most max_model_len ({limit}) tokens; "
            f"this input is {len(tokens)} tokens (leave return_token_strs unset to count it)",
            param="return_token_strs",
        )
    tokenizer = state.tokenizer

    def strs() -> list[str]:
        return [tokenizer.id_to_token(t) or "" for t in tokens]

    return strs() if len(tokens) <= INLINE_TOKENS else await state.text_jobs.run(strs)


@router.post("/detokenize")
async def _detokenize(request: Request) -> Response:
    state = serving_state(request)
    slot = state.admit()
    try:
        return await _detokenized(state, request)
    finally:
        slot.release()


async def _detokenized(state: ServingState, request: Request) -> JSONResponse:
    """The endpoint's work, inside the request's admission slot."""
    body = parse_request(DetokenizeRequest, await read_body(state.config, request))
    _check_model(state, body.model)
    tokens = body.tokens
    try:
        check_token_ids(state.prompt_limits.vocab_size, tokens, "tokens")
    except RequestCheckError as exc:
        raise ProtocolError(400, str(exc), param=exc.param) from None
    # Special tokens stay (as in vLLM): a chat template's markers are part of the text.
    text = await decode(state, tokens, skip_special_tokens=False)
    return JSONResponse({"prompt": text})


@router.get("/version")
async def version(request: Request) -> JSONResponse:
    return JSONResponse({"version": ketch_version()})


def _check_model(state: ServingState, model: str | None) -> None:
    if model is not None:
        check_model(model, [state.model_name])
