"""The HTTP front of ``ketch serve``: OpenAI endpoints, health, readiness, metrics, control.

This process tokenises, renders chat templates and streams SSE; the model runs in the engine
process behind ``EngineClient``, so HTTP work never stalls the step loop. Every refusal is an
OpenAI-shaped JSON error; nothing here leaks a stack trace to a client.

Nothing slow runs on the event loop, which also answers /health, /ready and /metrics:
structured-output grammars are built and compiled in worker processes under a time budget
(``guided.GrammarService``), and long texts are tokenised, detokenised and chat-rendered on a
few threads (``tokenization``, ``offload.ThreadJobs``); short ones stay inline, where a thread
would cost more than the work.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ketch.engine.choices import Choice, group, usage_counts
from ketch.engine.engine_client import EngineClient
from ketch.engine.metrics import EngineMetrics
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.serving import embeddings, openapi, reasoning, tokenization
from ketch.engine.serving import responses as R
from ketch.engine.serving.admission import (
    Slot,
    check_control_access,
    check_limits,
    check_output_size,
    check_token_ids,
    credential_ok,
    read_body,
)
from ketch.engine.serving.config import ServerConfig
from ketch.engine.serving.generation import make_choices, merge_streams, run_to_end
from ketch.engine.serving.guided import GrammarService, GuidedError
from ketch.engine.serving.offload import NOT_ACCEPTED, Busy, ThreadJobs
from ketch.engine.serving.pairing import NOT_ACCEPTED_HEADER, PrefillPeers, pairing
from ketch.engine.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    check_model,
    error_body,
    parse_request,
)
from ketch.engine.serving.tokenization import decode, encode, render_chat
from ketch.engine.serving.tool_parsers import parser_for_template
from ketch.engine.serving.tools import ToolPlan, apply_plan, chat_delta
from ketch.engine.tokenizer import Tokenizer
from ketch.engine.tracing import note_choices

logger = logging.getLogger(__name__)

_OPEN_PATHS = ("/health", "/ready", "/metrics")
_CONTROL_PATHS = ("/pause", "/resume")


@dataclass
class ServingState:
    """Everything the endpoints share; one per server process."""

    config: ServerConfig
    engine: EngineClient
    tokenizer: Tokenizer
    model_name: str
    metrics: EngineMetrics
    max_model_len: int
    vocab_size: int = 0  # the model's, as the engine announced it
    hidden_size: int = 0  # the model's (its embeddings' size), as the engine announced it
    api_key: str | None = None
    admin_key: str | None = None  # for /pause and /resume; None: refused to everyone
    reasoning_parser: str | None = None  # chosen at startup (``reasoning.choose``); None: off
    in_flight: int = 0
    draining: bool = False
    paused: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    prefill_peers: PrefillPeers = field(default_factory=lambda: PrefillPeers(None))
    grammars: GrammarService | None = None  # structured outputs' checks (``create_app``)
    # Tokenising, detokenising and chat-rendering long texts, off the event loop.
    text_jobs: ThreadJobs = field(default_factory=lambda: ThreadJobs("tokenizing"))

    def close(self) -> None:
        """Stops the worker processes and threads (the server is stopping)."""
        if self.grammars is not None:
            self.grammars.close()
        self.text_jobs.close()

    def set_idle(self, idle: bool) -> None:
        if idle:
            self.idle.set()
        else:
            self.idle.clear()


def create_app(state: ServingState) -> FastAPI:
    app = FastAPI(title="Ketch", docs_url=None, redoc_url=None)
    app.state.serving = state
    state.idle.set()
    if state.grammars is None:
        state.grammars = _grammar_service(state)
        state.metrics.registry.register(state.grammars)

    @app.exception_handler(ProtocolError)
    async def protocol_error(_: Request, exc: ProtocolError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(Busy)
    async def busy(_: Request, exc: Busy) -> JSONResponse:
        return _error(ProtocolError(503, exc.message, code=NOT_ACCEPTED))

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]):
        try:
            _check_access(state, request)
            response = await call_next(request)
        except ProtocolError as exc:
            response = _error(exc)
        route = request.scope.get("route")
        state.metrics.observe_http(getattr(route, "path", "other"), response.status_code)
        return response

    app.add_api_route("/v1/completions", _completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", _chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", _models, methods=["GET"])
    app.add_api_route("/v1/embeddings", _embeddings, methods=["POST"])
    app.add_api_route("/tokenize", _tokenize, methods=["POST"])
    app.add_api_route("/detokenize", _detokenize, methods=["POST"])
    app.add_api_route("/version", tokenization.version, methods=["GET"])
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/ready", _ready, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    app.add_api_route("/pause", _pause, methods=["POST"])
    app.add_api_route("/resume", _resume, methods=["POST"])
    openapi.install(app)
    return app


def _state(request: Request) -> ServingState:
    return request.app.state.serving


def _grammar_service(state: ServingState) -> GrammarService:
    config = state.config
    tokenizer = state.tokenizer
    return GrammarService(
        tokenizer.path / "tokenizer.json",
        state.vocab_size or tokenizer.vocab_size,
        [t for t in [tokenizer.eos_token_id] if t is not None],
        limits=config.grammar_limits(),
        timeout=config.grammar_timeout,
        workers=config.grammar_workers,
        max_waiting=config.max_grammar_queue,
    )


def _error(exc: ProtocolError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status_code in (429, 503) else {}
    if exc.code == NOT_ACCEPTED:
        headers[NOT_ACCEPTED_HEADER] = "1"
    return JSONResponse(error_body(exc), status_code=exc.status_code, headers=headers or None)


def _check_access(state: ServingState, request: Request) -> None:
    path = request.url.path
    header = request.headers.get("authorization", "")
    if path in _CONTROL_PATHS:
        check_control_access(path, header, state.admin_key)
        return
    if path in _OPEN_PATHS or state.api_key is None:
        return
    if not credential_ok(header, state.api_key):
        raise ProtocolError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")


def _admit(state: ServingState) -> Slot:
    """The request's slot, if the server takes requests now (503 or 429 otherwise)."""
    if state.draining:
        message = "the server is shutting down; retry on another instance"
        raise ProtocolError(503, message, code=NOT_ACCEPTED)
    if state.paused:
        message = "the server is paused; retry shortly or on another instance"
        raise ProtocolError(503, message, code=NOT_ACCEPTED)
    if not state.engine.is_alive:
        raise ProtocolError(503, "the engine is not running", code=NOT_ACCEPTED)
    return Slot(state)


