"""Malformed and hostile bodies through a real router: the router reads only what its policy
needs (prefix-hash: the prompt), so whatever it cannot read is forwarded unchanged for the
instance to judge, and the router never answers 500 nor stops serving.
"""

from __future__ import annotations

import json

import httpx
import pytest
from router_harness import FakeInstance, running_router

NEST = 100_000

BODIES = {
    "nested arrays": b"[" * NEST + b"]" * NEST,
    "nested prompt": b'{"prompt": ' + b"[" * NEST + b"]" * NEST + b"}",
    "nested messages": b'{"messages": ' + b"[" * NEST + b"]" * NEST + b"}",
    # Parses, but re-encoding it one level deeper (as prefix-hash did) overflows.
    "messages just under the parser's depth": b'{"messages": ' + b"[" * 990 + b"]" * 990 + b"}",
    "not JSON": b"this is not json",
    "not UTF-8": b'{"prompt": "\xff\xfe"}',
    "a JSON string": b'"prompt"',
    "a JSON list": b'[{"prompt": "x"}]',
    "an int too long to parse": b'{"prompt": [' + b"7" * 5000 + b"]}",
    "prompt a number": b'{"prompt": 5}',
    "prompt an object": b'{"prompt": {"a": 1}}',
    "prompt mixed list": b'{"prompt": [1, "a", null]}',
    "prompt empty lists": b'{"prompt": [[]]}',
    "prompt bools": b'{"prompt": [true, false]}',
    "messages a string": b'{"messages": "hi"}',
    "model a list": b'{"model": [], "prompt": "x"}',
    "stream a string": b'{"prompt": "x", "stream": "yes"}',
    "huge prompt": json.dumps({"prompt": "a" * 900_000}).encode(),
    "huge token prompt": json.dumps({"prompt": [7] * 200_000}).encode(),
}


@pytest.mark.timeout(120)
def test_hostile_bodies_are_forwarded_unchanged_never_a_500() -> None:
    fake = FakeInstance()
    try:
        with running_router("--mixed", fake.url, "--policy", "prefix-hash") as r:
            for path in ("/v1/completions", "/v1/chat/completions"):
                for name, body in BODIES.items():
                    sent = len(fake.requests)
                    reply = httpx.post(f"{r.url}{path}", content=body, timeout=30)
                    assert reply.status_code in (200, 400), (path, name, reply.text[:300])
                    assert fake.requests[sent]["raw"] == body, (path, name)
            assert httpx.get(f"{r.url}/health", timeout=5).status_code == 200
            reply = httpx.post(f"{r.url}/v1/completions", json={"prompt": "fine"}, timeout=30)
            assert reply.status_code == 200
            assert "Traceback" not in r.log()
    finally:
        fake.stop()
