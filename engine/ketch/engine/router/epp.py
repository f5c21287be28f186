"""``ketch router --epp-port``: the router as a Gateway API Inference Extension endpoint picker.

A ``grpc.aio`` server beside the router's HTTP server, sharing its instances, policies and P/D
pairing. Each Envoy ``ext_proc`` ``Process`` stream is one HTTP request:

1. ``request_headers``; with a body, buffered mode answers them at once (unchanged) and waits
   for the whole body, FULL_DUPLEX_STREAMED mode holds the answer until the body's last chunk;
2. the body (at most ``max_request_bytes``: 413), parsed for its shape and prompt;
3. the pick: the router's policy chooses the primary instance (within the subset hint, if any),
   the other ready instances of its role follow, least loaded first; the list goes out as the
   ``x-gateway-destination-endpoint`` header and the same ``envoy.lb`` metadata value; in
   P/D mode the destination is a decode instance and ``x-ketch-prefill`` names its prefill
   peer (a client's own ``x-ketch-prefill`` is always dropped); streamed bodies are echoed;
4. the response phases pass through unchanged (streamed response bodies echoed).

Refusals are ImmediateResponses: 400 (bad body, bad subset hint), 404 (unknown model), 413,
429 (every candidate at ``epp_shed_load``), 503 (no ready instance, none in the subset). While
the router drains, readiness is NOT_SERVING but picks go on: a pick is instant, and the gateway,
not the router, carries the request. A stream that
breaks the protocol (phases out of order, repeated headers, undecodable messages, a request
phase slower than ``body_timeout``) ends with a gRPC error; it is the only one affected.
"""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ketch.engine.router.app import RouterState, _pick
from ketch.engine.router.epp_protocol import (
    EXT_PROC_SERVICE,
    Head,
    Refusal,
    decision,
    immediate,
    passed,
    read_body,
    read_head,
    streamed_body,
)
from ketch.engine.router.instances import Instance
from ketch.engine.router.policies import PrefixHash
from ketch.engine.serving.pairing import PREFILL_HEADER

logger = logging.getLogger("ketch.router.epp")

OUTCOMES = ("picked", "no_endpoint", "rejected", "error")
MAX_ENDPOINTS = 4  # the primary and up to three fallbacks
_DECISION_BUCKETS = (
    0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005,
    0.01, 0.025, 0.05, 0.1, 0.25, 1,
)  # fmt: skip
_RESPONSE_PHASES = ("response_headers", "response_body", "response_trailers", "request_trailers")


class ProtocolViolation(Exception):
    """The stream broke the ext_proc protocol: it ends with a gRPC error."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class EppMetrics:
    """``ketch:epp_*`` series on the router's /metrics, all present from start."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "ketch:epp_requests",
            "Endpoint picker requests by outcome: picked, no_endpoint (503), rejected (429 "
            "saturated, 400/413 bad body, 404 unknown model), error (the ext_proc stream "
            "broke the protocol).",
            ["outcome"],
            registry=registry,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.decision = Histogram(
            "ketch:epp_decision_seconds",
            "Seconds from the last request phase the pick needs to the pick's answer.",
            buckets=_DECISION_BUCKETS,
            registry=registry,
        )
        self.streams = Gauge("ketch:epp_streams", "Open ext_proc streams.", registry=registry)


def endpoint(inst: Instance) -> str:
    """``ip:port`` as the gateway routes to it."""
    return urlsplit(inst.url).netloc


