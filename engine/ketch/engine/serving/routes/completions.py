"""``POST /v1/completions``: a text completion for each prompt (text or token ids), streamed
as SSE or answered whole, with ``echo``, logprobs and usage in OpenAI's shapes."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ketch.engine.choices import Choice, group, usage_counts
from ketch.engine.serving import responses as R
from ketch.engine.serving.admission import (
    check_limits,
    check_output_size,
    check_prompts,
    read_body,
)
from ketch.engine.serving.generation import make_choices, merge_streams, run_to_end
from ketch.engine.serving.pairing import pairing
from ketch.engine.serving.protocol import CompletionRequest, check_model, parse_request
from ketch.engine.serving.routes.generating import prepare_grammar, sse_response
from ketch.engine.serving.state import ServingState, serving_state
from ketch.engine.serving.text_offload import decode, encode
from ketch.engine.tracing import note_choices

router = APIRouter()


@router.post("/v1/completions")
async def _completions(request: Request) -> Response:
    state = serving_state(request)
    slot = state.admit()
    try:
        body = parse_request(CompletionRequest, await read_body(state.config, request))
        check_model(body.model, [state.model_name])
        await prepare_grammar(state, body)
        params = body.to_sampling_params(None)
        check_limits(state.config, params, len(body.prompt))
        prompts = [p if isinstance(p, list) else await encode(state, p) for p in body.prompt]
        check_prompts(state.prompt_limits, prompts, params)
        check_output_size(state.config, params, prompts, state.max_model_len)
        echoes = await _echo_texts(state, body, prompts, params.skip_special_tokens)
        paired = await pairing(state.config, state.prefill_peers, request)
        choices = make_choices(prompts, params, paired, accumulate=not body.stream)
        note_choices(request.scope, choices)  # tracing on: its spans' timings
        slot.resize(len(choices))
        meta = R.ResponseMeta.completion(
            state.model_name, body.include_usage, state.config.enable_prompt_tokens_details
        )
        if body.stream:
            return sse_response(slot, _completion_events(state, meta, choices, echoes))
        done = await run_to_end(state.engine, choices, request)
    except BaseException:
        slot.release()
        raise
    slot.release()
    outputs = group(done, len(prompts))
    return JSONResponse(R.completion_response(meta, outputs, state.tokenizer, echoes))


async def _echo_texts(
    state: ServingState, body: CompletionRequest, prompts: list[list[int]], skip_special: bool
) -> list[str] | None:
    """With ``echo``: each prompt's text (as sent, or decoded from its token ids)."""
    if not body.echo:
        return None
    return [
        given if isinstance(given, str) else await decode(state, ids, skip_special)
        for given, ids in zip(body.prompt, prompts, strict=True)
    ]


async def _completion_events(
    state: ServingState,
    meta: R.ResponseMeta,
    choices: list[Choice],
    echoes: list[str] | None,
) -> AsyncIterator[str]:
    async for choice, delta in merge_streams(state.engine, choices):
        echo = None
        if echoes is not None:
            text = echoes[choice.prompt_index]
            echo = R.Echo(text, choice.prompt_token_ids[0], choice.prompt_logprobs)
        offset = choice.num_chars - len(delta.new_text)
        chunk = R.completion_chunk(
            meta, choice.index, delta, state.tokenizer,
            text_offset=offset, first=choice.first, echo=echo,
        )  # fmt: skip
        yield R.sse(chunk)
    if meta.include_usage:
        yield R.sse(R.completion_usage_chunk(meta, meta.usage(*usage_counts(choices))))
