"""Random methods, paths, headers and bodies thrown at a real router (prefix-hash, so bodies
are parsed; registration on, so its endpoint is in play) in front of a real HTTP instance.
Derandomized and bounded: the same few hundred requests every run. Afterwards the router must
still be up and serving, and it must never have answered a 5xx of its own making: only 502,
503 and 504 (an instance unreachable, or failing) are allowed.
"""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_harness import FakeInstance, running_router

TOKEN = "fuzz-token"
LIMIT = 256 * 1024
EXAMPLES = 300
ALLOWED_5XX = {502, 503, 504}
PATHS = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/ketch/register",
    "/v1/ketch/instances",
    "/health",
    "/ready",
    "/metrics",
]
URL_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789-._~%/:@!$&'()*+,;="
# Header bytes h11 lets a client send: visible ASCII, space, tab and obs-text (0x80-0xff).
HEADER_BYTES = bytes([9, *range(0x20, 0x7F), *range(0x80, 0x100)])
# Headers that would change how the request is framed or where it goes, left to httpx.
FRAMING = {"content-length", "transfer-encoding", "host", "connection", "expect", "upgrade"}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=20,
)
openai_like = st.fixed_dictionaries(
    {},
    optional={
        "model": json_values,
        "prompt": json_values,
        "messages": json_values,
        "stream": json_values,
        "url": json_values,
        "role": json_values,
    },
)
bodies = st.one_of(
    st.binary(max_size=2000),
    json_values.map(lambda v: json.dumps(v).encode()),
    openai_like.map(lambda v: json.dumps(v).encode()),
    st.integers(1, 100_000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 100_000).map(lambda n: b'{"prompt": ' + b"[" * n + b"]" * n + b"}"),
    st.integers(LIMIT - 50, 2 * LIMIT).map(lambda n: b'{"prompt": "' + b"a" * n + b'"}'),
)
header_values = st.one_of(
    st.sampled_from([b"Bearer " + TOKEN.encode(), b"Bearer wrong", b"application/json"]),
    st.binary(max_size=80).map(lambda b: bytes(HEADER_BYTES[x % len(HEADER_BYTES)] for x in b)),
)
header_names = st.one_of(
    st.sampled_from(["authorization", "content-type", "accept", "x-request-id"]),
    st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=20),
).filter(lambda name: name not in FRAMING)
headers = st.dictionaries(header_names, header_values, max_size=4)
# Mostly what the router forwards or parses; some registration; some anything at all.
forwarded = st.tuples(
    st.just("POST"), st.sampled_from([*PATHS[:2], "/v1/ketch/register"]), headers, bodies
)
anything = st.tuples(
    st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
    st.one_of(st.sampled_from(PATHS), st.text(URL_CHARS, max_size=40).map(lambda p: "/" + p)),
    headers,
    bodies,
)
requests = st.sampled_from([forwarded] * 4 + [anything]).flatmap(lambda kind: kind)


@pytest.mark.timeout(240)
def test_fuzzed_requests_never_break_the_router(tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    fake = FakeInstance()
    seen: Counter[int] = Counter()
    try:
        with running_router("--mixed", fake.url, "--policy", "prefix-hash", "--registration",
                            "--registration-token-file", str(token_file),
                            "--max-request-bytes", str(LIMIT)) as r:  # fmt: skip
            with httpx.Client(base_url=r.url, timeout=30) as client:
                throw_requests(client, seen)
            assert r.proc.poll() is None, r.log()
            assert httpx.get(f"{r.url}/health", timeout=5).status_code == 200
            reply = httpx.post(f"{r.url}/v1/completions", json={"prompt": "still"}, timeout=30)
            assert reply.status_code == 200
            assert "Traceback" not in r.log(), r.log()
    finally:
        fake.stop()
    assert sum(seen.values()) >= EXAMPLES * 0.9, seen  # the requests really went out
    print("statuses:", dict(sorted(seen.items())))


def throw_requests(client: httpx.Client, seen: Counter[int]) -> None:
    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(requests)
    def throw(request: tuple[str, str, dict[str, bytes], bytes]) -> None:
        method, path, headers, body = request
        try:
            reply = client.request(method, path, headers=headers, content=body)
        except httpx.LocalProtocolError:
            return  # httpx would not send it
        seen[reply.status_code] += 1
        status = reply.status_code
        assert status < 500 or status in ALLOWED_5XX, (method, path, headers, body[:200], reply)

    throw()
