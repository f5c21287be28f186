"""OpenAI-shaped response bodies and SSE chunks, built from the engine's outputs.

Non-streaming: ``completion_response`` / ``chat_completion_response``, from finished
``RequestOutput``s. Streaming: one ``completion_chunk`` / ``chat_chunk`` per engine
``RequestDelta``, built from that delta alone (a chat stream starts with
``chat_role_chunk``), then ``*_usage_chunk`` when ``stream_options.include_usage``, each wrapped
by ``sse``, and finally ``SSE_DONE``. Everything returned is a plain JSON-serialisable dict.

Completions with ``echo`` put the prompt's text (and, with logprobs, its tokens: the first one
without a log-probability) before the output, in a stream in each choice's first chunk.
``prompt_logprobs`` (vLLM's extension) is a list with ``null`` for the first prompt token, then
per token ``{token id: {logprob, rank, decoded_token}}`` for the token and the top ones; a rank
is given where it is known (the top ones'), else ``null``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Protocol

from ketch.engine.outputs import RequestDelta, RequestOutput, TokenLogprob

SSE_DONE = "data: [DONE]\n\n"
Json = dict[str, Any]


class TokenDecoder(Protocol):
    """What the builders need from a tokenizer: the text of a token (``Tokenizer`` fits)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class ResponseMeta:
    """What every body or chunk of one response repeats."""

    id: str
    model: str
    created: int
    include_usage: bool = False  # streamed chunks then carry "usage": null until the last one
    # usage.prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details): off by
    # default, because prefix-cache hits tell one client what others' prompts began with.
    prompt_tokens_details: bool = False

    @classmethod
    def completion(
        cls, model: str, include_usage: bool = False, prompt_tokens_details: bool = False
    ) -> ResponseMeta:
        """A fresh ``cmpl-<hex>`` id, created now."""
        return cls(
            f"cmpl-{uuid.uuid4().hex}", model, int(time.time()), include_usage,
            prompt_tokens_details,
        )  # fmt: skip

    @classmethod
    def chat(
        cls, model: str, include_usage: bool = False, prompt_tokens_details: bool = False
    ) -> ResponseMeta:
        """A fresh ``chatcmpl-<hex>`` id, created now."""
        return cls(
            f"chatcmpl-{uuid.uuid4().hex}", model, int(time.time()), include_usage,
            prompt_tokens_details,
        )  # fmt: skip

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Json:
        """``usage``, with ``prompt_tokens_details`` only when this server reports it."""
        cached = cached_tokens if self.prompt_tokens_details else None
        return usage(prompt_tokens, completion_tokens, cached)


def sse(data: Json | str) -> str:
    """One server-sent event: ``data: {json}\\n\\n``; a string (``"[DONE]"``) goes as is."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def models_response(names: Sequence[str], created: int | None = None) -> Json:
    """``GET /v1/models``."""
    created = int(time.time()) if created is None else created
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "ketch"}
            for name in names
        ],
    }


# ---- usage ----


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Json:
    """OpenAI's ``usage`` object; ``prompt_tokens_details.cached_tokens`` only when
    ``cached_tokens`` is given (a server with ``--enable-prompt-tokens-details``)."""
    body: Json = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def usage_of(outputs: Sequence[RequestOutput], prompt_tokens_details: bool = False) -> Json:
    """Usage of finished outputs, one RequestOutput per prompt (its n choices inside it)."""
    cached = sum(r.num_cached_tokens for r in outputs)
    return usage(
        sum(len(r.prompt_token_ids) for r in outputs),
        sum(len(c.token_ids) for r in outputs for c in r.outputs),
        cached if prompt_tokens_details else None,
    )


# ---- logprobs ----


@dataclass(frozen=True)
class Echo:
    """What ``echo`` puts before a completion: the prompt's text, its first token (which has no
    log-probability) and the prompt_logprobs of the others (None without logprobs)."""

    text: str
    first_token: int
    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def of(cls, text: str, output: RequestOutput) -> Echo:
        return cls(text, output.prompt_token_ids[0], output.prompt_logprobs)


def _token_text(tokenizer: TokenDecoder, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    entries: Sequence[TokenLogprob],
    tokenizer: TokenDecoder,
    text_offset: int = 0,
    echo: Echo | None = None,
) -> Json:
    """Completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``; with ``echo`` (and
    its logprobs) the prompt's tokens come first, the first one with null logprobs."""
    tokens: list[str] = []
    logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    if echo is not None and echo.logprobs is not None:
        tokens.append(_token_text(tokenizer, echo.first_token))
        logprobs.append(None)
        top.append(None)
        entries = [*echo.logprobs, *entries]
    for entry in entries:
        token = _token_text(tokenizer, entry.token_id)
        alternatives = {_token_text(tokenizer, t): lp for t, lp in entry.top}
        tokens.append(token)
        logprobs.append(entry.logprob)
        top.append({token: entry.logprob, **alternatives})
    starts = accumulate((len(t) for t in tokens[:-1]), initial=text_offset)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": top,
        "text_offset": list(starts) if tokens else [],
    }


