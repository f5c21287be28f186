"""Hostile and broken input against real instances: each bad input gets a clear error for its
sender alone, and afterwards the instance is healthy, serves ``LLM.generate``'s exact output and
has every KV block back.

Regressions of the hardening issue's findings 1, 2, 5 and 6, and bounded, seeded fuzzing of the
HTTP API and the pd-comm port (a few hundred cases each).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import time

import httpx
import pytest
import zmq
from hostile import EXTREMES, frames
from serve_harness import (
    GOOD,
    Server,
    assert_exact_and_idle,
    running_server,
    wait_for,
)

from ketch.engine.disagg import messages as pd

# ---- finding 1: one request must not kill the instance ----


@pytest.mark.parametrize(
    "field, value",
    [
        ("stop_token_ids", [99999999999999999999999]),
        ("stop_token_ids", [2**63]),
        ("stop_token_ids", [10**6]),  # an int64, but outside the model's vocabulary
        ("prompt", [[5, 10**6]]),
        ("prompt", [[5, -1]]),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
    ],
)
def test_out_of_range_values_are_400_and_the_instance_serves_on(
    server, reference_llm, field: str, value
) -> None:
    response = httpx.post(f"{server.url}/v1/completions", json={**GOOD, field: value}, timeout=30)
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"] + str(response.json()["error"]["param"])
    assert server.proc.poll() is None
    assert_exact_and_idle(server.url, reference_llm)


# ---- finding 5: bounded fan-out and per-token work ----


@pytest.mark.parametrize(
    "body, word",
    [
        ({"prompt": ["a"] * 129}, "sequences"),
        ({"prompt": ["a"] * 17, "n": 8}, "sequences"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop strings"),
        ({"stop": ["x" * 257]}, "characters"),
        ({"stop_token_ids": list(range(257))}, "stop token ids"),
    ],
)
def test_fan_out_and_stop_lists_are_capped(server, body: dict, word: str) -> None:
    response = httpx.post(f"{server.url}/v1/completions", json={**GOOD, **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert word in response.json()["error"]["message"]


def test_sequences_count_against_max_concurrency_and_bursts_cannot_pass() -> None:
    with running_server("--max-concurrency", "4") as srv:
        big = httpx.post(f"{srv.url}/v1/completions", json={**GOOD, "n": 5}, timeout=30)
        assert big.status_code == 400 and "max-concurrency" in big.json()["error"]["message"]

        async def burst() -> list[int]:
            body = {**GOOD, "max_tokens": 64, "n": 2, "ignore_eos": True}
            async with httpx.AsyncClient(timeout=60) as client:
                answers = await asyncio.gather(
                    *(client.post(f"{srv.url}/v1/completions", json=body) for _ in range(12))
                )
            return [a.status_code for a in answers]

        codes = asyncio.run(burst())
        assert set(codes) <= {200, 429}, codes
        assert 429 in codes and codes.count(200) >= 1, codes


def test_slow_senders_are_counted_and_cut_after_the_read_timeout() -> None:
    args = ("--max-concurrency", "1", "--request-read-timeout", "2")
    with running_server(*args) as srv:
        host, port = "127.0.0.1", srv.port
        slow = socket.create_connection((host, port))
        slow.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{"
        )
        try:
            time.sleep(0.5)  # the slow request holds the only slot while its body trickles in
            busy = httpx.post(f"{srv.url}/v1/completions", json=GOOD, timeout=30)
            assert busy.status_code == 429, busy.text
            slow.settimeout(10)
            answer = slow.recv(4096)
            assert b" 408 " in answer.split(b"\r\n")[0], answer[:200]
        finally:
            slow.close()
        wait_for(
            lambda: (
                httpx.post(f"{srv.url}/v1/completions", json=GOOD, timeout=30).status_code == 200
            ),
            10,
            "the slot to be released",
        )


# ---- finding 6: credentials and control endpoints ----


def test_non_ascii_credentials_are_401_not_500(tmp_path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-secret")
    with running_server("--api-key-file", str(key)) as srv:
        for header in ("Bearer sk-sécret", "Bearer \u00ff\u00fe", "Basic Zm9v", "Bearer"):
            r = httpx.post(
                f"{srv.url}/v1/completions",
                json=GOOD,
                headers={"Authorization": header.encode("latin-1")},
            )
            assert r.status_code == 401, (header, r.text)
        body = json.dumps(GOOD).encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as raw:  # UTF-8 bytes
            raw.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + "ключ".encode() + b"\r\nConnection: close\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            assert b" 401 " in raw.recv(4096).split(b"\r\n")[0]
        assert srv.proc.poll() is None


def test_pause_needs_the_admin_key_when_one_is_set(tmp_path) -> None:
    admin = tmp_path / "admin"
    admin.write_text("admin-secret")
    with running_server("--admin-key-file", str(admin)) as srv:
        assert httpx.post(f"{srv.url}/pause").status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.post(f"{srv.url}/pause", headers=wrong).status_code == 401
        good = {"Authorization": "Bearer admin-secret"}
        assert httpx.post(f"{srv.url}/pause", headers=good).status_code == 200
        assert httpx.get(f"{srv.url}/ready").status_code == 503
        assert httpx.post(f"{srv.url}/resume", headers=good).status_code == 200
        assert httpx.get(f"{srv.url}/ready").status_code == 200


def test_pause_never_trusts_loopback_and_needs_the_run_dirs_admin_key() -> None:
    """Review M3: without --admin-key-file, /pause used to answer any loopback client — and
    behind a same-pod proxy (an Istio sidecar connects from 127.0.0.6; nginx or oauth2-proxy from
    127.0.0.1, and uvicorn then honours X-Forwarded-For: 127.0.0.1) every client is loopback.
    Now it always needs an admin key: the one ketch serve wrote into its private run directory
    (0600 in a 0700 directory: this user, or kubectl exec, can read it)."""
    with running_server() as srv:
        for headers in ({}, {"X-Forwarded-For": "127.0.0.1"}, {"Authorization": "Bearer x"}):
            refused = httpx.post(f"{srv.url}/pause", headers=headers)
            assert refused.status_code == 401, (headers, refused.text)
            assert "admin key" in refused.json()["error"]["message"]
        assert httpx.get(f"{srv.url}/ready").status_code == 200
        from ketch.engine import rundir

        key_file = rundir.run_dir() / f"admin-key-{srv.port}"
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        good = {"Authorization": f"Bearer {srv.admin_key()}"}
        assert httpx.post(f"{srv.url}/pause", headers=good).status_code == 200
        assert httpx.get(f"{srv.url}/ready").status_code == 503
        assert httpx.post(f"{srv.url}/resume", headers=good).status_code == 200


def test_control_access_needs_the_key_from_any_address() -> None:
    from ketch.engine.serving.admission import check_control_access
    from ketch.engine.serving.protocol import ProtocolError

    for header, key in (("", None), ("Bearer x", None), ("", "admin"), ("Bearer x", "admin")):
        with pytest.raises(ProtocolError) as refused:
            check_control_access("/pause", header, key)
        assert refused.value.status_code == 401
    check_control_access("/pause", "Bearer admin", "admin")


# ---- fuzzing the HTTP API ----

_FIELDS = [
    "model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stop",
    "stop_token_ids", "seed", "stream", "stream_options", "logprobs", "top_logprobs",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
    "echo", "logit_bias", "user", "min_p",
]  # fmt: skip


def _hostile_bodies(seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    bodies = []
    for _ in range(count):
        body = dict(GOOD)
        for name in rng.sample(_FIELDS, rng.randint(1, 4)):
            body[name] = rng.choice(EXTREMES)
        shape = rng.random()
        if shape < 0.8:
            try:
                bodies.append(json.dumps(body).encode())
            except (ValueError, UnicodeEncodeError):
                bodies.append(b"\xff\xfe")
        elif shape < 0.9:
            bodies.append(b"[" * 100_000)
        else:
            bodies.append(rng.randbytes(rng.choice([0, 5, 2000])))
    return bodies


def test_fuzzed_bodies_get_4xx_and_leave_the_instance_exact(server, reference_llm) -> None:
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for i, body in enumerate(_hostile_bodies(seed=13, count=300)):
            path = "/v1/chat/completions" if i % 3 == 0 else "/v1/completions"
            r = client.post(path, content=body, headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (body[:200], r.text[:300])
            if r.status_code >= 400:
                assert r.json()["error"]["message"]
    assert statuses.get(400, 0) > 100, statuses
    assert_exact_and_idle(server.url, reference_llm)


# ---- finding 2 and fuzzing pd-comm ----


def test_pd_comm_survives_hostile_frames(reference_llm) -> None:
    kinds = [pd.PrefillRequest, pd.PrefillDone, pd.PrefillFailed, pd.AbortPrefill, pd.PdPing]
    server = Server("--role", "decode")
    context = zmq.Context()
    try:
        server.wait_ready()
        attacker = context.socket(zmq.DEALER)
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.connect(f"tcp://127.0.0.1:{server.pd_port}")
        # The frame that killed a decode engine: two frames from one DEALER.
        attacker.send_multipart([b"{}", pd.encode(pd.PdPing(["r"]))])
        for message in frames(kinds, seed=2, count=300):
            attacker.send_multipart(message)
        ping = context.socket(zmq.DEALER)
        ping.setsockopt(zmq.LINGER, 0)
        ping.connect(f"tcp://127.0.0.1:{server.pd_port}")
        ping.send(pd.encode(pd.PdPing(["nobody"])))
        assert ping.poll(30_000), f"no PdPong after the hostile frames:\n{server.log()}"
        assert pd.decode(ping.recv()) == pd.PdPong(["nobody"])
        assert server.proc.poll() is None, server.log()
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert "refused a message" in server.log()
    finally:
        context.destroy(linger=0)
        server.stop()


def test_a_pd_comm_flood_is_logged_at_most_once_a_minute_per_peer() -> None:
    from ketch.engine.wire import BadMessages

    seen: list[str] = []
    handler = _ListHandler(seen)
    logging.getLogger("ketch.engine.wire").addHandler(handler)
    try:
        bad = BadMessages("test")
        for _ in range(1000):
            bad.note("peer-a", "garbage")
        bad.note("peer-b", "garbage")
        for i in range(5000):
            bad.note(f"peer-{i}", "garbage")  # a flood of distinct ids: bounded memory
    finally:
        logging.getLogger("ketch.engine.wire").removeHandler(handler)
    assert bad.total == 6001 and bad.by_peer["peer-a"] == 1000
    assert len(bad.by_peer) <= BadMessages.MAX_PEERS + 1
    assert sum("peer-a" in line for line in seen) == 1


class _ListHandler(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())
