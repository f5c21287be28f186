"""OpenAI-shaped response bodies and SSE chunks, built from the engine's RequestOutput objects.

Non-streaming: ``completion_response`` / ``chat_completion_response``. Streaming: one
``completion_chunk`` / ``chat_chunk`` per engine output (a chat stream starts with
``chat_role_chunk``), then ``*_usage_chunk`` when ``stream_options.include_usage``, each wrapped
by ``sse``, and finally ``SSE_DONE``. Everything returned is a plain JSON-serialisable dict.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Protocol

from ketch.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob

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

    @classmethod
    def completion(cls, model: str, include_usage: bool = False) -> ResponseMeta:
        """A fresh ``cmpl-<hex>`` id, created now."""
        return cls(f"cmpl-{uuid.uuid4().hex}", model, int(time.time()), include_usage)

    @classmethod
    def chat(cls, model: str, include_usage: bool = False) -> ResponseMeta:
        """A fresh ``chatcmpl-<hex>`` id, created now."""
        return cls(f"chatcmpl-{uuid.uuid4().hex}", model, int(time.time()), include_usage)


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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Json:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_of(outputs: Sequence[RequestOutput]) -> Json:
    """Usage of finished outputs, one RequestOutput per prompt (its n choices inside it)."""
    return usage(
        sum(len(r.prompt_token_ids) for r in outputs),
        sum(len(c.token_ids) for r in outputs for c in r.outputs),
        sum(r.num_cached_tokens for r in outputs),
    )


# ---- logprobs ----


def _token_text(tokenizer: TokenDecoder, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    entries: Sequence[TokenLogprob], tokenizer: TokenDecoder, text_offset: int = 0
) -> Json:
    """Completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``."""
    tokens = [_token_text(tokenizer, e.token_id) for e in entries]
    top: list[dict[str, float]] = []
    for entry, token in zip(entries, tokens, strict=True):
        alternatives = {_token_text(tokenizer, t): lp for t, lp in entry.top}
        top.append({token: entry.logprob, **alternatives})
    starts = accumulate((len(t) for t in tokens[:-1]), initial=text_offset)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": list(starts) if tokens else [],
    }


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


def _delta_logprobs(output: CompletionOutput) -> list[TokenLogprob] | None:
    if output.logprobs is None:
        return None
    end = len(output.token_ids)
    return output.logprobs[end - len(output.delta_token_ids) : end]


# ---- non-streaming ----


def completion_response(
    meta: ResponseMeta, outputs: Sequence[RequestOutput], tokenizer: TokenDecoder
) -> Json:
    """``text_completion`` for finished outputs, one RequestOutput per prompt, in prompt order.

    Choice index = (choices of the prompts before) + ``CompletionOutput.index``.
    """
    choices = []
    base = 0
    for request_output in outputs:
        for c in request_output.outputs:
            logprobs = None if c.logprobs is None else completion_logprobs(c.logprobs, tokenizer)
            choices.append(_completion_choice(base + c.index, c.text, c.finish_reason, logprobs))
        base += len(request_output.outputs)
    return _envelope(meta, "text_completion", choices) | {"usage": usage_of(outputs)}


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
    return _envelope(meta, "chat.completion", choices) | {"usage": usage_of([output])}


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
    meta: ResponseMeta, index: int, output: CompletionOutput, tokenizer: TokenDecoder
) -> Json:
    """A streamed ``text_completion`` with what ``output`` added (its delta) as choice ``index``."""
    entries = _delta_logprobs(output)
    logprobs = None
    if entries is not None:
        offset = len(output.text) - len(output.delta_text)
        logprobs = completion_logprobs(entries, tokenizer, offset)
    choice = _completion_choice(index, output.delta_text, output.finish_reason, logprobs)
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
    output: CompletionOutput,
    tokenizer: TokenDecoder,
    first: bool = False,
) -> Json:
    """A ``chat.completion.chunk`` with ``output``'s delta as choice ``index``.

    ``first=True`` also puts ``role: "assistant"`` in the delta (OpenAI's first chunk has it);
    send ``chat_role_chunk`` first instead if you prefer a separate role chunk.
    """
    delta: Json = {"role": "assistant"} if first else {}
    delta["content"] = output.delta_text
    entries = _delta_logprobs(output)
    choice = {
        "index": index,
        "delta": delta,
        "logprobs": None if entries is None else chat_logprobs(entries, tokenizer),
        "finish_reason": output.finish_reason,
    }
    return _chunk(meta, "chat.completion.chunk", [choice])


def completion_usage_chunk(meta: ResponseMeta, usage_body: Json) -> Json:
    """The last streamed completion chunk when include_usage: no choices, just ``usage``."""
    return _envelope(meta, "text_completion", []) | {"usage": usage_body}


def chat_usage_chunk(meta: ResponseMeta, usage_body: Json) -> Json:
    """The last streamed chat chunk when include_usage: no choices, just ``usage``."""
    return _envelope(meta, "chat.completion.chunk", []) | {"usage": usage_body}
