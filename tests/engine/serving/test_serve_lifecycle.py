"""Disconnects, a dying engine and SIGTERM drains on real servers (acceptance 4, 5)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import httpx
import pytest
from serve_harness import metric, running_server, scrape, sse_events, wait_for

LONG = {
    "model": "tiny",
    "prompt": "Once upon a time",
    "max_tokens": 480,
    "ignore_eos": True,
    "temperature": 0,
    "stream": True,
}
GOOD = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}


def _idle(url: str):
    samples = scrape(url)
    free, total = metric(samples, "free_kv_block_num"), metric(samples, "max_kv_block_num")
    running = metric(samples, "num_requests_running")
    waiting = metric(samples, "num_requests_waiting")
    return samples if (free == total and total > 0 and running == 0 and waiting == 0) else None


def test_disconnect_mid_stream_frees_kv_blocks(server):
    # The KV gauges come from engine snapshots, sent only once the engine has done something.
    assert httpx.post(f"{server.url}/v1/completions", json=GOOD, timeout=30).status_code == 200
    wait_for(lambda: _idle(server.url), 30, "an idle server before the test")
    with (
        httpx.Client(base_url=server.url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json={**LONG, "n": 4}) as response,
    ):
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
        first = next(events)
        assert isinstance(first, dict) and first["choices"][0]["finish_reason"] is None
        busy = scrape(server.url)
        assert metric(busy, "free_kv_block_num") < metric(busy, "max_kv_block_num")
    # Leaving the block closed the connection after the first chunk.
    wait_for(lambda: _idle(server.url), 30, "all KV blocks free and nothing running")
    response = httpx.post(f"{server.url}/v1/completions", json=GOOD, timeout=30)
    assert response.status_code == 200


def _read_stream(url: str, body: dict, started: threading.Event, result: dict) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            result["status"] = response.status_code
            events = []
            for event in sse_events(response.iter_lines()):
                events.append(event)
                started.set()
            result["events"] = events
    except Exception as exc:  # reported by the test thread
        result["error"] = repr(exc)
    finally:
        started.set()


def _start_streams(
    url: str, count: int, body: dict = LONG
) -> tuple[list[threading.Thread], list[dict]]:
    threads, results = [], []
    for _ in range(count):
        started, result = threading.Event(), {}
        thread = threading.Thread(
            target=_read_stream, args=(url, body, started, result), daemon=True
        )
        thread.start()
        assert started.wait(60), "a stream never started"
        assert "error" not in result, result
        threads.append(thread)
        results.append(result)
    return threads, results


@pytest.mark.parametrize("victim", ["engine", "worker"])
def test_killed_process_makes_health_503_and_serve_exit_nonzero(victim):
    with running_server() as srv:
        threads, results = _start_streams(srv.url, 1)
        pid = srv.engine_pid() if victim == "engine" else srv.worker_pid()
        os.kill(pid, signal.SIGKILL)
        seen: list[int] = []

        def unhealthy() -> bool:
            try:
                seen.append(httpx.get(f"{srv.url}/health", timeout=5).status_code)
            except httpx.TransportError:
                return srv.proc.poll() is not None  # already gone: fine only after a 503
            return seen[-1] == 503

        wait_for(unhealthy, 15, "/health to turn 503", interval=0.02)
        assert 503 in seen, f"the server exited without /health answering 503: {seen}"
        assert srv.proc.wait(30) != 0, srv.log()
        # The open stream ended with an error instead of hanging.
        threads[0].join(30)
        assert not threads[0].is_alive()
        events = results[0].get("events", [])
        assert any(isinstance(e, dict) and "error" in e for e in events) or "error" in results[0]


def test_sigterm_drains_in_flight_refuses_new_and_exits_0():
    with running_server("--drain-timeout", "60") as srv:
        body = {**LONG, "stream_options": {"include_usage": True}}
        threads, results = _start_streams(srv.url, 3, body)
        srv.proc.send_signal(signal.SIGTERM)

        def ready_status() -> int | None:
            try:
                code = httpx.get(f"{srv.url}/ready", timeout=5).status_code
            except httpx.TransportError:
                return -1  # already exited: the streams below must still have completed
            return code if code != 200 else None

        status = wait_for(ready_status, 15, "/ready to turn 503 during the drain")
        assert status in (503, -1)
        if status == 503:
            with contextlib.suppress(httpx.TransportError):
                refused = httpx.post(f"{srv.url}/v1/completions", json=GOOD, timeout=10)
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["message"]
        assert srv.proc.wait(90) == 0, srv.log()
        for thread, result in zip(threads, results, strict=True):
            thread.join(30)
            assert not thread.is_alive()
            assert result.get("status") == 200, result
            events = result["events"]
            assert events[-1] == "[DONE]", events[-3:]
            chunks = [e for e in events if isinstance(e, dict)]
            assert not any("error" in e for e in chunks), chunks[-1]
            finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
            assert [f for f in finishes if f] == ["length"]
            assert chunks[-1]["usage"]["completion_tokens"] == LONG["max_tokens"]
