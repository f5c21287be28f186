"""Tracing through a prefill/decode pair: the router's hop goes to the decode instance naming
the prefill peer, and the decode instance's spans are that hop's children, in one trace."""

from __future__ import annotations

import secrets

import openai
import pytest
from otlp_receiver import receiving
from pd_harness import running_pods
from router_harness import running_router

pytestmark = pytest.mark.timeout(300)


def test_one_trace_through_the_router_and_the_decode_instance() -> None:
    with receiving() as receiver:
        traced = ("--otlp-traces-endpoint", receiver.grpc_url)
        with running_pods(("prefill", *traced), ("decode", *traced)) as (prefill, decode):
            args = ("--prefill", prefill.url, "--decode", decode.url, *traced)
            with running_router(*args, env={"OTEL_BSP_SCHEDULE_DELAY": "50"}) as router:
                client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
                trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
                got = client.completions.create(
                    model="tiny", prompt="Alice was beginning to get very tired", max_tokens=6,
                    temperature=0, extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"},
                )  # fmt: skip
                assert got.usage.completion_tokens == 6
                spans = receiver.wait_trace(trace_id, 6)
    by = {(s.service, s.kind, s.name): s for s in spans}
    server = by[("ketch-router", "server", "POST /v1/completions")]
    hop = by[("ketch-router", "client", "POST /v1/completions")]
    engine = by[("ketch-serve", "server", "text_completion tiny")]
    assert server.parent_id == parent and hop.parent_id == server.span_id
    assert engine.parent_id == hop.span_id
    assert hop.attributes["ketch.instance.role"] == "decode"
    assert hop.attributes["url.full"] == f"{decode.url}/v1/completions"
    assert hop.attributes["ketch.prefill.instance"] == prefill.url
    assert engine.attributes["ketch.prefill.peer"]
    assert engine.attributes["gen_ai.usage.output_tokens"] == 6
    assert engine.attributes["ketch.latency.kv_handover"] >= 0
    phases = [
        by[("ketch-serve", "internal", f"engine.{p}")] for p in ("queue", "prefill", "decode")
    ]
    assert all(p.parent_id == engine.span_id for p in phases)
    assert hop.start <= engine.start <= phases[0].start <= phases[-1].end <= engine.end <= hop.end
