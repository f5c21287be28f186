"""Messages between prefill and decode engines over ``--pd-comm-port`` (tagged JSON, one frame).

Every engine in a prefill or decode role binds a ZMQ ROUTER on its pd-comm port. A decode engine
connects a DEALER to each prefill engine it uses and sends:

- ``PrefillRequest``: compute this prompt and put its KV blocks into my blocks ``dest_blocks``
  through my cache manager at ``kv_dest``; the prefill engine answers ``PrefillDone`` (the first
  token, once the blocks are there) or ``PrefillFailed``.
- ``AbortPrefill``: the client went away; the prefill engine answers ``PrefillFailed`` once
  nothing more will be written into the decode engine's blocks.
- ``PdPing``: liveness, listing the requests the decode engine waits for; ``PdPong`` names those
  the prefill engine does not know (it restarted), which then fail at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ketch.engine import wire
from ketch.engine.cache_manager.protocol import KVLayout
from ketch.engine.outputs import TokenLogprob
from ketch.engine.sampling_params import SamplingParams

PD_PROTOCOL_VERSION = 3  # 3: logprobs travel as TokenLogprob
# A PrefillRequest carries one prompt: a million tokens is ~8 MB of JSON.
MAX_PD_MESSAGE_BYTES = 16 << 20
MAX_PD_PROMPT_SCORES = 250_000
"""Most prompt_logprobs entries (prompt tokens x (prompt_logprobs + 1)) one request may ask of
a prefill peer: its PrefillDone must fit a frame (an entry takes at most ~50 bytes of JSON)."""


def prompt_scores_problem(num_prompt_tokens: int, prompt_logprobs: int | None) -> str | None:
    """Why a request's prompt_logprobs cannot come back from a prefill peer, or None."""
    if prompt_logprobs is None:
        return None
    entries = num_prompt_tokens * (prompt_logprobs + 1)
    if entries <= MAX_PD_PROMPT_SCORES:
        return None
    return (
        f"prompt_logprobs={prompt_logprobs} on a {num_prompt_tokens}-token prompt is {entries} "
        f"scores; a prefill/decode deployment returns at most {MAX_PD_PROMPT_SCORES} (prompt "
        "tokens x (prompt_logprobs + 1)): ask for fewer alternatives or send a shorter prompt"
    )


@dataclass
class PrefillRequest:
    version: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    model: str  # the decode engine's model fingerprint; the prefill engine must match it
    # The decode engine's KV layout, its dtype included: blocks are copied as they are, so the
    # prefill engine's must be the same.
    layout: KVLayout
    kv_dest: str  # "host:port" of the decode instance's cache manager KV transfer endpoint
    dest_blocks: list[int]  # decode blocks for prompt blocks start_block, start_block + 1, ...
    start_block: int
    dest_engine_id: str = ""  # the decode engine's id at its cache manager (see Push)
    kv_nonce: str = ""  # the reservation of dest_blocks the pushes must show (see Reserve)
    expires_at: float = 0.0  # wall clock: a prefill engine refuses the request after it


@dataclass
class PrefillDone:
    request_id: str
    token_id: int
    logprob: TokenLogprob | None = None  # of token_id, when the request asked for logprobs
    num_cached_tokens: int = 0  # prompt tokens the prefill engine found in its prefix cache
    num_bytes: int = 0
    transfer_seconds: float = 0.0
    finished_at: float = 0.0  # the prefill engine's wall clock when its prefill step ended
    # The request's prompt_logprobs, scored here: one per prompt token after the first.
    prompt_logprobs: list[TokenLogprob] | None = None

    def __post_init__(self) -> None:
        if self.logprob is not None and self.logprob.token_id != self.token_id:
            raise ValueError(
                f"logprob is of token {self.logprob.token_id}, but the token is {self.token_id}"
            )


@dataclass
class PrefillFailed:
    request_id: str
    error: str
    status_code: int = 503

    def __post_init__(self) -> None:
        if not 400 <= self.status_code <= 599:  # relayed to the client as its HTTP status
            raise ValueError(f"status_code must be an HTTP error status, got {self.status_code}")


@dataclass
class AbortPrefill:
    request_id: str


@dataclass
class PdPing:
    request_ids: list[str] = field(default_factory=list)


@dataclass
class PdPong:
    unknown_request_ids: list[str] = field(default_factory=list)


PdMessage = PrefillRequest | PrefillDone | PrefillFailed | AbortPrefill | PdPing | PdPong
_TYPES = wire.registry(PrefillRequest, PrefillDone, PrefillFailed, AbortPrefill, PdPing, PdPong)


def encode(message: PdMessage) -> bytes:
    return wire.encode(message)


def decode(data: bytes) -> PdMessage:
    """Parses one message; raises wire.MessageError on anything malformed."""
    return wire.decode(data, _TYPES, "prefill/decode", max_bytes=MAX_PD_MESSAGE_BYTES)
