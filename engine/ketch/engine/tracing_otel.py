"""Tracing on: the OpenTelemetry SDK's provider and OTLP exporter, and the ASGI middleware that
gives each traced HTTP request its server span.

Imported only through ``ketch.engine.tracing.start`` (``--otlp-traces-endpoint``). Spans are
handed to the SDK's batch processor, whose thread exports them: the event loop never waits on
the collector. A collector that is down or slow costs dropped spans, never a request: export
failures are logged once (and once more when it recovers), and the SDK's own per-retry warnings
are kept out of the log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ketch.engine.tracing_scope import SCOPE_KEY

logger = logging.getLogger("ketch.tracing")

MAX_TRACEPARENT = 256  # a version-00 one is 55 characters; longer is garbage, ignored
MAX_TRACESTATE = 4096  # 32 members of at most 128 characters
_SHUTDOWN_S = 5.0

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]
Finish = Callable[["RequestTrace", Span], None]


def load_exporter(protocol: str) -> type[SpanExporter]:
    """The OTLP span exporter class for ``protocol`` (an ImportError if it cannot load)."""
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

    return Grpc


def _exporter(endpoint: str, protocol: str) -> SpanExporter:
    exporter = load_exporter(protocol)
    if protocol == "http/protobuf":
        url = endpoint if "://" in endpoint else f"http://{endpoint}"
        if urlsplit(url).path in ("", "/"):
            url = url.rstrip("/") + "/v1/traces"
        return exporter(endpoint=url)
    return exporter(endpoint=endpoint)  # http:// plaintext, https:// TLS; host:port per the spec


class _Reporting(SpanExporter):
    """The OTLP exporter, whose failures are logged once per outage (not per batch or retry)."""

    def __init__(self, inner: SpanExporter, endpoint: str) -> None:
        self.inner = inner
        self.endpoint = endpoint
        self.failing = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        why = ""
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # never let the exporter thread die on a collector's fault
            result, why = SpanExportResult.FAILURE, f": {type(exc).__name__}: {exc}"
        if result is SpanExportResult.SUCCESS:
            if self.failing:
                logger.info("the OTLP collector at %s takes traces again", self.endpoint)
            self.failing = False
        elif not self.failing:
            self.failing = True
            logger.warning(
                "could not export %d span(s) to the OTLP collector at %s%s; requests are "
                "served as before and spans are dropped while it is unreachable (logged once "
                "until it recovers)",
                len(spans),
                self.endpoint,
                why,
            )
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class Tracing:
    """One process's tracer: provider, batch processor, exporter, W3C propagation."""

    def __init__(self, endpoint: str, protocol: str, service: str) -> None:
        logging.getLogger("opentelemetry.exporter.otlp").setLevel(logging.CRITICAL)
        self.endpoint, self.protocol, self.service = endpoint, protocol, service
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        exporter = _Reporting(_exporter(endpoint, protocol), endpoint)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("ketch")
        self.propagator = TraceContextTextMapPropagator()
        logger.info("tracing: OTLP %s to %s as service %r", protocol, endpoint, service)

    def parent(self, headers: Sequence[tuple[bytes, bytes]]) -> Context | None:
        """The client's span (W3C traceparent/tracestate) as the parent; None if it sent none
        or an invalid one (then the request starts a trace)."""
        carrier: dict[str, str] = {}
        for name, value in headers:
            if name == b"traceparent" and len(value) <= MAX_TRACEPARENT:
                carrier["traceparent"] = value.decode("latin-1")
            elif name == b"tracestate" and len(value) <= MAX_TRACESTATE:
                carrier["tracestate"] = value.decode("latin-1")
        if "traceparent" not in carrier:
            return None
        try:
            return self.propagator.extract(carrier)
        except Exception:  # a malformed header is ignored, never an error
            return None

    def inject(self, span: Span, headers: dict[str, str]) -> None:
        headers.pop("tracestate", None)  # the client's goes on only with its own traceparent
        self.propagator.inject(headers, context=set_span_in_context(span))

    def child(
        self,
        parent: Span,
        name: str,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any],
        error: str | None = None,
    ) -> Span:
        """A finished internal span under ``parent`` with the given times (epoch ns)."""
        span = self.tracer.start_span(
            name, set_span_in_context(parent), SpanKind.INTERNAL, attributes, start_time=start_ns
        )
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=max(end_ns, start_ns))
        return span

    def middleware(
        self, routes: Mapping[str, str], finish: Finish | None = None
    ) -> Callable[[ASGIApp], Any]:
        """An ASGI middleware factory (``app.add_middleware``): POSTs to ``routes`` (path: span
        name) get a server span, finished by ``finish`` when the response is sent."""
        tracing = self

        class TraceMiddleware:
            def __init__(self, app: ASGIApp) -> None:
                self.app = app

            async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
                name = routes.get(scope.get("path", "")) if scope["type"] == "http" else None
                if name is None or scope.get("method") != "POST":
                    await self.app(scope, receive, send)
                    return
                record = tracing.begin(scope, name)

                async def traced_send(message: dict) -> None:
                    if message["type"] == "http.response.start":
                        record.status = message["status"]
                    elif message["type"] == "http.response.body":
                        # The span ends as the last byte goes out (a middleware may end a
                        # response with an empty message after the bytes: not that one's time).
                        record.complete = not message.get("more_body", False)
                        if message.get("body") or (record.complete and not record.end_ns):
                            record.end_ns = time.time_ns()
                    await send(message)

                try:
                    await self.app(scope, receive, traced_send)
                except BaseException as exc:
                    record.error = exc
                    raise
                finally:
                    tracing.end(record, finish)

        return TraceMiddleware

    def begin(self, scope: dict, name: str) -> RequestTrace:
        parent = self.parent(scope.get("headers") or ())
        attributes = {"http.request.method": "POST", "http.route": scope.get("path", "")}
        span = self.tracer.start_span(
            name, parent, SpanKind.SERVER, attributes, start_time=time.time_ns()
        )
        record = RequestTrace(self, span)
        scope[SCOPE_KEY] = record
        return record

    def end(self, record: RequestTrace, finish: Finish | None) -> None:
        span = record.span
        try:
            if record.status:
                span.set_attribute("http.response.status_code", record.status)
            if finish is not None:
                finish(record, span)
            problem = record.problem()
            if problem is not None:
                span.set_status(Status(StatusCode.ERROR, problem))
                span.set_attribute("error.type", record.error_type())
            for hop in record.hops:
                hop.end(record.end_ns)
        except Exception:  # a tracing fault never fails a request
            logger.exception("could not finish a request's span")
        finally:
            span.end(end_time=record.end_ns or time.time_ns())

    def shutdown(self) -> None:
        """Exports what is queued, waiting at most a few seconds (a dead collector must not
        hold the process's exit)."""
        done = threading.Thread(target=self.provider.shutdown, name="otel-shutdown", daemon=True)
        done.start()
        done.join(_SHUTDOWN_S)
        if done.is_alive():
            logger.warning("tracing: spans still queued for %s were dropped", self.endpoint)


