"""Runs an API request's choices (``ketch.engine.choices``) through the engine process.

One choice is one engine request (a prompt times ``n``). A non-streaming response runs them to
the end, each as one final delta added up into its choice; a stream yields each delta with its
choice as it arrives, the choice having counted it (and kept it only if it ``accumulate``s).
Either way, a request that ends early (a client that goes away, a choice that fails) aborts
every one of its engine requests still running.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request

from ketch.engine.choices import Choice, expand
from ketch.engine.disagg.messages import prompt_scores_problem
from ketch.engine.engine_client import EngineClient, EngineDeadError
from ketch.engine.outputs import RequestDelta
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.serving.protocol import ProtocolError


def make_choices(
    prompts: list[list[int]],
    params: SamplingParams,
    prefill_peer: str | None = None,
    accumulate: bool = True,
) -> list[Choice]:
    """``n`` choices per prompt (checked: ``admission.check_prompts``); seeded requests get
    seed + i so the choices differ. With a ``prefill_peer`` (decode role) the prompt's scores
    must fit the peer's reply. ``accumulate``: whether the choices keep their whole output (a
    stream needs it only to parse tool calls at the end)."""
    for prompt in prompts:
        scores = prefill_peer and prompt_scores_problem(len(prompt), params.prompt_logprobs)
        if scores:
            raise ProtocolError(400, scores, param="prompt_logprobs")
    choices = expand(prompts, [params] * len(prompts), accumulate)
    for choice in choices:
        choice.request_id = f"req-{uuid.uuid4().hex}"
        choice.prefill_peer = prefill_peer
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
            choice.request_id,
            choice.prompt_token_ids,
            choice.params,
            final_only,
            choice.prefill_peer,
        )
        async for delta in stream:
            yield _checked(delta)
    except EngineDeadError as exc:
        raise ProtocolError(503, f"the engine is not running: {exc}") from exc


CLIENT_GONE = 499  # nginx's "client closed request": logged and counted, never received


async def run_to_end(
    engine: EngineClient, choices: list[Choice], client: Request | None = None
) -> list[Choice]:
    """Runs all choices concurrently to completion (non-streaming responses).

    If one fails, or ``client`` disconnects first (ProtocolError 499), the others are
    cancelled at once: their engine requests are aborted, so their KV blocks and batch places
    come back within a step, as the caller's slot does when this raises."""

    async def one(choice: Choice) -> None:
        async for delta in _deltas(engine, choice, final_only=True):
            choice.add(delta)

    tasks = [asyncio.create_task(one(c)) for c in choices]
    work = asyncio.gather(*tasks)
    waiters = [work]
    if client is not None:
        waiters.append(asyncio.create_task(_client_gone(client)))
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise ProtocolError(
                CLIENT_GONE, "the client closed the connection; its requests were aborted"
            )
        work.result()  # the first choice's failure, if one failed
    finally:
        for task in [*tasks, *waiters[1:]]:
            task.cancel()  # no-op for those done
        await asyncio.gather(*waiters, *tasks, return_exceptions=True)
    return choices


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects. Its body is read by now, so the server's next
    message for this request is ``http.disconnect``, whenever the connection closes."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            await asyncio.sleep(0.1)  # not expected once the body is read: never spin
    except Exception:  # cannot be watched: the request runs to its end, as it would anyway
        await asyncio.get_running_loop().create_future()


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
