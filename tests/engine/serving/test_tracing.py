"""OpenTelemetry traces of ``ketch serve`` (--otlp-traces-endpoint), against a real OTLP
receiver in this process (``otlp_receiver``) and real ``ketch serve --model tiny`` processes,
driven by the ``openai`` client with W3C ``traceparent`` headers."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from otlp_receiver import Got, receiving
from serve_harness import running_server

from ketch.engine.router.config import RouterConfig
from ketch.engine.serving.config import ServerConfig
from ketch.engine.tracing import check_endpoint, exporter_protocol, service_name
from ketch.operator.crd.engine_fields import OTLP_ENDPOINT_PATTERN

ROOT = Path(__file__).resolve().parents[3]
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # the batch processor's delay, ms


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


@pytest.mark.parametrize(
    "good",
    [
        "http://127.0.0.1:4317",
        "https://collector.monitoring.svc:4317",
        "collector:4317",
        "http://otel:4318/v1/traces",
        "http://[::1]:4317",
    ],
)
def test_endpoint_accepted(good: str) -> None:
    check_endpoint(good)
    assert re.match(OTLP_ENDPOINT_PATTERN, good)  # the CRD's field takes it too
    assert ServerConfig(otlp_traces_endpoint=good).otlp_traces_endpoint == good
    assert RouterConfig(mixed="a:1", otlp_traces_endpoint=good).otlp_traces_endpoint == good


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "collector",  # no port, no scheme
        "grpc://collector:4317",
        "ftp://collector:21",
        "http://",
        "http://collector:99999",
        "http://collector:port",
        "collector:4317/path",
        "http://user:pw@collector:4317",
        "http://collector:4317/?q=1",
        "http://col lector:4317",
        "http://collécteur:4317",
        "http://c:1\n",
        "http://" + "a" * 5000 + ":1",
        4317,
        ["http://c:1"],
        {"url": "http://c:1"},
        True,
    ],
)
def test_endpoint_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        check_endpoint(bad)
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        ServerConfig(otlp_traces_endpoint=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        RouterConfig(mixed="a:1", otlp_traces_endpoint=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad", ["collector", "grpc://c:4317", "http://", "c:4317/path", "http://u@c:1", "http://c :1"]
)
def test_crd_pattern_refuses_the_obvious_mistakes(bad: str) -> None:
    assert not re.match(OTLP_ENDPOINT_PATTERN, bad)


def test_protocol_and_service_from_the_environment() -> None:
    assert exporter_protocol({}) == "grpc"
    assert exporter_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == "http/protobuf"
    both = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    both["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "grpc"
    assert exporter_protocol(both) == "grpc"  # the signal's own variable wins
    for bad in ("http/json", "thrift", "x" * 10_000):
        with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
            exporter_protocol({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": bad})
    assert service_name("ketch-serve", {}) == "ketch-serve"
    assert service_name("ketch-serve", {"OTEL_SERVICE_NAME": " chat-prod "}) == "chat-prod"


def test_help_and_bad_flag() -> None:
    ketch = [sys.executable, "-m", "ketch.engine.cli"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for command in ("serve", "router"):
        shown = subprocess.run([*ketch, command, "--help"], capture_output=True, text=True, env=env)
        assert "--otlp-traces-endpoint" in shown.stdout
        assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" in " ".join(shown.stdout.split())
    bad = subprocess.run(
        [*ketch, "serve", "--model", "tiny", "--otlp-traces-endpoint", "grpc://x:1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode != 0
    assert "otlp_traces_endpoint must be http(s)://host:port" in bad.stderr + bad.stdout


def test_nothing_of_the_sdk_is_loaded_without_the_flag() -> None:
    """The serving and routing paths, their configs built from flags without
    --otlp-traces-endpoint: no OpenTelemetry SDK, exporter, gRPC or tracing module is loaded.
    (FastAPI itself imports the OpenTelemetry *API* for its own, unconfigured, telemetry.)"""
    code = """
import sys
from ketch.engine.cli import build_parser
from ketch.engine.serving import serve
from ketch.engine.router import cli as router_cli
from ketch.engine.serving.api_server import create_app
from ketch.engine.router.app import RouterState, create_app as router_app
from ketch.engine import engine_process, llm_engine
from ketch.engine.cli_args import config_from_args
from ketch.engine.serving.config import ServerConfig
args = build_parser().parse_args(["serve", "--model", "tiny"])
assert config_from_args(ServerConfig, args, {}).otlp_traces_endpoint is None
router_app(RouterState.from_config(router_cli.config_from(
    build_parser().parse_args(["router", "--mixed", "127.0.0.1:1"]), {})))
unwanted = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto", "grpc",
            "ketch.engine.tracing_otel", "ketch.engine.serving.trace_spans")
bad = [m for m in sys.modules if m.startswith(unwanted)]
print(bad)
assert not bad, bad
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


def by_name(spans: list[Got]) -> dict[str, list[Got]]:
    out: dict[str, list[Got]] = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


