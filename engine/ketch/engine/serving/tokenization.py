"""``POST /tokenize``, ``POST /detokenize`` and ``GET /version``, in vLLM's shapes.

``/tokenize`` takes either a completions-style ``prompt`` (``add_special_tokens`` defaults to
true) or chat ``messages`` rendered with the model's chat template (``add_generation_prompt``,
default true; ``add_special_tokens`` defaults to false, as the template adds them) and answers
``{"count", "max_model_len", "tokens"}`` (and ``"token_strs"`` with ``return_token_strs``).
``/detokenize`` takes ``{"tokens": [...]}`` and answers ``{"prompt": <text>}`` (special tokens
included, so a rendered chat round-trips).

These run in the API server only (the engine is not asked), behind the same API key, body-size
limit and read timeout as the completions endpoints. As in vLLM, a prompt longer than
``max_model_len`` is tokenised, not refused: the count is what a client asks for.
"""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from ketch.engine.serving.admission import read_body
from ketch.engine.serving.protocol import ChatMessage, ProtocolError, check_model, parse_request

if TYPE_CHECKING:
    from ketch.engine.serving.api_server import ServingState


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
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


async def tokenize(request: Request) -> JSONResponse:
    state: ServingState = request.app.state.serving
    body = parse_request(TokenizeRequest, await read_body(state.config, request))
    body.check()
    _check_model(state, body.model)
    tokenizer = state.tokenizer
    if body.messages is not None:
        conversation = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(conversation, body.add_generation_prompt)
        except ValueError as exc:
            raise ProtocolError(400, str(exc), param="messages") from exc
        special = bool(body.add_special_tokens)
    else:
        text = body.prompt or ""
        special = body.add_special_tokens is not False
    tokens = tokenizer.encode(text, add_special_tokens=special) if text else []
    reply: dict[str, Any] = {
        "count": len(tokens),
        "max_model_len": state.max_model_len,
        "tokens": tokens,
    }
    if body.return_token_strs:
        reply["token_strs"] = [tokenizer.id_to_token(t) or "" for t in tokens]
    return JSONResponse(reply)


async def detokenize(request: Request) -> JSONResponse:
    state: ServingState = request.app.state.serving
    body = parse_request(DetokenizeRequest, await read_body(state.config, request))
    _check_model(state, body.model)
    vocab = state.vocab_size or state.tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ProtocolError(
            400, f"tokens has token ids {bad[:5]} outside [0, {vocab})", param="tokens"
        )
    # Special tokens stay (as in vLLM): a chat template's markers are part of the text.
    text = state.tokenizer.decode(body.tokens, skip_special_tokens=False)
    return JSONResponse({"prompt": text})


async def version(request: Request) -> JSONResponse:
    return JSONResponse({"version": ketch_version()})


def _check_model(state: ServingState, model: str | None) -> None:
    if model is not None:
        check_model(model, [state.model_name])
