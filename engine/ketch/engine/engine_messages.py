"""Messages between the API server and the engine process: small, typed, JSON on the wire.

Each step's ``TokenDelta``s (``ketch.engine.outputs``, what the engine emits: token ids, never
text) travel as they are, in one ``StepOutputs`` (``encode_step``); the API server makes their
text (``ketch.engine.output_processor``) and tells the engine to end a request whose text reached
a stop string (``AbortRequests.stopped``). A step whose frame would pass ``FRAME_BUDGET``
goes in several frames, and a delta larger than that in pieces (``StepOutputs.continued``,
joined by ``join_pieces`` on the API side), so no frame reaches what the receiver refuses
(``wire.MAX_MESSAGE_BYTES``); that costs one length check per step, nothing per delta.

Nothing here is pickled: each message encodes itself to a tagged JSON object and decodes back,
so either side can be replaced (or inspected with a plain ZMQ client) without sharing objects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ketch.engine import wire
from ketch.engine.outputs import TokenDelta
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.stats import EngineSnapshot


@dataclass
class AddRequest:
    """Queue a tokenised request; outputs stream back as ``TokenDelta``s in ``StepOutputs``.

    ``final_only``: its one delta comes when it ends (the API server asks so only for a request
    without stop strings, whose text it need not watch). ``prefill_peer`` (decode role): the
    prefill peer's pd-comm "host:port", as the router paired them. Where the peer pushes the KV
    is this instance's configuration, never the request's."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    final_only: bool = False
    prefill_peer: str | None = None


@dataclass
class AbortRequests:
    """End these requests and free their blocks.

    ``request_ids``: aborted (the client went away, its output was lost); each live one is
    answered by a ``TokenDelta`` with no request id, finish reason "abort" and its metrics.
    ``stopped``: ended by the API server at a stop string, with the number of output tokens it
    kept; each live one is answered by a ``TokenDelta`` with its id, finish reason "stop" and
    metrics counting those tokens only (those the engine made after them are dropped)."""

    request_ids: list[str]
    stopped: dict[str, int] = field(default_factory=dict)


@dataclass
class StepOutputs:
    """Everything one engine step produced, and the engine's state after it.

    ``continued``: the requests whose delta here is a piece of one too large for a frame; it
    goes on in the next frames, up to a piece not listed (``encode_step``). Empty almost
    always: a frame holds at most one delta per request."""

    deltas: list[TokenDelta]
    snapshot: EngineSnapshot | None = None
    continued: list[str] = field(default_factory=list)


@dataclass
class EngineReady:
    """Sent once the model is loaded and the engine accepts requests."""

    max_model_len: int
    num_kv_blocks: int
    vocab_size: int = 0  # the model's: the API server checks token ids against it
    hidden_size: int = 0  # the model's: the size of its embeddings (/v1/embeddings)
    # How it computes (the startup log and /metrics): the weights' dtype, the linear layers'
    # quantization, the KV cache's dtype, and the bytes of weights every rank holds in all.
    dtype: str = "float32"
    quantization: str = "none"
    kv_cache_dtype: str = "float32"
    weight_bytes: int = 0


@dataclass
class EngineFailed:
    """Sent instead of ``EngineReady`` when the engine cannot start (bad model, bad config)."""

    error: str


__all__ = [
    "FRAME_BUDGET", "AbortRequests", "AddRequest", "EngineFailed", "EngineReady", "StepOutputs",
    "TokenDelta", "decode", "encode", "encode_step", "join_pieces",
]  # fmt: skip

FRAME_BUDGET = 16 << 20
"""Most bytes the engine puts in one ``StepOutputs`` frame: far below what the API server
accepts (``wire.MAX_MESSAGE_BYTES``), and small enough to decode without stalling its loop."""

Message = AddRequest | AbortRequests | StepOutputs | EngineReady | EngineFailed
_TYPES = wire.registry(AddRequest, AbortRequests, StepOutputs, EngineReady, EngineFailed)


def encode(message: Message) -> bytes:
    return wire.encode(message)


