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
