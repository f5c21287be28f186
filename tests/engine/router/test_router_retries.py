"""When the router tries another instance, and when it must not: a request is carried to a
second instance only if nothing of it reached the first (the connection was refused); once an
instance took the work, its answer or its failure is the client's answer. A slow answer is no
reason to take a healthy instance out of rotation.
"""

from __future__ import annotations

import time

import httpx
import pytest
from router_harness import FakeInstance, running_router

# No health polls after the first: only what the requests do can change an instance's state.
QUIET = ("--policy", "round-robin", "--health-interval", "300")


def two_instances(answer: str) -> list[FakeInstance]:
    """Two instances that both misbehave alike: whichever the router picks first, a second
    request reaching either shows a retry."""
    fakes = [FakeInstance(), FakeInstance()]
    for fake in fakes:
        fake.answer = answer
    return fakes


@pytest.mark.timeout(60)
def test_a_503_is_relayed_with_its_body_not_retried() -> None:
    fakes = two_instances("503")
    try:
        with running_router("--mixed", ",".join(f.url for f in fakes), *QUIET) as r:
            reply = httpx.post(f"{r.url}/v1/completions", json={"prompt": "x"}, timeout=20)
            assert reply.status_code == 503
            assert reply.json()["error"]["message"] == "engine overloaded"  # the instance's own
            assert reply.headers["retry-after"] == "7"
            assert sum(len(f.requests) for f in fakes) == 1  # not carried to the other
            # A refusal is an answer, not an outage.
            assert all(i["healthy"] for i in r.instances().values())
    finally:
        for fake in fakes:
            fake.stop()


@pytest.mark.timeout(60)
def test_an_instance_dying_on_a_request_does_not_get_it_carried_to_another() -> None:
    fakes = two_instances("hangup")
    try:
        with running_router("--mixed", ",".join(f.url for f in fakes), *QUIET) as r:
            reply = httpx.post(f"{r.url}/v1/completions", json={"prompt": "x"}, timeout=20)
            assert reply.status_code == 502
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert "not retried" in error["message"]
            (hit,) = [f for f in fakes if f.requests]  # the other one never saw it
            assert len(hit.requests) == 1
            assert hit.url not in error["message"] and hit.url in r.log()  # review L1
            # Only health checks and refused connections take an instance out of rotation.
            assert all(i["healthy"] for i in r.instances().values())
    finally:
        for fake in fakes:
            fake.stop()


@pytest.mark.timeout(60)
def test_a_request_timeout_leaves_a_healthy_instance_in_rotation() -> None:
    fake = FakeInstance()
    fake.answer = "slow"
    try:
        with running_router("--mixed", fake.url, *QUIET, "--request-timeout", "1") as r:
            started = time.monotonic()
            reply = httpx.post(f"{r.url}/v1/completions", json={"prompt": "x"}, timeout=20)
            assert reply.status_code == 504, reply.text
            assert "--request-timeout" in reply.json()["error"]["message"]
            assert time.monotonic() - started < FakeInstance.SLOW_S
            assert len(fake.requests) == 1  # tried once, not again elsewhere or here
            assert r.instances()[fake.url]["healthy"]
            fake.answer = "ok"
            reply = httpx.post(f"{r.url}/v1/completions", json={"prompt": "y"}, timeout=20)
            assert reply.status_code == 200
    finally:
        fake.stop()
