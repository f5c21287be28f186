"""The `openai` client through a real `ketch router` in front of real `ketch serve` instances."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from router_harness import TOKEN_ENV, Router, running_router
from serve_harness import Server, free_ports, wait_for


@pytest.fixture(scope="module")
def router(instances: list[Server]) -> Iterator[Router]:
    mixed = ",".join(f"127.0.0.1:{s.port}" for s in instances)
    with running_router("--mixed", mixed, "--policy", "round-robin", "--health-interval", "0.2",
                        "--health-timeout", "0.5") as r:  # fmt: skip
        wait_for(lambda: all(i["healthy"] for i in r.instances().values()), 20, "healthy")
        yield r


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)


@pytest.mark.timeout(120)
def test_results_match_a_direct_instance(router: Router, instances: list[Server]) -> None:
    via, direct = client(router.url), client(instances[0].url)
    kwargs = {"model": "tiny", "prompt": "Alice was", "max_tokens": 5, "temperature": 0}
    a, b = via.completions.create(**kwargs), direct.completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage == b.usage

    many = via.completions.create(**{**kwargs, "n": 3})
    assert sorted(c.index for c in many.choices) == [0, 1, 2]

    messages = [{"role": "user", "content": "Hello there"}]
    chat_a = via.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    chat_b = direct.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    assert chat_a.choices[0].message.content == chat_b.choices[0].message.content

    stream = via.completions.create(**kwargs, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == a.choices[0].text

    chat_stream = via.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices)
    assert text == chat_a.choices[0].message.content

    assert [m.id for m in via.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError):  # the instance's own error passes through
        via.completions.create(**{**kwargs, "model": "no-such-model"})


@pytest.mark.timeout(60)
def test_round_robin_spreads_over_every_instance(router: Router, instances: list[Server]) -> None:
    before = router.request_counts()
    c = client(router.url)
    for i in range(9):
        c.completions.create(model="tiny", prompt=f"request {i}", max_tokens=2)
    after = router.request_counts()
    sent = {s.url: after.get(s.url, 0) - before.get(s.url, 0) for s in instances}
    assert sent == {s.url: 3 for s in instances}
    assert httpx.get(f"{router.url}/ready", timeout=5).status_code == 200
    metrics = httpx.get(f"{router.url}/metrics", timeout=5).text
    assert 'ketch_router_instances{role="mixed",state="healthy"} 3.0' in metrics
    assert "ketch_router_request_seconds_count" in metrics


@pytest.mark.timeout(60)
def test_unhealthy_instance_is_skipped_and_comes_back(
    router: Router, instances: list[Server]
) -> None:
    paused = instances[2]
    os.kill(paused.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: not router.instances()[paused.url]["healthy"], 20, "marked unhealthy")
        assert router.instances()[paused.url]["last_error"]
        before = router.request_counts()
        c = client(router.url)
        for i in range(4):
            c.completions.create(model="tiny", prompt=f"skip {i}", max_tokens=2)
        after = router.request_counts()
        assert after.get(paused.url, 0) == before.get(paused.url, 0)
    finally:
        os.kill(paused.proc.pid, signal.SIGCONT)
    wait_for(lambda: router.instances()[paused.url]["healthy"], 20, "back in rotation")


@pytest.mark.timeout(60)
def test_dns_name_entries_resolve_to_instances(instances: list[Server]) -> None:
    port = instances[0].port
    with running_router("--mixed", "localhost", "--engine-port", str(port)) as r:
        wait_for(lambda: r.instances(), 10, "a resolved instance")
        urls = set(r.instances())
        assert f"http://127.0.0.1:{port}" in urls
        assert all(i["source"] == "dns:localhost" for i in r.instances().values())
        wait_for(lambda: any(i["healthy"] for i in r.instances().values()), 10, "healthy")
        out = client(r.url).completions.create(model="tiny", prompt="dns", max_tokens=2)
        assert out.choices[0].text


@pytest.mark.timeout(60)
def test_registration_heartbeat_and_expiry(instances: list[Server]) -> None:
    with running_router("--registration-only", "--registration-ttl", "1.0",
                        "--health-interval", "0.2", env={TOKEN_ENV: "t0ken"}) as r:  # fmt: skip
        assert httpx.get(f"{r.url}/ready", timeout=5).status_code == 503
        reply = httpx.post(f"{r.url}/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert reply.status_code == 503 and reply.headers["retry-after"]
        assert "no healthy instance" in reply.json()["error"]["message"]

        register = f"{r.url}/v1/ketch/register"
        auth = {"Authorization": "Bearer t0ken"}
        url = instances[1].url
        reply = httpx.post(register, json={"url": url, "role": "mixed"}, headers=auth)
        assert reply.status_code == 200
        wait_for(lambda: r.instances().get(url, {}).get("healthy"), 10, "registered, healthy")
        out = client(r.url).completions.create(model="tiny", prompt="registered", max_tokens=2)
        assert out.choices[0].text
        for _ in range(4):  # heartbeats keep it for longer than the TTL
            httpx.post(register, json={"url": url, "role": "mixed"}, headers=auth)
            assert url in r.instances()
            time.sleep(0.4)
        wait_for(lambda: url not in r.instances(), 10, "expiry after the heartbeats stop")

        bad = httpx.post(register, json={"role": "mixed"}, headers=auth)
        assert bad.status_code == 400 and "url" in bad.json()["error"]["message"]
        chef = httpx.post(register, json={"url": url, "role": "chef"}, headers=auth)
        assert chef.status_code == 400
        httpx.post(register, json={"url": url, "role": "mixed"}, headers=auth)
        assert url in r.instances()
        removed = httpx.request("DELETE", register, json={"url": url}, headers=auth)
        assert removed.json() == {"removed": True}
        assert url not in r.instances()


@pytest.mark.timeout(60)
def test_no_healthy_instance_is_a_clear_503() -> None:
    (dead,) = free_ports(1)
    with running_router("--mixed", f"127.0.0.1:{dead}") as r:
        reply = httpx.post(f"{r.url}/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert reply.status_code == 503
        assert reply.headers["retry-after"] == "1"
        message = reply.json()["error"]["message"]
        assert "no healthy instance" in message and str(dead) not in message  # review L1
        with pytest.raises(openai.InternalServerError):
            client(r.url).completions.create(model="tiny", prompt="x", max_tokens=1)
        ready = httpx.get(f"{r.url}/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["problems"]
        assert httpx.get(f"{r.url}/v1/models", timeout=5).status_code == 503
        # Registration is opt-in: nobody can add a backend to this router.
        body = {"url": f"http://127.0.0.1:{dead}", "role": "mixed"}
        refused = httpx.post(f"{r.url}/v1/ketch/register", json=body, timeout=5)
        assert refused.status_code == 403 and "--registration" in refused.text
        assert r.stop() == 0  # SIGTERM: a clean exit
