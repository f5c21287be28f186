"""prefix-hash's reading of request bodies: bounded work whatever the body, and no exception
for anything a client can send (the policy then falls back to least-requests)."""

from __future__ import annotations

import json
import sys
import time

from ketch.engine.router.instances import Instance
from ketch.engine.router.policies import (
    MAX_CHUNKS,
    MAX_PARSE_SEPARATORS,
    PrefixHash,
    prompt_chunks,
)

HOSTILE = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"prompt": [' + b"7" * 5000 + b"]}",  # an int past Python's digit limit
    b'{"prompt": "\xff"}',
    b"\x00\x01",
    b'"just a string"',
    b'{"prompt": {"a": 1}}',
    b'{"prompt": [1, "a"]}',
    b'{"prompt": []}',
    b'{"messages": null}',
    b"[" + b"[]," * 300_000 + b"[]]",  # a million separators: not parsed at all
]


def deep_call(depth: int, body: bytes, path: str) -> list[bytes] | None:
    """``prompt_chunks`` called with ``depth`` frames already on the stack, as in a server."""
    return deep_call(depth - 1, body, path) if depth else prompt_chunks(path, body, 128)


def test_unreadable_bodies_give_no_chunks_and_no_exception() -> None:
    # the parser's depth is the recursion limit, which libraries in the same test session may
    # have raised (celpy sets 2500): pin Python's default here
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        messages_at_the_parsers_depth = b'{"messages": ' + b"[" * 990 + b"]" * 990 + b"}"
        for path in ("/v1/completions", "/v1/chat/completions"):
            for body in [*HOSTILE, messages_at_the_parsers_depth]:
                assert deep_call(50, body, path) is None, body[:40]
    finally:
        sys.setrecursionlimit(limit)


def test_work_is_bounded_whatever_the_prompt() -> None:
    short = prompt_chunks("/v1/completions", json.dumps({"prompt": "ab" * 64}).encode(), 128)
    huge = json.dumps({"prompt": "ab" * 500_000}).encode()
    started = time.perf_counter()
    chunks = prompt_chunks("/v1/completions", huge, 128)
    took = time.perf_counter() - started
    assert chunks is not None and len(chunks) == MAX_CHUNKS
    assert chunks[0] == short[0]  # the prefix still decides
    tokens = json.dumps({"prompt": [7] * (MAX_PARSE_SEPARATORS - 10)}).encode()
    assert len(prompt_chunks("/v1/completions", tokens, 128)) == MAX_CHUNKS
    assert took < 0.5, took


def test_prefix_hash_without_chunks_picks_the_least_loaded() -> None:
    busy, idle = (
        Instance("http://a:1", "mixed", "static", 1),
        Instance("http://b:1", "mixed", "static", 1),
    )
    busy.engine_load = 5
    policy = PrefixHash(max_entries=16, slack=0)
    assert policy.choose([busy, idle], prompt_chunks("/v1/completions", HOSTILE[0], 128)) is idle
