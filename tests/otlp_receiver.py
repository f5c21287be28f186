"""A real OTLP trace receiver for tests and benchmarks: OTLP/HTTP (POST /v1/traces, protobuf)
and OTLP/gRPC (TraceService.Export), decoding ``ExportTraceServiceRequest`` with
``opentelemetry.proto`` and keeping every span it gets, as plain records."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from procs import free_ports

KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
STATUS = {0: "unset", 1: "ok", 2: "error"}


@dataclass
class Got:
    """One received span."""

    service: str
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str
    start: int
    end: int
    status: str
    status_message: str
    attributes: dict[str, Any] = field(default_factory=dict)


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


def decode(payload: bytes) -> list[Got]:
    request = trace_service_pb2.ExportTraceServiceRequest()
    request.ParseFromString(payload)
    return spans_of(request)


def spans_of(request: Any) -> list[Got]:
    out = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    Got(
                        service=str(resource.get("service.name", "")),
                        name=s.name,
                        kind=KINDS.get(s.kind, str(s.kind)),
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        start=s.start_time_unix_nano,
                        end=s.end_time_unix_nano,
                        status=STATUS.get(s.status.code, str(s.status.code)),
                        status_message=s.status.message,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                    )
                )
    return out


class Receiver:
    """Both transports on free loopback ports; ``spans`` grows as exports arrive."""

    def __init__(self) -> None:
        self.spans: list[Got] = []
        self.lock = threading.RLock()
        self.http_port, self.grpc_port = free_ports(2)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                payload = self.rfile.read(length)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._add(decode(payload))
                body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", self.http_port), Handler)
        self._thread = threading.Thread(target=self.http.serve_forever, daemon=True)

        import grpc

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                receiver._add(spans_of(request))
                return trace_service_pb2.ExportTraceServiceResponse()

        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.grpc)
        self.grpc.add_insecure_port(f"127.0.0.1:{self.grpc_port}")

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    def _add(self, spans: list[Got]) -> None:
        with self.lock:
            self.spans += spans

    def start(self) -> None:
        self._thread.start()
        self.grpc.start()

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.grpc.stop(grace=None)

    def trace(self, trace_id: str) -> list[Got]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_trace(self, trace_id: str, count: int, timeout: float = 30.0) -> list[Got]:
        """The spans of ``trace_id`` once there are at least ``count`` (fewer past timeout)."""
        self.wait_for(lambda _: len(self.trace(trace_id)) >= count, timeout)
        return self.trace(trace_id)

    def wait_for(self, check, timeout: float = 30.0) -> list[Got]:
        """Polls until ``check(spans so far)`` returns a true value, which is returned."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                found = check(list(self.spans))
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.05)


@contextmanager
def receiving() -> Iterator[Receiver]:
    receiver = Receiver()
    receiver.start()
    try:
        yield receiver
    finally:
        receiver.stop()
