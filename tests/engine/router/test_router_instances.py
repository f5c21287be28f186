"""An instance that answers its health checks with junk must not take the router down: a
/metrics that is not Prometheus text leaves the load as it was, a /ready body that is not
readable JSON counts as no details, and a nonsense pd_comm_port is ignored.
"""

from __future__ import annotations

import httpx
import pytest
from router_harness import FakeInstance, running_router


@pytest.mark.timeout(60)
def test_junk_health_answers_neither_crash_nor_poison_the_router() -> None:
    junk_metrics, junk_ready = FakeInstance(), FakeInstance("prefill")
    decode = FakeInstance("decode")
    junk_metrics.metrics_text = 'x{a="b} 1\n{{{ not prometheus'
    nest = 100_000
    junk_ready.ready_body = b'{"ready": true, "x": ' + b"[" * nest + b"]" * nest + b"}"
    try:
        with running_router("--mixed", junk_metrics.url, "--health-interval", "0.2") as r:
            assert r.instances()[junk_metrics.url]["healthy"]
            reply = httpx.post(f"{r.url}/v1/completions", json={"prompt": "x"}, timeout=20)
            assert reply.status_code == 200
            assert "Traceback" not in r.log()
        with running_router("--prefill", junk_ready.url, "--decode", decode.url) as r:
            assert r.instances()[junk_ready.url]["healthy"]  # a 200 /ready with no details
        junk_ready.ready_body = b'{"ready": true, "role": "prefill", "pd_comm_port": true}'
        with running_router("--prefill", junk_ready.url, "--decode", decode.url,
                            "--pd-comm-port", "8123") as r:  # fmt: skip
            reply = httpx.post(f"{r.url}/v1/completions", json={"prompt": "x"}, timeout=20)
            assert reply.status_code == 200
            assert "Traceback" not in r.log()
        assert decode.requests[-1]["headers"]["x-ketch-prefill"] == "127.0.0.1:8123"
    finally:
        for fake in (junk_metrics, junk_ready, decode):
            fake.stop()