def prompt_logprobs(
    entries: Sequence[TokenLogprob] | None, tokenizer: TokenDecoder
) -> list[Json | None] | None:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then per token
    ``{"<token id>": {logprob, rank, decoded_token}}`` for it and the most likely ones."""
    if entries is None:
        return None
    out: list[Json | None] = [None]
    for entry in entries:
        ranks = {t: rank for rank, (t, _) in enumerate(entry.top, 1)}
        scores = {entry.token_id: entry.logprob, **dict(entry.top)}
        out.append(
            {
                str(t): {
                    "logprob": lp,
                    "rank": ranks.get(t),
                    "decoded_token": _token_text(tokenizer, t),
                }
                for t, lp in scores.items()
            }
        )
    return out


def _chat_token(tokenizer: TokenDecoder, token_id: int, logprob: float) -> Json:
    text = _token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob], tokenizer: TokenDecoder) -> Json:
    """Chat's ``{content: [{token, logprob, bytes, top_logprobs: [...]}], refusal}``."""
    content = []
    for entry in entries:
        item = _chat_token(tokenizer, entry.token_id, entry.logprob)
        item["top_logprobs"] = [_chat_token(tokenizer, t, lp) for t, lp in entry.top]
        content.append(item)
    return {"content": content, "refusal": None}


# ---- non-streaming ----


def completion_response(
    meta: ResponseMeta,
    outputs: Sequence[RequestOutput],
    tokenizer: TokenDecoder,
    echo_texts: Sequence[str] | None = None,
) -> Json:
    """``text_completion`` for finished outputs, one RequestOutput per prompt, in prompt order;
    with ``echo_texts`` (one per prompt) each choice starts with its prompt.

    Choice index = (choices of the prompts before) + ``CompletionOutput.index``.
    """
    choices = []
    base = 0
    for p, request_output in enumerate(outputs):
        echo = None if echo_texts is None else Echo.of(echo_texts[p], request_output)
        scored = prompt_logprobs(request_output.prompt_logprobs, tokenizer)
        for c in request_output.outputs:
            logprobs = None
            if c.logprobs is not None:
                logprobs = completion_logprobs(c.logprobs, tokenizer, echo=echo)
            text = c.text if echo is None else echo.text + c.text
            choice = _completion_choice(base + c.index, text, c.finish_reason, logprobs)
            if scored is not None:
                choice["prompt_logprobs"] = scored
            choices.append(choice)
        base += len(request_output.outputs)
    usage_body = usage_of(outputs, meta.prompt_tokens_details)
    return _envelope(meta, "text_completion", choices) | {"usage": usage_body}


def chat_completion_response(
    meta: ResponseMeta, output: RequestOutput, tokenizer: TokenDecoder
) -> Json:
    """``chat.completion`` for one finished output (its n choices inside it)."""
    choices = []
    for c in output.outputs:
        choices.append(
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs, tokenizer),
                "finish_reason": c.finish_reason,
            }
        )
    usage_body = usage_of([output], meta.prompt_tokens_details)
    body = _envelope(meta, "chat.completion", choices) | {"usage": usage_body}
    scored = prompt_logprobs(output.prompt_logprobs, tokenizer)
    if scored is not None:
        body["prompt_logprobs"] = scored
    return body


def _envelope(meta: ResponseMeta, object_name: str, choices: list[Json]) -> Json:
    return {
        "id": meta.id,
        "object": object_name,
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": None,
        "choices": choices,
    }


def _completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: Json | None
) -> Json:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


# ---- streaming ----


def _chunk(meta: ResponseMeta, object_name: str, choices: list[Json]) -> Json:
    body = _envelope(meta, object_name, choices)
    if meta.include_usage:
        body["usage"] = None
    return body


def completion_chunk(
    meta: ResponseMeta,
    index: int,
    delta: RequestDelta,
    tokenizer: TokenDecoder,
    *,
    text_offset: int = 0,
    first: bool = False,
    echo: Echo | None = None,
) -> Json:
    """A streamed ``text_completion`` with ``delta`` as choice ``index``. ``text_offset``: the
    characters of output before it; with ``echo``, the choice's ``first`` chunk starts with the
    prompt (and every offset counts it)."""
    text = delta.new_text
    if echo is not None:
        text = echo.text + text if first else text
        text_offset += len(echo.text)
    logprobs = None
    if delta.logprobs is not None:
        if first and echo is not None and echo.logprobs is not None:
            logprobs = completion_logprobs(delta.logprobs, tokenizer, echo=echo)
        else:
            logprobs = completion_logprobs(delta.logprobs, tokenizer, text_offset)
    choice = _completion_choice(index, text, delta.finish_reason, logprobs)
    return _chunk(meta, "text_completion", [choice])


def chat_role_chunk(meta: ResponseMeta, index: int) -> Json:
    """The first chunk of choice ``index`` in a chat stream: the assistant role, no text yet."""
    choice = {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    return _chunk(meta, "chat.completion.chunk", [choice])


def chat_chunk(
    meta: ResponseMeta,
    index: int,
    delta: RequestDelta,
    tokenizer: TokenDecoder,
    first: bool = False,
) -> Json:
    """A ``chat.completion.chunk`` with ``delta`` as choice ``index``.

    ``first=True`` also puts ``role: "assistant"`` in the delta (OpenAI's first chunk has it);
    send ``chat_role_chunk`` first instead if you prefer a separate role chunk.
    """
    message: Json = {"role": "assistant"} if first else {}
    message["content"] = delta.new_text
    choice = {
        "index": index,
        "delta": message,
        "logprobs": None if delta.logprobs is None else chat_logprobs(delta.logprobs, tokenizer),
        "finish_reason": delta.finish_reason,
    }
    return _chunk(meta, "chat.completion.chunk", [choice])


def completion_usage_chunk(meta: ResponseMeta, usage_body: Json) -> Json:
    """The last streamed completion chunk when include_usage: no choices, just ``usage``."""
    return _envelope(meta, "text_completion", []) | {"usage": usage_body}


def chat_usage_chunk(meta: ResponseMeta, usage_body: Json) -> Json:
    """The last streamed chat chunk when include_usage: no choices, just ``usage``."""
    return _envelope(meta, "chat.completion.chunk", []) | {"usage": usage_body}