class RequestTrace:
    """One traced request: its server span, what happened to it, and (router) its hops."""

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self.tracing = tracing
        self.span = span
        self.status = 0
        self.complete = False
        self.end_ns = 0  # when the response's last byte was sent
        self.error: BaseException | None = None
        self.choices: list | None = None  # the engine's choices (tracing.note_choices)
        self.hops: list[Hop] = []
        self.incomplete_reason: str | None = None  # set by ``finish``: a stream that failed

    def problem(self) -> str | None:
        """Why the request failed, or None: 5xx, a client gone, an exception, a cut stream."""
        if self.error is not None:
            kind = type(self.error).__name__
            if kind == "CancelledError":
                return "cancelled (the client went away or the server stopped)"
            return f"{kind}: {str(self.error)[:200]}"
        if self.status >= 500 or self.status == 499:
            return f"HTTP {self.status}"
        if not self.complete:
            return "the response was not sent to its end (the client went away)"
        return self.incomplete_reason

    def error_type(self) -> str:
        if self.error is not None:
            return type(self.error).__name__
        if self.status >= 500 or self.status == 499:
            return str(self.status)
        return "incomplete"

    def start(self, target: Any, prefill: Any, path: str) -> Hop:
        """A client span for one try of a router hop (``tracing.hops``)."""
        attributes: dict[str, Any] = {
            "http.request.method": "POST",
            "url.full": f"{target.url}{path}",
            "server.address": target.host,
            "server.port": urlsplit(target.url).port or 80,
            "ketch.instance.role": target.role,
            "ketch.hop.attempt": len(self.hops) + 1,
        }
        if prefill is not None:
            attributes["ketch.prefill.instance"] = prefill.url
        span = self.tracing.tracer.start_span(
            f"POST {path}",
            set_span_in_context(self.span),
            SpanKind.CLIENT,
            attributes,
            start_time=time.time_ns(),
        )
        hop = Hop(self.tracing, span)
        self.hops.append(hop)
        return hop


class Hop:
    """One try of a proxied request on one instance (the router's client span)."""

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self.tracing = tracing
        self.span = span
        self.ended = False

    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        """``headers`` plus this hop's traceparent, so the instance's spans are its children."""
        sent = dict(headers)
        self.tracing.inject(self.span, sent)
        return sent

    def answered(self, status: int, retried: bool = False) -> None:
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
            self.span.set_attribute("error.type", str(status))
        if retried:
            self.span.set_attribute("ketch.hop.retried", True)
            self.end()

    def failed(self, exc: BaseException, retried: bool = False) -> None:
        self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {str(exc)[:200]}"))
        self.span.set_attribute("error.type", type(exc).__name__)
        self.span.set_attribute("ketch.hop.retried", retried)
        self.end()

    def end(self, end_ns: int = 0) -> None:
        if not self.ended:
            self.ended = True
            self.span.end(end_time=end_ns or time.time_ns())
