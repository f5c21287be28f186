"""How the router picks an instance for a request: round-robin, least-requests, prefix-hash.

Every policy is deterministic given the candidates (sorted by URL) and their loads, so tests
can predict it. ``prefix-hash`` hashes the prompt in cumulative fixed-size chunks and remembers
chunk-hash -> instance in a bounded LRU; a request goes to the instance that matches the
longest chain of its leading chunks (that instance's prefix cache holds them), unless that
instance is more than ``slack`` requests busier than the least loaded one.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence

from ketch.engine.router.instances import Instance

# Chunks hashed per request at most: with the default 128 characters, the first 32 KiB of a
# prompt decide its instance. Requests sharing that much share the instance anyway, and a
# 1 MiB prompt costs no more than a 32 KiB one.
MAX_CHUNKS = 256
# Bodies with more JSON separators than this are not parsed (least-requests picks for them).
# Parsing holds the event loop, at worst about a microsecond per separator (floats, object
# keys, nested lists), so no body stalls the router for more than a few tens of milliseconds;
# a long text prompt has few separators, a token-id prompt one per token.
MAX_PARSE_SEPARATORS = 32_768
SEPARATORS = (b",", b":", b"[", b"{")


def least_loaded(candidates: Sequence[Instance]) -> Instance:
    """Fewest requests (engine's running+waiting + router's sends since the scrape); URL ties."""
    return min(candidates, key=lambda i: (i.load, i.url))


class Policy:
    """Base: ``choose`` gets the healthy candidates (non-empty, sorted by URL)."""

    name = "base"

    def choose(self, candidates: Sequence[Instance], chunks: list[bytes] | None) -> Instance:
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self.counter = 0

    def choose(self, candidates: Sequence[Instance], chunks: list[bytes] | None) -> Instance:
        inst = candidates[self.counter % len(candidates)]
        self.counter += 1
        return inst


class LeastRequests(Policy):
    name = "least-requests"

    def choose(self, candidates: Sequence[Instance], chunks: list[bytes] | None) -> Instance:
        return least_loaded(candidates)


class PrefixHash(Policy):
    """Prefix-aware: longest remembered chain of leading chunks wins, within a load slack."""

    name = "prefix-hash"

    def __init__(self, max_entries: int, slack: int) -> None:
        self.max_entries = max_entries
        self.slack = slack
        self.lru: OrderedDict[bytes, str] = OrderedDict()  # chunk-chain hash -> instance URL
        self.matches = 0  # requests sent to the instance that held their prefix

    def choose(self, candidates: Sequence[Instance], chunks: list[bytes] | None) -> Instance:
        fallback = least_loaded(candidates)
        if not chunks:
            return fallback
        by_url = {i.url: i for i in candidates}
        matched = None
        for key in chunks:  # cumulative hashes: matching chunk k means chunks 0..k match
            url = self.lru.get(key)
            if url is None:
                break
            if url in by_url:
                matched = by_url[url]
        chosen = fallback
        if matched is not None and matched.load - fallback.load <= self.slack:
            chosen = matched
            self.matches += 1
        for key in chunks:
            self.lru[key] = chosen.url
            self.lru.move_to_end(key)
        while len(self.lru) > self.max_entries:
            self.lru.popitem(last=False)
        return chosen


def make_policy(name: str, max_entries: int = 65536, slack: int = 8) -> Policy:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-requests":
        return LeastRequests()
    if name == "prefix-hash":
        return PrefixHash(max_entries, slack)
    raise ValueError(f"unknown policy {name!r}")


def prompt_chunks(path: str, body: bytes, chunk_chars: int) -> list[bytes] | None:
    """Cumulative chunk hashes of a request's prompt; None when there is no usable prompt.

    Completions (and embeddings, whose prompt is ``input``): ``prompt`` as a string, a list of
    strings (the first), a token-id list, or a list of token-id lists (the first). Chat:
    ``messages`` serialised. Token ids are chunked ``chunk_chars // 4`` at a time. Only whole
    chunks count, unless the prompt is shorter than one chunk (then it is one chunk); at most
    ``MAX_CHUNKS`` count, and bodies past ``MAX_PARSE_SEPARATORS`` are not parsed, so the work
    per request is bounded whatever the body. A body this cannot read (not JSON, nested past
    the parser's depth, odd types) is None: the policy falls back to least-requests and the
    instance, which gets the body unchanged, judges it.
    """
    if sum(body.count(sep) for sep in SEPARATORS) > MAX_PARSE_SEPARATORS:
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return chunks_of(path, data, chunk_chars)


def chunks_of(path: str, data: object, chunk_chars: int) -> list[bytes] | None:
    """``prompt_chunks`` of a body already parsed (the EPP parses it once for both)."""
    units, size = _prompt_units(path, data, chunk_chars)
    if not units:
        return None
    whole = min(len(units) // size * size or len(units), MAX_CHUNKS * size)
    digest = hashlib.blake2b(digest_size=16)
    out = []
    for start in range(0, whole, size):
        piece = units[start : start + size]
        digest.update(piece.encode() if isinstance(piece, str) else repr(piece).encode())
        out.append(digest.copy().digest())
    return out


def _prompt_units(path: str, data: object, chunk_chars: int) -> tuple[Sequence, int]:
    """(what to chunk, chunk size); empty when the request has no prompt this can hash."""
    if not isinstance(data, dict):
        return "", chunk_chars
    if path.endswith("/chat/completions"):
        messages = data.get("messages")
        if messages is None:
            return "", chunk_chars
        return json.dumps(messages, sort_keys=True, ensure_ascii=False), chunk_chars
    prompt = data.get("input" if path.endswith("/embeddings") else "prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, chunk_chars
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt, max(1, chunk_chars // 4)
    return "", chunk_chars
