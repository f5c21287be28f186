"""OpenTelemetry traces (``--otlp-traces-endpoint``), for ``ketch serve`` and ``ketch router``.

This module never imports OpenTelemetry: it checks the settings and hands out the no-op
pieces the request paths call when tracing is off, so a server without the flag loads none of
the SDK and does no per-request work beyond a dict look-up. ``start`` imports
``ketch.engine.tracing_otel`` (the SDK, the exporter, the ASGI middleware) only when the flag
is given. What the spans are and how they nest: docs/tracing.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ketch.engine.tracing_scope import SCOPE_KEY

if TYPE_CHECKING:
    from ketch.engine.tracing_otel import Tracing

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
GENERAL_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_PROTOCOL"
SERVICE_ENV = "OTEL_SERVICE_NAME"
PROTOCOLS = ("grpc", "http/protobuf")
MAX_ENDPOINT_LENGTH = 2048

ENDPOINT_HELP = (
    "Send OpenTelemetry traces of requests to this OTLP collector: http(s)://host:port (https "
    "for TLS) or host:port. $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL picks the exporter: grpc "
    "(default; e.g. :4317) or http/protobuf (e.g. http://collector:4318; the path defaults to "
    "/v1/traces). $OTEL_SERVICE_NAME names the service. A client's W3C traceparent header "
    "becomes the parent of the request's spans. Unset: tracing is off and costs nothing."
)


def check_endpoint(value: Any, name: str = "otlp_traces_endpoint") -> None:
    """Raises ValueError unless ``value`` is None or an OTLP endpoint: ``http(s)://host[:port]
    [/path]`` or ``host:port``."""
    if value is None:
        return
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a URL string, got {type(value).__name__}")
    if not value or len(value) > MAX_ENDPOINT_LENGTH or not _plain(value):
        raise ValueError(
            f"{name} must be http(s)://host:port or host:port (at most {MAX_ENDPOINT_LENGTH} "
            f"printable ASCII characters, no spaces), got {value[:80]!r}"
        )
    text = value if "://" in value else f"http://{value}"
    problem = None
    try:
        parts = urlsplit(text)
        port = parts.port  # a ValueError when it is not a number or out of range
    except ValueError as exc:
        parts, port, problem = None, None, str(exc)
    if parts is not None and problem is None:
        if parts.scheme not in ("http", "https"):
            problem = f"the scheme must be http or https, not {parts.scheme!r}"
        elif not parts.hostname:
            problem = "it names no host"
        elif "://" not in value and (port is None or parts.path or parts.query):
            problem = "without a scheme it must be host:port"
        elif parts.query or parts.fragment or parts.username or parts.password:
            problem = "it may not carry a query, fragment or credentials"
    if problem:
        raise ValueError(
            f"{name} must be http(s)://host:port or host:port, got {value[:80]!r}: {problem}"
        )


def _plain(value: str) -> bool:
    return value.isascii() and value.isprintable() and " " not in value


def exporter_protocol(env: Mapping[str, str] | None = None) -> str:
    """The OTLP protocol the spec's variables choose (the traces one over the general one);
    grpc when neither is set. A ValueError names the variable for any other value."""
    env = os.environ if env is None else env
    for name in (PROTOCOL_ENV, GENERAL_PROTOCOL_ENV):
        value = env.get(name, "").strip()
        if value:
            if value not in PROTOCOLS:
                raise ValueError(f"${name} must be one of {list(PROTOCOLS)}, got {value[:40]!r}")
            return value
    return "grpc"


def service_name(default: str, env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return env.get(SERVICE_ENV, "").strip() or default


def start(endpoint: str, default_service: str) -> Tracing:
    """Tracing on: the SDK's provider, a batch processor and the OTLP exporter (imported here,
    not before). Raises ValueError for a bad endpoint or protocol."""
    check_endpoint(endpoint)
    protocol = exporter_protocol()
    try:
        from ketch.engine.tracing_otel import Tracing, load_exporter

        load_exporter(protocol)
    except ImportError as exc:
        raise ValueError(
            f"--otlp-traces-endpoint: the OpenTelemetry OTLP {protocol} exporter cannot be "
            f"loaded ({exc}). If opentelemetry/proto is xds-protos' older copy, reinstall "
            "opentelemetry-proto (make setup does)."
        ) from None
    return Tracing(endpoint, protocol, service_name(default_service))


def note_choices(scope: Mapping[str, Any], choices: list) -> None:
    """Hands a request's engine choices to its trace (their timings become its spans); does
    nothing when tracing is off."""
    record = scope.get(SCOPE_KEY)
    if record is not None:
        record.choices = choices


class _NoHop:
    """A router hop when tracing is off: the headers go as they are; nothing is recorded."""

    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        return headers

    def answered(self, status: int, retried: bool = False) -> None:
        pass

    def failed(self, exc: BaseException, retried: bool = False) -> None:
        pass


class _NoHops:
    def start(self, target: Any, prefill: Any, path: str) -> _NoHop:
        return NO_HOP


NO_HOP = _NoHop()
NO_HOPS = _NoHops()


def hops(scope: Mapping[str, Any]) -> Any:
    """The router's hop recorder for this request (``NO_HOPS`` when tracing is off)."""
    record = scope.get(SCOPE_KEY)
    return NO_HOPS if record is None else record