class Picker(pb_grpc.ExternalProcessorServicer):
    """The ext_proc service: one request per ``Process`` stream."""

    def __init__(self, state: RouterState, metrics: EppMetrics) -> None:
        self.state = state
        self.metrics = metrics
        self.open_streams = 0

    async def Process(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        if self.open_streams >= self.state.config.epp_max_streams:
            self.metrics.requests.labels("error").inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the endpoint picker has {self.open_streams} streams open (--epp-max-streams)",
            )
        self.open_streams += 1
        self.metrics.streams.inc()
        try:
            await self._stream(context)
        except ProtocolViolation as exc:
            self.metrics.requests.labels("error").inc()
            await context.abort(exc.code, str(exc))
        except grpc.aio.AbortError:
            raise
        except Exception:  # a bug: this stream fails, the others go on
            logger.exception("endpoint picker stream failed")
            self.metrics.requests.labels("error").inc()
            await context.abort(grpc.StatusCode.INTERNAL, "the endpoint picker failed")
        finally:
            self.open_streams -= 1
            self.metrics.streams.dec()

    async def _read(self, context: grpc.aio.ServicerContext, deadline: float):
        """The next message, or None at the end of the stream."""
        left = deadline - asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(max(left, 0)):
                message = await context.read()
        except TimeoutError:
            raise ProtocolViolation(grpc.StatusCode.DEADLINE_EXCEEDED, "stream idle") from None
        except DecodeError:
            raise ProtocolViolation(
                grpc.StatusCode.INVALID_ARGUMENT, "a message is not a ProcessingRequest"
            ) from None
        return None if message is grpc.aio.EOF else message

    async def _stream(self, context: grpc.aio.ServicerContext) -> None:
        cfg = self.state.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.body_timeout
        first = await self._read(context, deadline)
        if first is None:
            return  # closed before asking anything
        if first.WhichOneof("request") != "request_headers":
            raise ProtocolViolation(
                grpc.StatusCode.INVALID_ARGUMENT, "the first message must be request_headers"
            )
        try:
            head = read_head(first)
        except Refusal as refusal:
            await self._refuse(context, refusal)
            return
        if head.has_body and head.unsupported_mode:
            raise ProtocolViolation(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"request body mode {head.unsupported_mode} is not supported: configure the "
                "gateway's ext_proc with BUFFERED or FULL_DUPLEX_STREAMED",
            )
        if head.has_body and not head.streamed:
            await context.write(passed("request_headers"))
        body = bytearray()
        trailers = False
        while head.has_body:
            message = await self._read(context, deadline)
            if message is None:
                return  # abandoned mid-body: nothing to answer
            kind = message.WhichOneof("request") or "an empty message"
            if kind == "request_trailers":  # the body ended without end_of_stream
                trailers = True
                break
            if kind != "request_body":
                raise ProtocolViolation(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{kind} before the request body ended"
                )
            body += message.request_body.body
            if len(body) > cfg.max_request_bytes:
                limit = cfg.max_request_bytes
                refusal = Refusal(413, f"request body is larger than {limit} bytes")
                await self._refuse(context, refusal)
                return
            if message.request_body.end_of_stream:
                break
        started = time.perf_counter()
        try:
            answer = self._decide(head, bytes(body))
        except Refusal as refusal:
            await self._refuse(context, refusal)
            return
        await self._send_pick(context, head, answer, bytes(body), trailers)
        self.metrics.decision.observe(time.perf_counter() - started)
        self.metrics.requests.labels("picked").inc()
        await self._pass_responses(context, head)

    async def _send_pick(
        self,
        context: grpc.aio.ServicerContext,
        head: Head,
        answer: tuple,
        body: bytes,
        trailers: bool,
    ) -> None:
        """The pick answers the last phase Envoy waits on; answers it holds come in order."""
        endpoints, extra, remove = answer
        if not head.has_body:
            await context.write(decision(endpoints, extra, remove, "request_headers"))
        elif head.streamed:
            await context.write(decision(endpoints, extra, remove, "request_headers"))
            for piece in streamed_body("request_body", body, not trailers):
                await context.write(piece)
        else:
            await context.write(decision(endpoints, extra, remove, "request_body"))
        if trailers:
            await context.write(passed("request_trailers"))

    async def _pass_responses(self, context: grpc.aio.ServicerContext, head: Head) -> None:
        """After the pick: response phases pass unchanged until the gateway ends the stream."""
        timeout = self.state.config.request_timeout
        while True:
            deadline = asyncio.get_running_loop().time() + timeout
            message = await self._read(context, deadline)
            if message is None:
                return
            kind = message.WhichOneof("request") or "an empty message"
            if kind not in _RESPONSE_PHASES:
                raise ProtocolViolation(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{kind} after the request was answered"
                )
            if kind == "response_body" and head.echo_response:
                chunk = message.response_body
                for piece in streamed_body(kind, chunk.body, chunk.end_of_stream):
                    await context.write(piece)
            else:
                await context.write(passed(kind))

    async def _refuse(self, context: grpc.aio.ServicerContext, refusal: Refusal) -> None:
        outcome = "no_endpoint" if refusal.status == 503 else "rejected"
        self.metrics.requests.labels(outcome).inc()
        if refusal.status >= 500:
            logger.warning("EPP refused a request (%d): %s", refusal.status, refusal.message)
        await context.write(immediate(refusal.status, refusal.message))

    # ------------------------------------------------------------ the pick

    def _decide(self, head: Head, body: bytes) -> tuple[list[str], dict[str, str], list[str]]:
        """(endpoints primary first, headers to set, headers to remove), or a Refusal."""
        state = self.state
        hash_prompt = isinstance(state.policy, PrefixHash)
        wanted = read_body(head.path, body, state.config.prefix_chunk_chars, hash_prompt)
        exclude = self._outside(head.subset, wanted.paired)
        exclude |= self._other_models(wanted.model)
        self._check_saturation(exclude, wanted.paired)
        picked = _pick(state, wanted.chunks, exclude, wanted.paired)
        if picked is None:
            self._check_model(wanted.model)
            where = " among the subset hint's endpoints" if head.subset is not None else ""
            raise Refusal(503, f"no ready instance can serve this request{where}; retry shortly")
        target, prefill = picked
        others = [
            i
            for i in state.registry.healthy(target.role)
            if i.url != target.url and i.url not in exclude
        ]
        others.sort(key=lambda i: (i.load, i.url))
        endpoints = [endpoint(i) for i in [target, *others][:MAX_ENDPOINTS]]
        if prefill is None:
            return endpoints, {}, [PREFILL_HEADER]
        return endpoints, {PREFILL_HEADER: f"{prefill.host}:{prefill.pd_comm_port}"}, []

    def _outside(self, subset: frozenset[str] | None, paired: bool) -> set[str]:
        """URLs the subset hint rules out as destinations. A paired request's prefill peer is
        no destination: the hint does not limit it."""
        if subset is None:
            return set()
        return {
            i.url
            for i in self.state.registry.instances.values()
            if endpoint(i) not in subset and not (paired and i.role == "prefill")
        }

    def _other_models(self, model: str | None) -> set[str]:
        """URLs of instances whose /ready names another model than the request's."""
        if model is None:
            return set()
        instances = self.state.registry.instances.values()
        return {i.url for i in instances if i.model is not None and i.model != model}

    def _check_model(self, model: str | None) -> None:
        """A 404 when no ready instance serves ``model`` (instances that name none count as
        serving anything: the instance itself answers then)."""
        if model is None:
            return
        served = {i.model for i in self.state.registry.instances.values() if i.healthy}
        if served and None not in served and model not in served:
            names = ", ".join(sorted(m for m in served if m)[:16])
            raise Refusal(404, f"The model '{model}' does not exist. Available models: {names}")

    def _check_saturation(self, exclude: set[str], paired: bool) -> None:
        limit = self.state.config.epp_shed_load
        if not limit:
            return
        roles = ("mixed", "decode") if paired else ("mixed", "prefill", "decode")
        candidates = [
            i for role in roles for i in self.state.registry.healthy(role) if i.url not in exclude
        ]
        if candidates and all(i.load >= limit for i in candidates):
            raise Refusal(429, "every instance is saturated; retry later")