async def _completions(request: Request) -> Response:
    state = _state(request)
    slot = _admit(state)
    try:
        body = parse_request(CompletionRequest, await read_body(state.config, request))
        check_model(body.model, [state.model_name])
        await _prepare_grammar(state, body)
        params = body.to_sampling_params(None)
        check_limits(state.config, params, len(body.prompt))
        prompts = [p if isinstance(p, list) else await encode(state, p) for p in body.prompt]
        check_token_ids(state.vocab_size or state.tokenizer.vocab_size, prompts, params)
        check_output_size(state.config, params, prompts, state.max_model_len)
        echoes = await _echo_texts(state, body, prompts, params.skip_special_tokens)
        paired = await pairing(state.config, state.prefill_peers, request)
        choices = make_choices(
            prompts, params, state.max_model_len, paired, accumulate=not body.stream
        )
        note_choices(request.scope, choices)  # tracing on: its spans' timings
        slot.resize(len(choices))
        meta = R.ResponseMeta.completion(
            state.model_name, body.include_usage, state.config.enable_prompt_tokens_details
        )
        if body.stream:
            return _sse(slot, _completion_events(state, meta, choices, echoes))
        done = await run_to_end(state.engine, choices, request)
    except BaseException:
        slot.release()
        raise
    slot.release()
    outputs = group(done, len(prompts))
    return JSONResponse(R.completion_response(meta, outputs, state.tokenizer, echoes))


async def _embeddings(request: Request) -> Response:
    state = _state(request)
    slot = _admit(state)
    try:
        return await embeddings.create(state, request, slot)
    finally:
        slot.release()


async def _tokenize(request: Request) -> Response:
    state = _state(request)
    slot = _admit(state)  # as the generation endpoints: counted, and refused while draining
    try:
        return await tokenization.tokenize(request)
    finally:
        slot.release()


