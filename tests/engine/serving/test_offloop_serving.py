"""Nothing slow runs on the API server's event loop (security review H1, M6, L8; issue 28), against
real ``ketch serve`` processes.

While a hostile request is in flight — a ~98 KB GBNF grammar of 3,000 chained rules (13 s of
quadratic conversion on the loop before), 1 MiB bodies (a prompt, a JSON schema, a chat), a
large invalid schema — ``/health``, ``/ready`` and ``/metrics`` are polled all along and every
answer must come within 100 ms (the liveness probe's budget is what kept the pod alive); the
hostile request gets a clear 400 and a bystander's completion is served. Also: refusals are
remembered (a resend costs no work), deep nesting is a 400 and not a 500, /tokenize and
/detokenize take an admission slot and honour pause, and ``cached_tokens`` is reported only
with ``--enable-prompt-tokens-details``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from serve_harness import Server, metric, running_server, scrape

PROBES = ("/health", "/ready", "/metrics")
PROBE_BUDGET_S = 0.1  # the bound for every probe answer while hostile work runs
BYSTANDER = {"model": "tiny", "prompt": "The Mouse", "max_tokens": 4, "temperature": 0}
MIB = 1 << 20
TEXT = "Alice was beginning to get very tired of sitting by her sister on the bank. "


def chained_gbnf(rules: int = 3000) -> str:
    """The review's grammar: each rule refers to the next (quadratic for gbnf_to_lark)."""
    lines = ["root ::= r0"]
    lines += [f'r{i} ::= "a{i}" | "b{i}" r{i + 1}' for i in range(rules)]
    lines.append(f'r{rules} ::= "z"')
    return "\n".join(lines) + "\n"


PROBE_SCRIPT = r"""
import contextlib, json, os, sys, threading, time
import httpx
with contextlib.suppress(OSError):
    os.nice(-5)  # as root: the measuring client is not starved by the machine's other work
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
samples = []
with httpx.Client(base_url=sys.argv[1], timeout=30) as client:
    while not stop.is_set():
        for path in sys.argv[2:]:
            start = time.monotonic()
            status = client.get(path).status_code
            samples.append((path, status, time.monotonic() - start))
        if len(samples) == len(sys.argv[2:]):
            print("polling", flush=True)
        time.sleep(0.01)
print(json.dumps(samples), flush=True)
"""


class Probes:
    """Polls /health, /ready and /metrics one after another until stopped, and keeps every
    answer's status and latency (time.monotonic around the whole request). The poller is a
    process of its own, so the test's own threads (sending megabytes) cannot delay it, and,
    where it may (root), at a higher priority than the rest of the machine's work: what it
    measures is the server's answer, not its own turn for a CPU."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[tuple[str, int, float]] = []
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> Probes:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", PROBE_SCRIPT, self.url, *PROBES],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self._proc.stdout is not None
        assert self._proc.stdout.readline().strip() == "polling"
        return self

    def __exit__(self, *_: object) -> None:
        assert self._proc is not None
        out, _ = self._proc.communicate("", timeout=60)
        self.samples = [tuple(s) for s in json.loads(out)]

    def check(self) -> None:
        assert len(self.samples) >= 3 * len(PROBES), self.samples
        assert {status for _, status, _ in self.samples} == {200}, self.samples[:10]
        worst = max(self.samples, key=lambda s: s[2])
        print(f"PROBES worst {worst} of {len(self.samples)}")
        assert worst[2] < PROBE_BUDGET_S, f"slowest probe: {worst} of {len(self.samples)}"


def post(url: str, path: str, body: bytes | dict, timeout: float = 120) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=timeout)


def while_probed(url: str, path: str, body: bytes | dict) -> tuple[httpx.Response, Probes]:
    """Sends ``body`` while the probes poll (from before it is sent until after it is
    answered) and a bystander's completion is served; (the answer, the probes)."""
    with Probes(url) as probes:
        answer: dict[str, httpx.Response] = {}
        bystander = threading.Thread(
            target=lambda: answer.setdefault("b", post(url, "/v1/completions", BYSTANDER))
        )
        response = None
        try:
            sender = threading.Thread(target=lambda: answer.setdefault("r", post(url, path, body)))
            sender.start()
            time.sleep(0.05)
            bystander.start()
            sender.join(180)
            bystander.join(180)
            response = answer["r"]
        finally:
            time.sleep(0.05)
    assert answer["b"].status_code == 200, answer["b"].text[:300]
    assert answer["b"].json()["choices"][0]["text"]
    return response, probes


