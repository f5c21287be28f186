"""What the router takes from a client before forwarding: a body of at most
--max-request-bytes (refused by its Content-Length before it is read, or as soon as a chunked
body grows past the limit), sent within --body-timeout seconds. Raw sockets, because no
well-behaved client lies about its length or sends a byte a second.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from router_harness import FakeInstance, raw_exchange, running_router

LIMIT = 4096


def head(port: int, extra: str) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\n{extra}\r\n"
    ).encode()


def assert_openai_error(body: dict, status: int, *words: str) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert error["code"] == status and error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], (word, error)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeInstance]:
    instance = FakeInstance()
    yield instance
    instance.stop()


@pytest.mark.timeout(60)
def test_bodies_over_the_limit_are_refused_413_and_never_forwarded(fake: FakeInstance) -> None:
    with running_router("--mixed", fake.url, "--max-request-bytes", str(LIMIT)) as r:
        # A declared length over the limit: answered before one byte of the body is sent.
        answer = raw_exchange(r.port, head(r.port, f"Content-Length: {10 * LIMIT}\r\n"))
        assert answer.status == 413
        assert_openai_error(answer.json(), 413, str(LIMIT), "--max-request-bytes")

        # A chunked body with no length: cut once it grows past the limit, not read to its end.
        piece = b"400\r\n" + b"x" * 0x400 + b"\r\n"
        pieces = (piece for _ in range(10_000))  # 10 MiB if it were all read
        answer = raw_exchange(r.port, head(r.port, "Transfer-Encoding: chunked\r\n"), pieces)
        assert answer.status == 413
        assert_openai_error(answer.json(), 413, str(LIMIT))

        reply = httpx.post(f"{r.url}/v1/completions", content=b"y" * (LIMIT + 1), timeout=20)
        assert reply.status_code == 413

        body = b'{"prompt": "' + b"z" * (LIMIT - 20) + b'"}'  # just under: forwarded unchanged
        reply = httpx.post(f"{r.url}/v1/completions", content=body, timeout=20)
        assert reply.status_code == 200
        assert fake.requests[-1]["raw"] == body
        assert len(fake.requests) == 1
        assert httpx.get(f"{r.url}/health", timeout=5).status_code == 200


@pytest.mark.timeout(60)
def test_a_slow_sender_gets_408(fake: FakeInstance) -> None:
    before = len(fake.requests)
    with running_router("--mixed", fake.url, "--body-timeout", "1") as r:
        started = time.monotonic()
        pieces = (b"{" if i == 0 else time.sleep(0.5) or b" " for i in range(40))  # 20 s
        answer = raw_exchange(r.port, head(r.port, "Content-Length: 100\r\n"), pieces)
        took = time.monotonic() - started
        assert answer.status == 408, answer
        assert_openai_error(answer.json(), 408, "--body-timeout")
        assert took < 5, took
        reply = httpx.post(f"{r.url}/v1/completions", json={"prompt": "x"}, timeout=20)
        assert reply.status_code == 200
    assert len(fake.requests) == before + 1