class EndpointPicker:
    """The gRPC server: ext_proc plus gRPC health, on ``config.epp_port``."""

    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.metrics = EppMetrics(state.metrics.registry)
        self.health = health_aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        cfg = self.state.config
        # Room for a buffered body past the limit (it gets a 413) and a large subset hint.
        limit = cfg.max_request_bytes + (1 << 20)
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.keepalive_time_ms", 60_000),
                ("grpc.so_reuseport", 0),
            ],
        )  # Picker.Process refuses streams past epp_max_streams itself
        pb_grpc.add_ExternalProcessorServicer_to_server(
            Picker(self.state, self.metrics), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.server.add_insecure_port(f"{cfg.host}:{cfg.epp_port}")
        await self.refresh_health()
        await self.server.start()
        self._watch = asyncio.create_task(self._watch_health())
        logger.info("endpoint picker (ext_proc, gRPC health) on %s:%d", cfg.host, cfg.epp_port)

    async def refresh_health(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        ready = self.state.registry.can_serve() and not self.state.draining
        status = serving if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", "liveness"):
            await self.health.set(service, serving)
        for service in ("readiness", EXT_PROC_SERVICE):
            await self.health.set(service, status)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.state.config.health_interval)
            try:
                await self.refresh_health()
            except Exception:  # the loop must not die quietly
                logger.exception("endpoint picker health update failed; continuing")

    async def stop(self, grace: float) -> None:
        """Readiness turns NOT_SERVING, no new stream is taken, and open ones (a request's
        response phases last as long as its answer) get ``grace`` seconds."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        if self.server is not None:
            await self.refresh_health()
            await self.server.stop(grace)