def refused(response: httpx.Response, status: int, *words: str) -> str:
    assert response.status_code == status, response.text[:500]
    message = response.json()["error"]["message"]
    for word in words:
        assert word in message, message
    return message


@contextlib.contextmanager
def favoured(srv: Server) -> Iterator[Server]:
    """Where the test runs as root: the server's event-loop thread (its main thread; its
    offloaded work runs at a lower priority still) at nice -5 meanwhile. Test machines run other
    suites in parallel; what the 100 ms bound checks is that nothing blocks the loop, not the
    server's share of an oversubscribed machine (which a pod's CPU request settles)."""
    try:
        os.setpriority(os.PRIO_PROCESS, srv.proc.pid, -5)
    except OSError:  # not root: measured as it comes
        yield srv
        return
    try:
        yield srv
    finally:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, srv.proc.pid, 0)


@pytest.fixture
def default(server) -> Iterator[Server]:
    """The session's server (default limits), favoured while the test runs."""
    with favoured(server) as srv:
        yield srv


@pytest.fixture(scope="module")
def tuned() -> Iterator[Server]:
    """A server whose grammar limits let the review's grammar reach the worker (so it meets the
    time budget), with few slots and prompt token details on."""
    args = ("--max-grammar-bytes", "262144", "--grammar-timeout", "1", "--grammar-workers", "1",
            "--max-grammar-queue", "0", "--max-concurrency", "4", "--request-read-timeout", "5",
            "--enable-prompt-tokens-details")  # fmt: skip
    with running_server(*args) as srv, favoured(srv):
        yield srv


def _grammar_checks(url: str, result: str) -> float:
    return metric(scrape(url), "grammar_checks_total", result=result)


# ---- H1: the review's grammar, and 1 MiB bodies ----


def test_the_reviews_grammar_is_refused_by_size_while_probes_answer_fast(default) -> None:
    grammar = chained_gbnf()
    assert 90_000 <= len(grammar) <= 100_000
    body = {**BYSTANDER, "max_tokens": 1, "guided_grammar": grammar}
    response, probes = while_probed(default.url, "/v1/completions", body)
    refused(response, 400, "guided_grammar", "--max-grammar-bytes", "65536")
    probes.check()


def test_the_reviews_grammar_meets_the_time_budget_and_its_worker_is_killed(tuned) -> None:
    grammar = chained_gbnf()
    body = {**BYSTANDER, "max_tokens": 1, "guided_grammar": grammar}
    before = _grammar_checks(tuned.url, "timed_out")
    engine = tuned.engine_pid()
    start = time.monotonic()
    response, probes = while_probed(tuned.url, "/v1/completions", body)
    took = time.monotonic() - start
    refused(response, 400, "guided_grammar", "--grammar-timeout", "1 s")
    probes.check()
    assert took < 30, took  # a worker start and the 1 s budget, not the 13 s conversion
    assert _grammar_checks(tuned.url, "timed_out") == before + 1
    # The worker that ran over was killed: no grammar worker is left burning CPU.
    workers = [p for p in tuned.children() if p != engine and _is_spawned(p)]
    assert workers == [], workers
    # A resend is refused from the refusals remembered: at once, with no worker started.
    again_before = _grammar_checks(tuned.url, "refused_cached")
    start = time.monotonic()
    again = post(tuned.url, "/v1/completions", body)
    assert time.monotonic() - start < 0.5
    refused(again, 400, "--grammar-timeout")
    assert _grammar_checks(tuned.url, "refused_cached") == again_before + 1
    assert [p for p in tuned.children() if p != engine and _is_spawned(p)] == []
    # And the server still builds grammars: a fresh worker takes the next one.
    fine = {**BYSTANDER, "guided_choice": ["yes", "no"]}
    assert post(tuned.url, "/v1/completions", fine).json()["choices"][0]["text"] in ("yes", "no")