def check_engine_tree(spans: list[Got], parent_id: str, operation: str, outputs: int) -> Got:
    """The engine's server span under ``parent_id`` and its three phases, in order."""
    names = by_name(spans)
    (server,) = names[f"{operation} tiny"]
    assert server.kind == "server" and server.service == "ketch-serve"
    assert server.parent_id == parent_id
    a = server.attributes
    assert a["gen_ai.operation.name"] == operation
    assert a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.usage.output_tokens"] == outputs
    assert a["gen_ai.usage.input_tokens"] > 0
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["http.response.status_code"] == 200
    assert a["gen_ai.request.id"].startswith("req-")
    assert a["gen_ai.latency.e2e"] >= a["gen_ai.latency.time_to_first_token"] >= 0
    assert server.status == "unset"
    phases = [names[n][0] for n in ("engine.queue", "engine.prefill", "engine.decode")]
    for phase in phases:
        assert phase.parent_id == server.span_id and phase.kind == "internal"
        assert phase.attributes["gen_ai.request.id"] == a["gen_ai.request.id"]
    queue, prefill, decode = phases
    assert server.start <= queue.start <= queue.end == prefill.start <= prefill.end
    assert prefill.end == decode.start <= decode.end <= server.end
    assert decode.attributes["gen_ai.usage.output_tokens"] == outputs
    return server


def test_spans_of_requests_with_and_without_a_parent() -> None:
    with receiving() as receiver:
        env = {**FAST_EXPORT}
        with running_server("--otlp-traces-endpoint", receiver.grpc_url, env=env) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            header, trace_id, client_span = traceparent()
            state = "vendor=opaque,other=1"
            done = client.completions.create(
                model="tiny", prompt="Alice was", max_tokens=5, temperature=0,
                extra_headers={"traceparent": header, "tracestate": state},
            )  # fmt: skip
            assert done.usage.completion_tokens == 5
            spans = receiver.wait_trace(trace_id, 4)
            check_engine_tree(spans, client_span, "text_completion", 5)

            # Streamed chat: the span ends with the stream, usage counted from its deltas.
            header, chat_trace, chat_parent = traceparent()
            stream = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                stream=True, extra_headers={"traceparent": header},
            )  # fmt: skip
            assert len([c for c in stream if c.choices and c.choices[0].delta.content]) >= 1
            spans = receiver.wait_trace(chat_trace, 4)
            check_engine_tree(spans, chat_parent, "chat", 4)

            # Bad traceparents are ignored: each request starts a trace of its own.
            bad_headers = [
                "garbage",
                "00-" + "0" * 32 + "-" + "1" * 16 + "-01",  # an all-zero trace id
                "ff-" + "a" * 32 + "-" + "b" * 16 + "-01",  # version ff is invalid
                "00-" + "a" * 32 + "-" + "b" * 16 + "-01-extra",  # version 00 has no more
                "00-" + "a" * 5000,  # huge
                "00-" + "g" * 32 + "-" + "b" * 16 + "-01",  # not hex
            ]
            before = {s.trace_id for s in receiver.spans}
            for bad in bad_headers:
                got = client.completions.create(
                    model="tiny", prompt="x", max_tokens=2,
                    extra_headers={"traceparent": bad, "tracestate": "k=" + "v" * 9000},
                )  # fmt: skip
                assert got.usage.completion_tokens == 2

            def new_roots(spans: list[Got]) -> list[Got]:
                return [
                    s for s in spans
                    if s.name == "text_completion tiny" and s.trace_id not in before
                ]  # fmt: skip

            roots = receiver.wait_for(
                lambda s: len(new_roots(s)) >= len(bad_headers) and new_roots(s)
            )
            assert len(roots) == len(bad_headers)
            assert all(r.parent_id == "" for r in roots)
            assert len({r.trace_id for r in roots}) == len(bad_headers)
            assert "a" * 32 not in {r.trace_id for r in roots}

            # A refused request: its span says 400 (a client error: status left unset).
            header, bad_trace, _ = traceparent()
            with pytest.raises(openai.BadRequestError):
                client.completions.create(
                    model="tiny", prompt="x", max_tokens=-1, extra_headers={"traceparent": header}
                )
            (refused,) = receiver.wait_trace(bad_trace, 1)
            assert refused.attributes["http.response.status_code"] == 400
            assert refused.status == "unset"

            # A client that goes away mid-stream: the request's span is an error.
            header, gone_trace, _ = traceparent()
            body = {"model": "tiny", "prompt": "x", "max_tokens": 400, "stream": True}
            headers = {"traceparent": header}
            with httpx.stream(
                "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60
            ) as response:
                next(response.iter_lines())
            spans = receiver.wait_trace(gone_trace, 1)
            (gone,) = [s for s in spans if s.kind == "server"]
            assert gone.status == "error", gone
            assert "Traceback" not in server.log()


def test_a_dead_collector_never_fails_serving() -> None:
    from procs import free_ports

    (closed,) = free_ports(1)  # nothing listens there
    env = {**FAST_EXPORT, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1"}
    with running_server("--otlp-traces-endpoint", f"http://127.0.0.1:{closed}", env=env) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        for i in range(6):
            header, _, _ = traceparent()
            got = client.completions.create(
                model="tiny", prompt=f"number {i}", max_tokens=3,
                extra_headers={"traceparent": header},
            )  # fmt: skip
            assert got.usage.completion_tokens == 3
        import time

        deadline = time.monotonic() + 30
        while "could not export" not in server.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        for _ in range(3):  # more exports fail meanwhile; the warning stays single
            got = client.completions.create(model="tiny", prompt="more", max_tokens=2)
            time.sleep(0.5)
        log = server.log_path.read_text(errors="replace")
        assert log.count("could not export") == 1, log
        assert "Traceback" not in log