async def _detokenize(request: Request) -> Response:
    state = _state(request)
    slot = _admit(state)
    try:
        return await tokenization.detokenize(request)
    finally:
        slot.release()


async def _prepare_grammar(
    state: ServingState, body: CompletionRequest | ChatCompletionRequest
) -> None:
    """Builds and compiles the request's grammar, if it asks for one, off the event loop
    (``GrammarService``); a 400 naming the field if it is too big, wrong, does not compile for
    this model or takes longer than --grammar-timeout."""
    assert state.grammars is not None  # create_app made it
    try:
        await state.grammars.prepare(body)
    except GuidedError as exc:
        raise ProtocolError(400, str(exc), exc.param) from None


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


async def _chat_completions(request: Request) -> Response:
    state = _state(request)
    slot = _admit(state)
    try:
        raw = await read_body(state.config, request)
        body = parse_request(ChatCompletionRequest, raw)
        check_model(body.model, [state.model_name])
        await _prepare_grammar(state, body)  # the tools' too (tool_choice required or named)
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
        check_token_ids(state.vocab_size or state.tokenizer.vocab_size, [prompt], params)
        check_output_size(state.config, params, [prompt], state.max_model_len)
        paired = await pairing(state.config, state.prefill_peers, request)
        whole = not body.stream or (plan is not None and plan.streams_whole)
        choices = make_choices([prompt], params, state.max_model_len, paired, accumulate=whole)
        note_choices(request.scope, choices)
        slot.resize(len(choices))
        meta = R.ResponseMeta.chat(
            state.model_name, body.include_usage, state.config.enable_prompt_tokens_details
        )
        if body.stream:
            return _sse(slot, _chat_events(state, meta, choices, plan, start))
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


def _sse(slot: Slot, events: AsyncIterator[str]) -> StreamingResponse:
    """The stream owns ``slot`` from here: released when it ends, or when it is dropped unsent."""

    async def body() -> AsyncIterator[str]:
        try:
            try:
                async for event in events:
                    yield event
            except ProtocolError as exc:  # headers are sent: report in-stream, then stop
                yield R.sse(error_body(exc))
            yield R.sse("[DONE]")
        finally:
            slot.release()

    stream = body()
    slot.release_with(stream)
    return StreamingResponse(stream, media_type="text/event-stream")


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


async def _models(request: Request) -> JSONResponse:
    return JSONResponse(R.models_response([_state(request).model_name]))


async def _health(request: Request) -> JSONResponse:
    state = _state(request)
    if state.engine.is_alive:
        return JSONResponse({"status": "ok"})
    reason = state.engine.dead_reason or "the engine process is not running"
    return JSONResponse({"status": "unhealthy", "detail": reason}, status_code=503)


async def _ready(request: Request) -> JSONResponse:
    state = _state(request)
    problems = []
    if not state.engine.is_alive:
        problems.append("engine not running")
    if state.draining:
        problems.append("draining")
    if state.paused:
        problems.append("paused")
    snapshot = state.engine.last_snapshot
    attached = snapshot is not None and snapshot.cache_manager_attached
    config = state.config
    if config.role != "mixed" and not attached:
        problems.append("cache manager not attached (the KV transfer needs it)")
    detail = {
        "ready": not problems,
        "problems": problems,
        "model": state.model_name,
        "role": config.role,
        "cache_manager": "attached"
        if attached
        else "not attached (no host swap space, no KV transfer)",
    }
    if config.role != "mixed":
        detail.update(pd_comm_port=config.pd_comm_port, kv_transfer_port=config.kv_transfer_port)
    return JSONResponse(detail, status_code=200 if not problems else 503)


async def _metrics(request: Request) -> Response:
    body, content_type = _state(request).metrics.render()
    return Response(body, media_type=content_type)


async def _pause(request: Request) -> JSONResponse:
    state = _state(request)
    state.paused = True
    return JSONResponse({"paused": True, "in_flight": state.in_flight})


async def _resume(request: Request) -> JSONResponse:
    state = _state(request)
    state.paused = False
    return JSONResponse({"paused": False, "in_flight": state.in_flight})
