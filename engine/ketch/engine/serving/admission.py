"""Admission: what a request must pass before it costs the engine anything.

- A request holds a ``Slot`` of ``--max-concurrency`` from the moment its body starts arriving
  (so slow senders count) until its last byte is sent; once parsed, the slot grows to one unit
  per sequence it asks for (prompts x n). The check and the count happen with no ``await``
  between them, so a burst cannot slip past the limit.
- A body is read up to ``--max-request-bytes`` (413 past it) within ``--request-read-timeout``
  (408 after), whatever the client declares in Content-Length.
- Credentials are compared as bytes in constant time: a header with non-ASCII characters is a
  wrong credential (401), not a server error.
- /pause and /resume always need the admin key; where the client connects from proves nothing
  (``check_control_access``).
- Limits on what one request may carry (sequences, stop strings, stop token ids, logit bias),
  and its prompts against the model as the engine announced it (``request_checks``: not
  empty, token ids in the vocabulary, shorter than max_model_len).
- A bound on what one request may produce (``--max-output-entries``), checked before it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import secrets
import weakref
from pathlib import Path
from typing import Protocol

from fastapi import Request

from ketch.engine import rundir
from ketch.engine.request_checks import PromptLimits, RequestCheckError, check_prompt
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.serving.config import ServerConfig
from ketch.engine.serving.protocol import ProtocolError


class _Counted(Protocol):
    config: ServerConfig
    in_flight: int

    def set_idle(self, idle: bool) -> None: ...


class Slot:
    """One request's share of ``--max-concurrency``; released exactly once."""

    def __init__(self, state: _Counted) -> None:
        self.state = state
        self.weight = 0
        self.resize(1)

    def resize(self, weight: int) -> None:
        """Takes ``weight`` units in all; 429 (holding what it had) if that is over the limit."""
        grow = weight - self.weight
        limit = self.state.config.max_concurrency
        if weight > limit:  # could never run: not a reason to retry
            raise ProtocolError(
                400,
                f"the request asks for {weight} sequences; this server runs at most {limit} at "
                "once (--max-concurrency)",
                param="n",
            )
        if grow > 0 and self.state.in_flight + grow > limit:
            raise ProtocolError(429, f"too many requests in flight (limit {limit}); retry")
        self.state.in_flight += grow
        self.weight = weight
        self.state.set_idle(self.state.in_flight == 0)

    def release(self) -> None:
        if self.weight:
            self.resize(0)

    def release_with(self, owner: object) -> None:
        """Also release when ``owner`` (a response body not yet iterated) is collected."""
        weakref.finalize(owner, self.release)


async def read_body(config: ServerConfig, request: Request) -> bytes:
    """The request body, bounded in size and in the time it may take to arrive."""
    limit = config.max_request_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ProtocolError(413, f"request body is larger than {limit} bytes")
    body = bytearray()
    try:
        async with asyncio.timeout(config.request_read_timeout):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise ProtocolError(413, f"request body is larger than {limit} bytes")
    except TimeoutError:
        seconds = config.request_read_timeout
        raise ProtocolError(408, f"the request body did not arrive within {seconds:g} s") from None
    return bytes(body)


def credential_ok(header: str, key: str) -> bool:
    """``Authorization: Bearer <key>``, compared in constant time (any text is safe)."""
    scheme, _, token = header.partition(" ")
    given = token.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(given, key.encode())


def check_control_access(path: str, header: str, admin_key: str | None) -> None:
    """/pause and /resume: always the admin key (``--admin-key-file``, else the one ``ketch
    serve`` wrote into its run directory, see ``local_admin_key``). The peer's address proves
    nothing: a same-pod proxy (a service-mesh sidecar, which connects from 127.0.0.6, or any
    reverse proxy on 127.0.0.1) makes every client look like loopback. No key: refused."""
    if admin_key is None or not credential_ok(header, admin_key):
        raise ProtocolError(
            401,
            f"missing or wrong admin key: {path} needs 'Authorization: Bearer <admin key>' "
            "(--admin-key-file, else the admin-key file in the server's run directory)",
        )


def local_admin_key(name: str) -> tuple[str, Path]:
    """A fresh random admin key, written (mode 0600) to ``name`` in the private run directory
    (0700, ``ketch.engine.rundir``): whoever can read it — this user, ``kubectl exec`` into the
    container — can send it; nobody else, wherever they connect from."""
    key = secrets.token_urlsafe(32)
    path = rundir.run_dir() / name
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a previous run's; never written through (O_EXCL below)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key, path


def check_limits(config: ServerConfig, params: SamplingParams, num_prompts: int) -> None:
    """400 naming the field when a request asks for more than this server allows."""
    sequences = num_prompts * params.n
    if sequences > config.max_choices:
        raise ProtocolError(
            400,
            f"{num_prompts} prompt(s) x n={params.n} is {sequences} sequences; this server "
            f"allows at most {config.max_choices} per request",
            param="n" if num_prompts == 1 else "prompt",
        )
    if len(params.stop) > config.max_stop_strings:
        raise ProtocolError(
            400, f"at most {config.max_stop_strings} stop strings are allowed", param="stop"
        )
    if any(len(s) > config.max_stop_length for s in params.stop):
        raise ProtocolError(
            400,
            f"stop strings may be at most {config.max_stop_length} characters long",
            param="stop",
        )
    if len(params.stop_token_ids) > config.max_stop_token_ids:
        raise ProtocolError(
            400,
            f"at most {config.max_stop_token_ids} stop token ids are allowed",
            param="stop_token_ids",
        )
    if len(params.logit_bias) > config.max_logit_bias:
        raise ProtocolError(
            400,
            f"logit_bias has {len(params.logit_bias)} entries; at most {config.max_logit_bias} "
            "are allowed (--max-logit-bias)",
            param="logit_bias",
        )


def check_output_size(
    config: ServerConfig, params: SamplingParams, prompts: list[list[int]], max_model_len: int
) -> None:
    """400 when a request could produce more than ``--max-output-entries``: each sequence's
    tokens (max_tokens, or the room left in max_model_len) times ``1 + logprobs``, and its
    prompt's tokens times ``1 + prompt_logprobs`` when it asks for those. Counted before any
    work, so a non-streaming response, the engine's frames and the JSON body stay bounded."""
    per_token = 1 + (params.logprobs or 0)
    scored = None if params.prompt_logprobs is None else 1 + params.prompt_logprobs
    entries = 0
    for prompt in prompts:
        room = max(max_model_len - len(prompt), 0)
        tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        entries += tokens * per_token + (0 if scored is None else len(prompt) * scored)
    entries *= params.n
    limit = config.max_output_entries
    if entries > limit:
        raise ProtocolError(
            400,
            f"the request may produce {entries} output entries (sequences x max_tokens x "
            f"(1 + logprobs), plus prompt tokens x (1 + prompt_logprobs)); this server allows "
            f"at most {limit} per request (--max-output-entries): lower n, max_tokens or "
            "logprobs",
            param="max_tokens",
        )


def check_prompts(
    limits: PromptLimits, prompts: list[list[int]], params: SamplingParams, field: str = "prompt"
) -> None:
    """``request_checks.check_prompt`` on each of a request's prompts (numbered as the request
    lists them): a 400 naming the field, in the one wording the engine and ``LLM`` use too."""
    try:
        for index, prompt in enumerate(prompts):
            check_prompt(limits, prompt, params, field, index)
    except RequestCheckError as exc:
        raise ProtocolError(400, str(exc), param=exc.param) from None