def decode(data: bytes) -> Message:
    """Parses one message; raises wire.MessageError on anything malformed."""
    return wire.decode(data, _TYPES, "engine")


def encode_step(
    deltas: list[TokenDelta], snapshot: EngineSnapshot | None, budget: int = FRAME_BUDGET
) -> list[bytes]:
    """A step's frames: one, unless it is over ``budget`` bytes; then as many as it takes, in
    order, the snapshot on the last, each delta over the budget cut into pieces. Fields at their
    default are left out (``wire.encode_short``: the API server is of the engine's version)."""
    data = wire.encode_short(StepOutputs(deltas=deltas, snapshot=snapshot))
    if len(data) <= budget:
        return [data]
    room = budget - len(wire.encode_short(StepOutputs(deltas=[], snapshot=snapshot)))
    frames: list[bytes] = []
    pack: list[TokenDelta] = []
    continued: list[str] = []
    size = 0
    for delta in deltas:
        pieces = _pieces(delta, room)
        for i, (piece, piece_size) in enumerate(pieces):
            # At most one delta per request in a frame: its pieces go in successive frames.
            if pack and (size + piece_size > room or (i and pack[-1] is pieces[i - 1][0])):
                frames.append(wire.encode_short(StepOutputs(deltas=pack, continued=continued)))
                pack, continued, size = [], [], 0
            pack.append(piece)
            size += piece_size
            if i < len(pieces) - 1:
                continued.append(piece.request_id)
    frames.append(
        wire.encode_short(StepOutputs(deltas=pack, snapshot=snapshot, continued=continued))
    )
    return frames


def _pieces(delta: TokenDelta, budget: int) -> list[tuple[TokenDelta, int]]:
    """``delta`` (or its pieces, halved until each fits), each with its encoded size (an upper
    bound of what it adds to a frame). A delta that cannot be cut goes whole: the receiver
    refuses that frame and fails the requests it names."""
    size = len(wire.encode_short(delta)) + 2  # ", " between deltas
    halves = _halve(delta) if size > budget else None
    if halves is None:
        return [(delta, size)]
    return _pieces(halves[0], budget) + _pieces(halves[1], budget)


def _halve(delta: TokenDelta) -> tuple[TokenDelta, TokenDelta] | None:
    """The delta as two consecutive ones (the second with its end: finish reason, metrics),
    each with about half its tokens, logprobs and prompt logprobs; None if too small."""
    tokens, logprobs, prompt_logprobs = delta.new_token_ids, delta.logprobs, delta.prompt_logprobs
    lengths = (len(tokens), len(logprobs or ()), len(prompt_logprobs or ()))
    if max(lengths) <= 1:
        return None
    t = (len(tokens) + 1) // 2
    lp = t if logprobs is not None and len(logprobs) == len(tokens) else (lengths[1] + 1) // 2
    p = (lengths[2] + 1) // 2
    first = TokenDelta(
        request_id=delta.request_id,
        new_token_ids=tokens[:t],
        num_prompt_tokens=delta.num_prompt_tokens,
        num_cached_tokens=delta.num_cached_tokens,
        logprobs=None if logprobs is None else logprobs[:lp],
        prompt_logprobs=None if prompt_logprobs is None else prompt_logprobs[:p],
    )
    second = dataclasses.replace(
        delta,
        new_token_ids=tokens[t:],
        logprobs=None if logprobs is None else logprobs[lp:],
        prompt_logprobs=None if prompt_logprobs is None else prompt_logprobs[p:],
    )
    return first, second


def join_pieces(pieces: list[TokenDelta]) -> TokenDelta:
    """The delta that ``pieces`` (in order, the last one its end) were cut from."""
    last = pieces[-1]
    logprobs = last.logprobs
    if logprobs is not None:
        logprobs = [lp for piece in pieces for lp in piece.logprobs or ()]
    prompt_logprobs = last.prompt_logprobs
    if prompt_logprobs is not None:
        prompt_logprobs = [lp for piece in pieces for lp in piece.prompt_logprobs or ()]
    return dataclasses.replace(
        last,
        new_token_ids=[t for piece in pieces for t in piece.new_token_ids],
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
