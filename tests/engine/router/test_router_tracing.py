"""One trace across processes: client -> ``ketch router`` (server span, a client span per hop,
traceparent injected) -> ``ketch serve`` (server span and its engine phases), both exporting to
a real OTLP receiver in this process (the router over OTLP/HTTP, the engine over gRPC)."""

from __future__ import annotations

import secrets

import openai
from otlp_receiver import Got, receiving
from router_harness import running_router
from serve_harness import running_server

FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


def _one(spans: list[Got], name: str, service: str, kind: str | None = None) -> Got:
    found = [s for s in spans if s.name == name and s.service == service and kind in (None, s.kind)]
    assert len(found) == 1, [(s.service, s.name) for s in spans]
    return found[0]


def test_one_trace_from_the_client_through_the_router_to_the_engine() -> None:
    with receiving() as receiver:
        engine_env = {**FAST_EXPORT, "OTEL_SERVICE_NAME": "engine-a"}
        router_env = {**FAST_EXPORT, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
        serve_args = ("--otlp-traces-endpoint", receiver.grpc_url)
        with running_server(*serve_args, env=engine_env) as engine:
            address = f"127.0.0.1:{receiver.http_port}"  # host:port: /v1/traces added
            with running_router(
                "--mixed", engine.url, "--otlp-traces-endpoint", address, env=router_env
            ) as router:
                client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
                trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
                stream = client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hello"}],
                    max_tokens=6, stream=True,
                    extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
                )  # fmt: skip
                assert sum(1 for _ in stream) >= 2
                spans = receiver.wait_trace(trace_id, 6)

                # Without a traceparent, the router's span is a root and the engine's its
                # grandchild all the same.
                client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
                roots = receiver.wait_for(
                    lambda got: [s for s in got if s.service == "ketch-router" and not s.parent_id]
                )
                later = receiver.wait_trace(roots[0].trace_id, 6)
                router_log = router.log()
            assert "Traceback" not in router_log
            assert "Traceback" not in engine.log()
    assert {s.trace_id for s in spans} == {trace_id}
    server = _one(spans, "POST /v1/chat/completions", "ketch-router", "server")
    assert server.parent_id == client_span
    assert server.attributes["http.response.status_code"] == 200
    hops = [s for s in spans if s.kind == "client"]
    assert len(hops) == 1
    (hop,) = hops
    assert hop.service == "ketch-router" and hop.parent_id == server.span_id
    assert hop.attributes["url.full"] == f"{engine.url}/v1/chat/completions"
    assert hop.attributes["ketch.instance.role"] == "mixed"
    assert hop.attributes["ketch.hop.attempt"] == 1
    assert hop.attributes["http.response.status_code"] == 200
    engine_span = _one(spans, "chat tiny", "engine-a")
    assert engine_span.kind == "server" and engine_span.parent_id == hop.span_id
    assert engine_span.attributes["gen_ai.usage.output_tokens"] == 6
    phases = [_one(spans, f"engine.{p}", "engine-a") for p in ("queue", "prefill", "decode")]
    assert all(p.parent_id == engine_span.span_id for p in phases)
    # Nested in time as in the tree (one host: one wall clock).
    assert server.start <= hop.start <= engine_span.start <= phases[0].start
    assert phases[-1].end <= engine_span.end <= hop.end <= server.end
    assert all(s.status == "unset" for s in spans)

    (root,) = roots
    assert {s.name for s in later if s.span_id != root.span_id} == {
        "POST /v1/completions", "text_completion tiny",
        "engine.queue", "engine.prefill", "engine.decode",
    }  # fmt: skip


def test_a_retried_hop_and_a_failed_one_are_recorded() -> None:
    """The router's hop records (as ``router.app.forward`` drives them) through the real SDK and
    exporter: a connection refused (retried elsewhere) and the try that answered; then a try
    that failed after sending, which makes the request an error."""
    from ketch.engine import tracing
    from ketch.engine.router.instances import Instance
    from ketch.engine.tracing_otel import Tracing

    first = Instance("http://10.0.0.1:8000", "decode", "static", 8004)
    second = Instance("http://10.0.0.2:8000", "decode", "static", 8004)
    prefill = Instance("http://10.0.0.3:8000", "prefill", "static", 8004)
    with receiving() as receiver:
        traces = Tracing(receiver.grpc_url, "grpc", "ketch-router")
        trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
        header = f"00-{trace_id}-{parent}-01".encode()
        for outcome in ("retried", "failed"):
            scope = {
                "type": "http",
                "path": "/v1/completions",
                "headers": [(b"traceparent", header)],
            }
            record = traces.begin(scope, "POST /v1/completions")
            hops = tracing.hops(scope)
            hop = hops.start(first, prefill, "/v1/completions")
            sent = hop.headers({"tracestate": "client=1", "authorization": "Bearer k"})
            assert sent["traceparent"].startswith(f"00-{trace_id}-") and "tracestate" not in sent
            assert sent["authorization"] == "Bearer k"
            if outcome == "retried":
                hop.failed(ConnectionRefusedError("refused"), retried=True)
                hops.start(second, prefill, "/v1/completions").answered(200)
                record.status, record.complete = 200, True
            else:
                hop.failed(TimeoutError("read timed out"))
                record.status, record.complete = 504, True
            traces.end(record, None)
        traces.shutdown()
        spans = receiver.wait_trace(trace_id, 5)
    servers = sorted((s for s in spans if s.kind == "server"), key=lambda s: s.start)
    assert [s.parent_id for s in servers] == [parent, parent]
    assert [s.status for s in servers] == ["unset", "error"]
    assert servers[1].attributes["error.type"] == "504"
    hops_of = {
        s.span_id: sorted((h for h in spans if h.parent_id == s.span_id), key=lambda h: h.start)
        for s in servers
    }
    refused, answered = hops_of[servers[0].span_id]
    assert refused.status == "error" and refused.attributes["ketch.hop.retried"] is True
    assert refused.attributes["error.type"] == "ConnectionRefusedError"
    assert refused.attributes["ketch.hop.attempt"] == 1
    assert refused.attributes["ketch.prefill.instance"] == prefill.url
    assert answered.attributes["ketch.hop.attempt"] == 2
    assert answered.attributes["server.address"] == "10.0.0.2"
    assert answered.attributes["http.response.status_code"] == 200
    assert answered.status == "unset" and answered.end <= servers[0].end
    (timed_out,) = hops_of[servers[1].span_id]
    assert timed_out.status == "error" and timed_out.attributes["ketch.hop.retried"] is False
