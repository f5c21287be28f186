"""The router's HTTP front: OpenAI endpoints forwarded to instances, plus its own control API.

Mixed and prefill/decode requests share one forwarding path: read the body (bounded in size
and in time), pick the target (and, for prefill/decode, a prefill peer named in
``x-ketch-prefill``), send the body unchanged, and pass the answer back. ``/v1/embeddings``
samples nothing, so it needs no pair: it goes to a mixed instance, else a prefill one, else a
decode one, which computes it where it is (no KV handoff). The router parses a
body only for prefix-hash, and only to hash its prompt; the instances validate requests. SSE
streams are passed through chunk by chunk; a stream that breaks mid-way ends with an in-stream
error event, so clients fail promptly instead of hanging.

Clients never see backends' addresses or errors (503, 502, 504 bodies and ``/ready`` say what
happened in general terms); the router's log and ``/v1/ketch/instances`` (admin key or
registration token) have the details.

A request goes to a second instance only when the connection to the first failed, so nothing
of it reached that instance (which leaves rotation). Once an instance has the request, its
answer — a 503 included — or its failure is the client's answer: a request that broke one
instance is not carried to the next.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ketch.engine.router.admission import Refused, error_response, read_body, refused_response
from ketch.engine.router.config import RouterConfig
from ketch.engine.router.instances import Instance, Registry
from ketch.engine.router.metrics import RouterMetrics
from ketch.engine.router.policies import Policy, PrefixHash, make_policy, prompt_chunks
from ketch.engine.router.registration import check_listing_access, registration_routes
from ketch.engine.serving.pairing import NOT_ACCEPTED_HEADER, PREFILL_HEADER
from ketch.engine.tracing import hops as traced_hops

logger = logging.getLogger("ketch.router")

# W3C trace context passes through (with --otlp-traces-endpoint, the hop's own replaces it).
_PASS_HEADERS = (
    "authorization",
    "content-type",
    "accept",
    "x-request-id",
    "traceparent",
    "tracestate",
)
# The connection failed before any byte of the request went out: the instance never saw it,
# so it may go to another. Every other failure comes after the instance may have started.
_NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
_FAILED = (aiohttp.ClientError, TimeoutError, OSError)


@dataclass
class RouterState:
    """What the handlers of one router process share: settings, instances, policies, counts."""

    config: RouterConfig
    registry: Registry
    policy: Policy
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    decode_policy: Policy | None = None
    in_flight: int = 0
    draining: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    registration_token: str | None = None  # None: registration is refused, whatever the config
    admin_key: str | None = None  # for /v1/ketch/instances (besides the registration token)
    _details_logged: float = -60.0  # when the details of "no instance" were last logged

    @classmethod
    def from_config(
        cls,
        config: RouterConfig,
        registration_token: str | None = None,
        admin_key: str | None = None,
    ) -> RouterState:
        policy = make_policy(config.policy, config.prefix_cache_entries, config.prefix_slack)
        decode = make_policy("round-robin" if config.policy == "round-robin" else "least-requests")
        state = cls(
            config,
            Registry(config),
            policy,
            decode_policy=decode,
            registration_token=registration_token,
            admin_key=admin_key,
        )
        state.idle.set()
        return state


def _sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": 502}}
    return f"data: {json.dumps(body)}\n\n".encode()


def create_app(state: RouterState) -> FastAPI:
    app = FastAPI(title="Ketch router", docs_url=None, redoc_url=None)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(state, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(state, request, "/v1/chat/completions")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await forward(state, request, "/v1/embeddings", paired=False)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        serving = state.registry.healthy("mixed") or state.registry.healthy("decode")
        if not serving:
            return error_response(503, _no_instance(state))
        headers = _passed_headers(request)
        try:
            async with state.registry.session.get(  # type: ignore[union-attr]
                f"{serving[0].url}/v1/models",
                headers=headers,
                timeout=_timeout(state),
                allow_redirects=False,
            ) as resp:
                body = await resp.read()
                kind = resp.headers.get("content-type", "application/json")
                return Response(body, status_code=resp.status, media_type=kind)
        except _NOT_SENT as exc:
            state.registry.mark_down(serving[0], f"/v1/models: connect failed: {_describe(exc)}")
            return error_response(502, "the instance could not be reached; retry")
        except _FAILED as exc:
            status = 504 if isinstance(exc, TimeoutError) else 502
            logger.warning("/v1/models from %s failed: %s", serving[0].url, _describe(exc))
            return error_response(status, "the instance failed to answer; retry")

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        problems = []
        if state.draining:
            problems.append("draining")
        if not state.registry.can_serve():
            problems.append(_no_instance(state))
        body = {"ready": not problems, "problems": problems, "policy": state.policy.name}
        return JSONResponse(body, status_code=503 if problems else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, kind = state.metrics.render(state.registry)
        return Response(body, media_type=kind)

    @app.get("/v1/ketch/instances")
    async def instances(request: Request) -> JSONResponse:
        try:  # the backends' addresses and errors: for operators, not for every client
            check_listing_access(request, state.registration_token, state.admin_key)
        except Refused as exc:
            return refused_response(exc)
        listed = sorted(state.registry.instances.values(), key=lambda i: (i.role, i.url))
        return JSONResponse(
            {"policy": state.policy.name, "instances": [i.to_json() for i in listed]}
        )

    app.include_router(registration_routes(state.config, state.registry, state.registration_token))
    return app


def _timeout(state: RouterState) -> aiohttp.ClientTimeout:
    cfg = state.config
    return aiohttp.ClientTimeout(total=cfg.request_timeout, sock_connect=cfg.connect_timeout)


def _passed_headers(request: Request) -> dict[str, str]:
    return {k: v for k in _PASS_HEADERS if (v := request.headers.get(k)) is not None}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


_NO_INSTANCE = (
    "no healthy instance can serve this request now (a mixed one, or a prefill and a decode "
    "one, is needed); retry shortly"
)


def _no_instance(state: RouterState) -> str:
    """What a client is told when nothing can serve; the details (addresses, the instances' own
    errors) go to the log, at most every 10 s, and to /v1/ketch/instances."""
    now = time.monotonic()
    if now - state._details_logged >= 10.0:
        state._details_logged = now
        logger.warning("%s", _no_instance_message(state))
    return _NO_INSTANCE


def _no_instance_message(state: RouterState) -> str:
    reg = state.registry
    known = len(reg.instances)
    if not known:
        return "no healthy instance: none is known yet (static, DNS or registered)"
    down = "; ".join(
        f"{i.url} ({i.role}): {i.last_error or 'not checked yet'}"
        for i in sorted(reg.instances.values(), key=lambda i: i.url)
        if not i.healthy
    )
    return f"no healthy instance can serve (need a mixed one, or a prefill and a decode): {down}"


def pick_instance(
    state: RouterState, chunks: list[bytes] | None, exclude: set[str], paired: bool = True
) -> tuple[Instance, Instance | None] | None:
    """(target, prefill peer or None); None when nothing healthy is left. Without ``paired``
    (a prompt-only request) any one instance will do, a prefill one before a decode one."""
    reg = state.registry
    mixed = [i for i in reg.healthy("mixed") if i.url not in exclude]
    if mixed:
        return _choose(state, state.policy, mixed, chunks), None
    prefill = [i for i in reg.healthy("prefill") if i.url not in exclude]
    decode = [i for i in reg.healthy("decode") if i.url not in exclude]
    if not paired and (prefill or decode):
        return _choose(state, state.policy, prefill or decode, chunks), None
    if not prefill or not decode:
        return None
    p = _choose(state, state.policy, prefill, chunks)
    d = _choose(state, state.decode_policy or state.policy, decode, None)
    return d, p


def _choose(
    state: RouterState, policy: Policy, candidates: list[Instance], chunks: list[bytes] | None
) -> Instance:
    before = policy.matches if isinstance(policy, PrefixHash) else 0
    inst = policy.choose(candidates, chunks)
    if isinstance(policy, PrefixHash) and policy.matches > before:
        state.metrics.prefix_matches.inc()
    inst.sent_since_scrape += 1
    return inst


async def forward(state: RouterState, request: Request, path: str, paired: bool = True) -> Response:
    """Forwards one OpenAI request. Only a failed connection (nothing of the request reached
    the instance) sends it to another, once; see the module docstring for why no more.
    ``paired``: in a prefill/decode deployment the request needs a prefill and a decode
    instance (else any instance computes it alone)."""
    started = time.monotonic()
    if state.draining:
        return error_response(503, "the router is shutting down; retry shortly")
    try:
        body = await read_body(request, state.config.max_request_bytes, state.config.body_timeout)
    except Refused as exc:
        return refused_response(exc)
    chunks = None
    if isinstance(state.policy, PrefixHash):
        chunks = prompt_chunks(path, body, state.config.prefix_chunk_chars)
    headers = _passed_headers(request)
    tried: set[str] = set()
    unreachable = ""
    hops = traced_hops(request.scope)  # a no-op unless --otlp-traces-endpoint
    for _ in range(2):
        picked = pick_instance(state, chunks, tried, paired)
        if picked is None:
            break
        target = picked[0]
        _enter(state, target)
        hop = hops.start(target, picked[1], path)
        try:
            resp = await _send(state, picked, path, body, hop.headers(headers))
        except _NOT_SENT as exc:
            hop.failed(exc, retried=True)
            _leave(state, target)
            unreachable = f"{target.url}: {_describe(exc)}"
            state.registry.mark_down(target, f"connect failed: {_describe(exc)}")
            state.metrics.upstream_errors.labels(target.url).inc()
            tried.add(target.url)
            continue
        except _FAILED as exc:
            hop.failed(exc)
            _leave(state, target)
            return _failed_after_send(state, target, exc, started)
        except BaseException:  # cancelled: the count must not leak, or draining waits on it
            _leave(state, target)
            raise
        not_accepted = resp.status == 503 and resp.headers.get(NOT_ACCEPTED_HEADER) == "1"
        hop.answered(resp.status, retried=not_accepted)
        if not_accepted:
            # Refused before any work (draining, paused, its engine just died): as safe to
            # send elsewhere as a refused connection.
            _leave(state, target)
            unreachable = f"{target.url}: answered 503 without taking the request"
            state.registry.mark_down(target, "refused requests (503, not accepted)")
            resp.release()
            tried.add(target.url)
            continue
        return await _relay(state, target, resp, started)
    if unreachable:
        state.metrics.requests.labels("none", "502").inc()
        logger.warning("no instance could be reached: %s", unreachable)
        return error_response(502, "no instance could be reached; retry shortly")
    state.metrics.requests.labels("none", "503").inc()
    return error_response(503, _no_instance(state))


async def _send(
    state: RouterState,
    picked: tuple[Instance, Instance | None],
    path: str,
    body: bytes,
    headers: dict[str, str],
) -> aiohttp.ClientResponse:
    """POSTs ``body`` to the target; a prefill peer, when there is one, goes in headers."""
    target, prefill = picked
    send = dict(headers)
    if prefill is not None:
        send[PREFILL_HEADER] = f"{prefill.host}:{prefill.pd_comm_port}"
    assert state.registry.session is not None  # opened by Registry.start before serving
    return await state.registry.session.post(  # a 307/308 would re-send the body elsewhere
        f"{target.url}{path}",
        data=body,
        headers=send,
        timeout=_timeout(state),
        allow_redirects=False,
    )


def _failed_after_send(
    state: RouterState, target: Instance, exc: BaseException, started: float
) -> JSONResponse:
    """502 (or 504 on timeout) for an instance that had the request; it stays in rotation
    (the health checks decide), and the request goes nowhere else."""
    state.metrics.upstream_errors.labels(target.url).inc()
    state.metrics.seconds.observe(time.monotonic() - started)
    if isinstance(exc, TimeoutError):
        status = 504
        message = (
            f"the instance did not answer within {state.config.request_timeout:g} s "
            "(--request-timeout); not retried elsewhere"
        )
    else:
        status = 502
        message = (
            "the instance failed after the request was sent; not retried: it may have started on it"
        )
    logger.warning("instance %s: %s (%s)", target.url, message, _describe(exc))
    state.metrics.requests.labels(target.url, str(status)).inc()
    return error_response(status, message)


async def _relay(
    state: RouterState, target: Instance, resp: aiohttp.ClientResponse, started: float
) -> Response:
    """Passes the instance's answer back: SSE chunk by chunk, anything else whole."""
    metrics = state.metrics
    metrics.requests.labels(target.url, str(resp.status)).inc()
    kind = resp.headers.get("content-type", "application/json")
    extra = {k: v for k in ("retry-after",) if (v := resp.headers.get(k))}
    if not kind.startswith("text/event-stream"):
        try:
            payload = await resp.read()
        except _FAILED as exc:
            metrics.upstream_errors.labels(target.url).inc()
            status = 504 if isinstance(exc, TimeoutError) else 502
            logger.warning("answer from %s broke off: %s", target.url, _describe(exc))
            why = " (--request-timeout)" if status == 504 else ""
            return error_response(status, f"the instance broke off its answer{why}; retry")
        finally:
            resp.release()
            _leave(state, target)
            metrics.seconds.observe(time.monotonic() - started)
        return Response(payload, status_code=resp.status, media_type=kind, headers=extra)

    async def stream() -> AsyncIterator[bytes]:
        try:
            async for piece in resp.content.iter_any():
                yield piece
        except _FAILED as exc:
            metrics.upstream_errors.labels(target.url).inc()
            logger.warning("stream from %s broke: %s: %s", target.url, type(exc).__name__, exc)
            yield b"\n\n" + _sse_error("the instance broke off the stream; retry")
        finally:
            resp.close()
            _leave(state, target)
            metrics.seconds.observe(time.monotonic() - started)

    return StreamingResponse(stream(), status_code=resp.status, media_type=kind, headers=extra)


def _enter(state: RouterState, target: Instance) -> None:
    target.in_flight += 1
    state.in_flight += 1
    state.metrics.in_flight.set(state.in_flight)
    state.idle.clear()


def _leave(state: RouterState, target: Instance) -> None:
    target.in_flight -= 1
    state.in_flight -= 1
    state.metrics.in_flight.set(state.in_flight)
    if state.in_flight == 0:
        state.idle.set()
