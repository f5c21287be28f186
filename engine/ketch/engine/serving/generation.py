"""Runs an API request's choices (``ketch.engine.choices``) through the engine process.

One choice is one engine request (a prompt times ``n``). A non-streaming response runs them to
the end, each as one final delta added up into its choice; a stream yields each delta with its
choice as it arrives, the choice having counted it (and kept it only if it ``accumulate``s).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from ketch.engine.choices import Choice, expand
from ketch.engine.disagg.messages import prompt_scores_problem
from ketch.engine.engine_client import EngineClient, EngineDeadError
from ketch.engine.outputs import RequestDelta
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.serving.protocol import ProtocolError


def make_choices(
    prompts: list[list[int]],
    params: SamplingParams,
    max_model_len: int,
    prefill: str | None = None,
    accumulate: bool = True,
) -> list[Choice]:
    """``n`` choices per prompt; seeded requests get seed + i so the choices differ. With a
    ``prefill`` peer (decode role) the prompt's scores must fit the peer's reply.
    ``accumulate``: whether the choices keep their whole output (a stream needs it only to
    parse tool calls at the end)."""
    for prompt in prompts:
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
    choices = expand(prompts, [params] * len(prompts), accumulate)
    for choice in choices:
        choice.request_id = f"req-{uuid.uuid4().hex}"
        choice.prefill = prefill
    return choices


def _checked(delta: RequestDelta) -> RequestDelta:
    if delta.error is not None:
        message = delta.error
        if delta.error_code >= 500:
            message = f"the engine failed while serving this request: {message}"
        raise ProtocolError(delta.error_code, message)
    return delta


async def _deltas(
    engine: EngineClient, choice: Choice, final_only: bool
) -> AsyncIterator[RequestDelta]:
    """One choice's deltas (with ``final_only``: one, at the end); an error is raised."""
    try:
        stream = engine.generate(
            choice.request_id, choice.prompt_token_ids, choice.params, final_only, choice.prefill
        )
        async for delta in stream:
            yield _checked(delta)
    except EngineDeadError as exc:
        raise ProtocolError(503, f"the engine is not running: {exc}") from exc


async def run_to_end(engine: EngineClient, choices: list[Choice]) -> list[Choice]:
    """Runs all choices concurrently to completion (non-streaming responses)."""

    async def one(choice: Choice) -> None:
        async for delta in _deltas(engine, choice, final_only=True):
            choice.add(delta)

    await asyncio.gather(*(one(c) for c in choices))
    return choices


async def merge_streams(
    engine: EngineClient, choices: list[Choice]
) -> AsyncIterator[tuple[Choice, RequestDelta]]:
    """Interleaves the choices' deltas as they arrive, each added to its choice just before it
    is yielded (so the choice's counts are as of that delta); cancels the rest if the caller
    stops."""
    if len(choices) == 1:  # the common case: no fan-in task and queue per token
        choice = choices[0]
        async for delta in _deltas(engine, choice, final_only=False):
            choice.add(delta)
            yield choice, delta
        return
    queue: asyncio.Queue[tuple[Choice, RequestDelta] | BaseException | None] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for delta in _deltas(engine, choice, final_only=False):
                await queue.put((choice, delta))
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
                item[0].add(item[1])
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