def test_grammars_past_the_workers_and_the_queue_get_503(tuned) -> None:
    """One grammar worker, no queue: of two slow grammars sent at once, one runs (and meets the
    budget), the other is refused at once with 503, Retry-After and instance_unavailable."""
    bodies = [
        {**BYSTANDER, "max_tokens": 1, "guided_grammar": chained_gbnf(2990 + i)} for i in (1, 2)
    ]
    answers: list[httpx.Response] = []
    senders = [
        threading.Thread(target=lambda b=b: answers.append(post(tuned.url, "/v1/completions", b)))
        for b in bodies
    ]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(120)
    busy = [a for a in answers if a.status_code == 503]
    assert sorted(a.status_code for a in answers) == [400, 503], [a.text for a in answers]
    refused(busy[0], 503, "busy checking structured-output grammars")
    assert busy[0].headers["retry-after"] == "1"
    assert busy[0].json()["error"]["code"] == "instance_unavailable"


def _is_spawned(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read()
    return False


def _body_of_size(body: dict, field: str, unit: str, size: int) -> bytes:
    """``body`` with ``field`` a text of ``unit`` repeated to make the JSON ``size`` bytes."""
    empty = len(json.dumps({**body, field: ""}).encode())
    text = (unit * (size // len(unit) + 1))[: size - empty]
    encoded = json.dumps({**body, field: text}).encode()
    assert len(encoded) == size
    return encoded


def test_a_one_mib_prompt_is_tokenised_off_the_loop(default) -> None:
    body = _body_of_size({**BYSTANDER, "max_tokens": 1}, "prompt", TEXT, MIB - 16)
    response, probes = while_probed(default.url, "/v1/completions", body)
    refused(response, 400, "max_model_len")  # far longer than the model's context
    probes.check()


def test_a_one_mib_tokenize_is_counted_off_the_loop(default) -> None:
    body = _body_of_size({"model": "tiny"}, "prompt", TEXT, MIB - 16)
    response, probes = while_probed(default.url, "/tokenize", body)
    assert response.status_code == 200, response.text[:300]
    assert response.json()["count"] > 100_000
    probes.check()
    strs = post(default.url, "/tokenize", {"prompt": TEXT * 100, "return_token_strs": True})
    refused(strs, 400, "return_token_strs", "max_model_len")


def test_a_one_mib_json_schema_is_refused_before_any_work(default) -> None:
    properties = {f"p{i}": {"type": "string", "maxLength": i + 1} for i in range(21_000)}
    schema = {"type": "object", "properties": properties}
    body = json.dumps({**BYSTANDER, "max_tokens": 1, "guided_json": schema}).encode()
    assert 0.9 * MIB < len(body) < MIB, len(body)
    response, probes = while_probed(default.url, "/v1/completions", body)
    refused(response, 400, "guided_json", "--max-")
    probes.check()


def test_a_one_mib_chat_is_rendered_off_the_loop(default) -> None:
    messages = [{"role": "user", "content": f"{TEXT} {i}"} for i in range(9_000)]
    body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 1}).encode()
    assert 0.9 * MIB < len(body) < MIB, len(body)
    response, probes = while_probed(default.url, "/v1/chat/completions", body)
    refused(response, 400, "max_model_len")
    probes.check()


def test_a_large_invalid_schema_is_refused_once_then_from_memory(default) -> None:
    """Meta-validation costs ~7 s/MiB; a schema with one bad keyword at its end was validated
    in full on every resend. Now the worker does it once; the resend is refused from memory."""
    properties = {f"field_{i}": {"type": "string", "maxLength": 8} for i in range(1_250)}
    properties["last"] = {"type": "strin"}
    schema = {"type": "object", "properties": properties}
    text = json.dumps(schema)
    assert 50_000 < len(text) < 65_536
    body = {**BYSTANDER, "max_tokens": 1, "response_format": {
        "type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}  # fmt: skip
    refused_before = _grammar_checks(default.url, "refused")
    cached_before = _grammar_checks(default.url, "refused_cached")
    response, probes = while_probed(default.url, "/v1/chat/completions", {
        **body, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    first = refused(response, 400, "invalid JSON schema", "strin")
    probes.check()
    assert _grammar_checks(default.url, "refused") == refused_before + 1
    # The same schema as guided_json on completions: the same input, refused from memory.
    again = post(default.url, "/v1/completions", {**BYSTANDER, "guided_json": text})
    second = refused(again, 400, "guided_json", "invalid JSON schema")
    assert second.removeprefix("guided_json: ") in first
    assert _grammar_checks(default.url, "refused_cached") == cached_before + 1
    assert _grammar_checks(default.url, "refused") == refused_before + 1


# ---- L8: 400, not 500 ----


@pytest.mark.parametrize(
    "field, value",
    [
        ("guided_json", '{"a":' * 5000 + "1" + "}" * 5000),  # a RecursionError before
        ("guided_json", '{"properties":' * 150 + "{}" + "}" * 150),
        ("guided_json", json.loads('{"items":' * 150 + "{}" + "}" * 150)),
    ],
    ids=["text-5000-deep", "text-150-deep", "object-150-deep"],
)
def test_deeply_nested_schemas_are_400_naming_the_limit(default, field: str, value) -> None:
    response = post(default.url, "/v1/completions", {**BYSTANDER, field: value})
    refused(response, 400, field, "--max-schema-depth", "64")
    assert default.proc.poll() is None
    assert "Traceback" not in default.log()


# ---- /tokenize and /detokenize are admitted like the other endpoints ----


def test_tokenize_takes_a_slot_and_is_refused_while_paused(tuned) -> None:
    url = tuned.url
    slow = []
    try:
        for _ in range(4):  # four slow senders hold every slot while their bodies trickle in
            sock = socket.create_connection(("127.0.0.1", tuned.port))
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: 1000\r\n\r\n{"
            )
            slow.append(sock)
        time.sleep(0.5)
        refused(post(url, "/tokenize", {"prompt": TEXT}), 429, "too many requests")
        refused(post(url, "/detokenize", {"tokens": [5, 6]}), 429, "too many requests")
    finally:
        for sock in slow:
            sock.close()
    _wait(lambda: post(url, "/tokenize", {"prompt": TEXT}).status_code == 200)
    admin = {"Authorization": f"Bearer {tuned.admin_key()}"}
    assert httpx.post(f"{url}/pause", headers=admin).status_code == 200
    try:
        refused(post(url, "/tokenize", {"prompt": TEXT}), 503, "paused")
        refused(post(url, "/detokenize", {"tokens": [5, 6]}), 503, "paused")
    finally:
        assert httpx.post(f"{url}/resume", headers=admin).status_code == 200
    assert post(url, "/detokenize", {"tokens": [5, 6]}).status_code == 200


def _wait(predicate, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


# ---- M6: cached_tokens only when asked for ----


def _usage_twice(url: str) -> list[dict]:
    body = {"model": "tiny", "prompt": TEXT * 3, "max_tokens": 2, "temperature": 0}
    return [post(url, "/v1/completions", body).json()["usage"] for _ in range(2)]


def test_cached_tokens_are_not_reported_by_default(default) -> None:
    for usage in _usage_twice(default.url):
        assert "prompt_tokens_details" not in usage, usage
    stream = {"model": "tiny", "prompt": TEXT * 3, "max_tokens": 2, "stream": True,
              "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{default.url}/v1/completions", json=stream, timeout=60) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    usage = json.loads(events[-1].removeprefix("data: "))["usage"]
    assert usage["prompt_tokens"] > 0 and "prompt_tokens_details" not in usage


def test_cached_tokens_are_reported_with_the_flag(tuned) -> None:
    _, second = _usage_twice(tuned.url)
    assert second["prompt_tokens_details"]["cached_tokens"] > 0, second
    assert second["prompt_tokens_details"]["cached_tokens"] % 16 == 0  # whole blocks
