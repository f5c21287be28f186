"""The HTTP front of ``ketch serve``, assembled: the FastAPI app, its error handlers, the
access middleware, and the endpoints' routers (``serving/routes/``, one module each).

This process tokenises, renders chat templates and streams SSE; the model runs in the engine
process behind ``EngineClient``, so HTTP work never stalls the step loop. Every refusal is an
OpenAI-shaped JSON error; nothing here leaks a stack trace to a client.

Nothing slow runs on the event loop, which also answers /health, /ready and /metrics:
structured-output grammars are built and compiled in worker processes under a time budget
(``guided.GrammarService``), and long texts are tokenised, detokenised and chat-rendered on a
few threads (``text_offload``, ``offload.ThreadJobs``); short ones stay inline, where a thread
would cost more than the work.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ketch.engine.serving import openapi
from ketch.engine.serving.admission import check_control_access, credential_ok
from ketch.engine.serving.guided import GrammarService
from ketch.engine.serving.offload import NOT_ACCEPTED, Busy
from ketch.engine.serving.pairing import NOT_ACCEPTED_HEADER
from ketch.engine.serving.protocol import ProtocolError, error_body
from ketch.engine.serving.routes import (
    chat,
    completions,
    control,
    embeddings,
    health,
    metrics,
    models,
    tokenization,
)
from ketch.engine.serving.state import ServingState

_OPEN_PATHS = ("/health", "/ready", "/metrics")
_CONTROL_PATHS = ("/pause", "/resume")
# In this order: the paths' order in the OpenAPI document.
_ROUTES = (completions, chat, models, embeddings, tokenization, health, metrics, control)


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

    for module in _ROUTES:
        app.include_router(module.router)
    openapi.install(app)
    return app


def _grammar_service(state: ServingState) -> GrammarService:
    config = state.config
    tokenizer = state.tokenizer
    return GrammarService(
        tokenizer.path / "tokenizer.json",
        state.prompt_limits.vocab_size,
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
