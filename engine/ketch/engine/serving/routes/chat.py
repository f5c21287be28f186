"""``POST /v1/chat/completions``: a chat rendered with the model's template, then generated,
with tool calls (``tools``) and reasoning (``reasoning``) split out of the output."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ketch.engine.choices import Choice, group, usage_counts
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.serving import reasoning
from ketch.engine.serving import responses as R
from ketch.engine.serving.admission import (
    check_limits,
    check_output_size,
    check_prompts,
    read_body,
)
from ketch.engine.serving.generation import make_choices, merge_streams, run_to_end
from ketch.engine.serving.pairing import pairing
from ketch.engine.serving.protocol import ChatCompletionRequest, check_model, parse_request
from ketch.engine.serving.routes.generating import prepare_grammar, sse_response
from ketch.engine.serving.state import ServingState, serving_state
from ketch.engine.serving.text_offload import render_chat
from ketch.engine.serving.tool_parsers import parser_for_template
from ketch.engine.serving.tools import ToolPlan, apply_plan, chat_delta
from ketch.engine.tracing import note_choices

router = APIRouter()


@router.post("/v1/chat/completions")
async def _chat_completions(request: Request) -> Response:
    state = serving_state(request)
    slot = state.admit()
    try:
        raw = await read_body(state.config, request)
        body = parse_request(ChatCompletionRequest, raw)
        check_model(body.model, [state.model_name])
        await prepare_grammar(state, body)  # the tools' too (tool_choice required or named)
        params = body.to_sampling_params(None)
        check_limits(state.config, params, 1)
        plan = body.tool_plan()  # checked with the grammar
        if plan is not None:
            plan.parser = parser_for_template(state.tokenizer.chat_template_source)
        variables = dict(body.chat_template_kwargs or {})
        if plan is not None:
            variables["tools"] = plan.tools
        prompt = await render_chat(
            state, body.messages, body.add_generation_prompt, len(raw), variables=variables
        )
        start = _reasoning_start(state, params, prompt)
        check_prompts(state.prompt_limits, [prompt], params)
        check_output_size(state.config, params, [prompt], state.max_model_len)
        paired = await pairing(state.config, state.prefill_peers, request)
        whole = not body.stream or (plan is not None and plan.streams_whole)
        choices = make_choices([prompt], params, paired, accumulate=whole)
        note_choices(request.scope, choices)
        slot.resize(len(choices))
        meta = R.ResponseMeta.chat(
            state.model_name, body.include_usage, state.config.enable_prompt_tokens_details
        )
        if body.stream:
            return sse_response(slot, _chat_events(state, meta, choices, plan, start))
        done = await run_to_end(state.engine, choices, request)
    except BaseException:
        slot.release()
        raise
    slot.release()
    output = group(done, 1)[0]
    body_json = R.chat_completion_response(meta, output, state.tokenizer)
    if start is not None:
        reasoning.split_messages(body_json, start)
    return JSONResponse(apply_plan(body_json, plan))


def _reasoning_start(state: ServingState, params: SamplingParams, prompt: list[int]) -> str | None:
    """Where the output's reasoning stands when it begins (``reasoning.output_start``), or
    None when it is not split off: no reasoning parser, or a grammar (response_format, guided
    fields, a required or named tool) constrains the whole output, which then is all content."""
    if state.reasoning_parser is None or params.grammar is not None:
        return None
    tail = state.tokenizer.decode(reasoning.prompt_tail(prompt), skip_special_tokens=False)
    return reasoning.output_start(tail)


async def _chat_events(
    state: ServingState,
    meta: R.ResponseMeta,
    choices: list[Choice],
    plan: ToolPlan | None,
    start: str | None,
) -> AsyncIterator[str]:
    splitters = {c.index: reasoning.ThinkSplitter(start) for c in choices if start is not None}
    for choice in choices:
        yield R.sse(R.chat_role_chunk(meta, choice.index))
    async for choice, delta in merge_streams(state.engine, choices):
        chunk = R.chat_chunk(meta, choice.index, delta, state.tokenizer)
        if plan is not None or splitters:
            reply = chat_delta(plan, splitters.get(choice.index), choice, delta)
            if reply is None:
                continue
            chunk["choices"][0]["delta"], chunk["choices"][0]["finish_reason"] = reply
        yield R.sse(chunk)
    if meta.include_usage:
        yield R.sse(R.chat_usage_chunk(meta, meta.usage(*usage_counts(choices))))
