"""Turns an API request into engine requests and their deltas into CompletionOutputs.

One "choice" is one engine request (a prompt times ``n``). Deltas from the engine process are
accumulated into a ``CompletionOutput`` whose ``delta_*`` fields hold what the latest delta
added, which is what the response builders in ``responses.py`` consume.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ketch.engine.core.messages import RequestDelta
from ketch.engine.disagg.messages import prompt_scores_problem
from ketch.engine.engine_client import EngineClient, EngineDeadError
from ketch.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.serving.protocol import ProtocolError


@dataclass
class Choice:
    """One sequence to generate: a tokenised prompt and the params of this choice."""

    index: int
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output: CompletionOutput = field(init=False)
    num_cached_tokens: int = 0
    prefill: str | None = None  # decode role: the paired prefill peer's pd-comm host:port
    prompt_logprobs: list[TokenLogprob] | None = None  # from the first delta, when asked for

    def __post_init__(self) -> None:
        self.output = CompletionOutput(index=self.index, text="", token_ids=[])


def make_choices(
    prompts: list[list[int]],
    params: SamplingParams,
    max_model_len: int,
    prefill: str | None = None,
) -> list[Choice]:
    """``n`` choices per prompt; seeded requests get seed + i so the choices differ. With a
    ``prefill`` peer (decode role) the prompt's scores must fit the peer's reply."""
    choices = []
    for p, prompt in enumerate(prompts):
        if len(prompt) >= max_model_len:
            raise ProtocolError(
                400,
                f"prompt is {len(prompt)} tokens, but max_model_len is {max_model_len}: "
                "shorten it to leave room for output",
                param="prompt",
            )
        scores = prefill and prompt_scores_problem(len(prompt), params.prompt_logprobs)
        if scores:
            raise ProtocolError(400, scores, param="prompt_logprobs")
        for i in range(params.n):
            choices.append(Choice(len(choices), p, prompt, params.for_choice(i), prefill=prefill))
    return choices


def _apply(choice: Choice, delta: RequestDelta) -> None:
    out = choice.output
    if delta.error is not None:
        message = delta.error
        if delta.error_code >= 500:
            message = f"the engine failed while serving this request: {message}"
        raise ProtocolError(delta.error_code, message)
    out.token_ids = [*out.token_ids, *delta.new_token_ids]
    out.text += delta.new_text
    out.delta_text = delta.new_text
    out.delta_token_ids = delta.new_token_ids
    out.finish_reason = delta.finish_reason
    out.stop_reason = delta.stop_reason
    choice.num_cached_tokens = delta.num_cached_tokens
    if delta.prompt_logprobs is not None:
        choice.prompt_logprobs = [
            TokenLogprob(t, lp, list(top)) for t, lp, top in delta.prompt_logprobs
        ]
    if delta.logprobs is not None:
        entries = [TokenLogprob(t, lp, list(top)) for t, lp, top in delta.logprobs]
        out.logprobs = [*(out.logprobs or []), *entries]
    elif choice.params.logprobs is not None and out.logprobs is None:
        out.logprobs = []


async def stream_choice(
    engine: EngineClient, choice: Choice, final_only: bool
) -> AsyncIterator[Choice]:
    """Runs one choice, yielding it after each delta (with ``final_only``: once, at the end)."""
    request_id = f"req-{uuid.uuid4().hex}"
    try:
        stream = engine.generate(
            request_id, choice.prompt_token_ids, choice.params, final_only, choice.prefill
        )
        async for delta in stream:
            _apply(choice, delta)
            yield choice
    except EngineDeadError as exc:
        raise ProtocolError(503, f"the engine is not running: {exc}") from exc


async def run_to_end(engine: EngineClient, choices: list[Choice]) -> list[Choice]:
    """Runs all choices concurrently to completion (non-streaming responses)."""

    async def one(choice: Choice) -> None:
        async for _ in stream_choice(engine, choice, final_only=True):
            pass

    await asyncio.gather(*(one(c) for c in choices))
    return choices


async def merge_streams(engine: EngineClient, choices: list[Choice]) -> AsyncIterator[Choice]:
    """Interleaves the choices' updates as they arrive; cancels the rest if the caller stops."""
    if len(choices) == 1:  # the common case: no fan-in task and queue per token
        async for update in stream_choice(engine, choices[0], final_only=False):
            yield update
        return
    queue: asyncio.Queue[Choice | BaseException | None] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for update in stream_choice(engine, choice, final_only=False):
                await queue.put(update)
        except BaseException as exc:
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def request_outputs(choices: list[Choice], num_prompts: int) -> list[RequestOutput]:
    """Groups finished choices by prompt, as the response builders expect."""
    outputs = []
    for p in range(num_prompts):
        mine = [c for c in choices if c.prompt_index == p]
        for i, c in enumerate(mine):
            c.output.index = i
        outputs.append(
            RequestOutput(
                request_id=f"prompt-{p}",
                prompt=None,
                prompt_token_ids=mine[0].prompt_token_ids,
                outputs=[c.output for c in mine],
                finished=True,
                num_cached_tokens=mine[0].num_cached_tokens,
                prompt_logprobs=mine[0].prompt_logprobs,
            )
        )
    return outputs
