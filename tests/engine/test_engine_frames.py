"""Engine -> API server frames stay under what the receiver accepts, and a refused frame fails
the requests it carried instead of leaving them waiting (security review H2).

Without an engine process: frames are built as the engine process builds them
(``encode_step``) and fed to ``EngineClient``'s reader as its socket would.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from ketch.engine import wire
from ketch.engine.config import EngineConfig
from ketch.engine.engine_client import EngineClient
from ketch.engine.engine_messages import (
    StepOutputs,
    TokenDelta,
    decode,
    encode,
    encode_step,
    join_pieces,
)
from ketch.engine.models.paths import resolve_model_path
from ketch.engine.output_processor import OutputProcessor
from ketch.engine.outputs import RequestDelta, TokenLogprob
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.stats import EngineSnapshot, RequestMetrics
from ketch.engine.tokenizer import Tokenizer
from ketch.engine.wire import MAX_MESSAGE_BYTES

SNAPSHOT = EngineSnapshot(1, 2, 0.5, 10, 20, 3, 64, 0, 100, 50)
METRICS = RequestMetrics(1.0, 1.5, 2.0, 3.0, 4, 1, 0, 0, "length")


@pytest.fixture
def client(tmp_path: Path):
    client = EngineClient(EngineConfig(model="tiny"), port=1, run_dir=tmp_path)
    client.processor = OutputProcessor(Tokenizer(resolve_model_path("tiny")))
    yield client
    client._requests.close(linger=0)
    client._outputs.close(linger=0)
    client._context.term()


def _open(client: EngineClient, *request_ids: str) -> dict[str, asyncio.Queue[RequestDelta]]:
    for request_id in request_ids:
        client._queues[request_id] = asyncio.Queue()
        client.processor.add_request(request_id, [1], SamplingParams(logprobs=20))
    return {r: client._queues[r] for r in request_ids}


def _drain(queue: asyncio.Queue[RequestDelta]) -> list[RequestDelta]:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


def _as_sent(delta: RequestDelta) -> TokenDelta:
    """What the engine sent, read back from the API server's delta (its text aside)."""
    d = delta
    return TokenDelta(
        d.request_id, d.new_token_ids, d.finish_reason, d.stop_reason, d.num_prompt_tokens,
        d.num_cached_tokens, d.logprobs, d.prompt_logprobs, d.error, d.error_code, d.metrics,
    )  # fmt: skip


def _big_final_delta(request_id: str, positions: int, seed: int) -> TokenDelta:
    """A non-streaming request's one delta: every position with 20 alternatives, its prompt
    scored, and its metrics."""
    rng = random.Random(seed)

    def logprob() -> TokenLogprob:
        top = [(rng.randrange(50000), -rng.random() * 20) for _ in range(20)]
        return TokenLogprob(rng.randrange(50000), -rng.random() * 20, top)

    return TokenDelta(
        request_id,
        new_token_ids=[rng.randrange(50000) for _ in range(positions)],
        finish_reason="length",
        num_prompt_tokens=40,
        num_cached_tokens=16,
        logprobs=[logprob() for _ in range(positions)],
        prompt_logprobs=[logprob() for _ in range(39)],
        metrics=METRICS,
    )


def test_a_step_over_the_frame_budget_goes_in_frames_under_it_and_arrives_whole(client) -> None:
    budget = 64 << 10
    deltas = [
        TokenDelta("req-s1", [5]),  # streaming requests' small deltas, before and after
        _big_final_delta("req-b1", 700, seed=1),
        TokenDelta("", finish_reason="abort", metrics=METRICS),  # an abort's metrics
        _big_final_delta("req-b2", 300, seed=2),
        TokenDelta("req-s2", [6], finish_reason="stop", stop_reason=6),
        TokenDelta("req-e", error="prompt is empty"),
    ]
    assert len(encode(StepOutputs(deltas, SNAPSHOT))) > 8 * budget  # the case at hand
    frames = encode_step(deltas, SNAPSHOT, budget)
    assert len(frames) > 8 and all(len(frame) <= budget for frame in frames)
    queues = _open(client, "req-s1", "req-b1", "req-b2", "req-s2", "req-e")
    finished = []
    client.on_finished = finished.append
    for frame in frames:
        assert client._take(frame) == []
    for delta in deltas:
        if delta.request_id:
            got = _drain(queues[delta.request_id])  # one delta, exactly as sent (with text)
            assert [_as_sent(d) for d in got] == [delta]
    assert client.last_snapshot == SNAPSHOT
    assert finished == [METRICS] * 3  # each finished request counted once
    assert client._pieces == {}


def test_a_step_under_the_budget_is_one_frame_as_before() -> None:
    deltas = [TokenDelta("req-a", [1, 2]), TokenDelta("req-b", [3], "stop")]
    assert encode_step(deltas, SNAPSHOT) == [wire.encode_short(StepOutputs(deltas, SNAPSHOT))]


def test_a_frame_leaves_out_fields_at_their_default_and_decodes_to_the_same_step() -> None:
    """The engine's frames are short (each field at its default left out): decoded, the same
    step as in full, fields left at a default that is not written (a float) or that a bool, a
    float or a negative zero only resembles kept apart."""
    metrics = RequestMetrics(0.0, -0.0, 2.0, 3.0, 0, 1, 0, 0, "length")
    deltas = [
        TokenDelta("req-a", [1, 2]),
        TokenDelta("req-b", [0], "stop", 0, 0, 0, [TokenLogprob(0, -0.0)], [], error_code=400),
        TokenDelta("", finish_reason="abort", metrics=metrics),
        TokenDelta("req-c", [], error="bad", error_code=503),
        TokenDelta("req-d", [], "length", embedding=[0.0, -0.0]),
    ]
    step = StepOutputs(deltas, SNAPSHOT, ["req-x"])
    [frame] = encode_step(deltas, SNAPSHOT)
    assert len(frame) < len(encode(StepOutputs(deltas, SNAPSHOT))) * 2 // 3
    for data in (wire.encode_short(step), encode(step)):
        decoded = decode(data)
        assert decoded == step and repr(decoded) == repr(step)  # -0.0 and 0 kept as they were
        assert [vars(d) for d in decoded.deltas] == [vars(d) for d in deltas]  # field order too
    left_out = decode(frame).deltas[3:]  # their new_token_ids: [], left out
    assert left_out[0].new_token_ids is not left_out[1].new_token_ids  # each made anew


def test_pieces_join_back_exactly() -> None:
    delta = _big_final_delta("req-a", 50, seed=3)
    frames = [decode(f) for f in encode_step([delta], None, budget=4 << 10)]
    assert len(frames) > 4 and all(len(f.deltas) == 1 for f in frames)  # one piece a frame
    assert all(f.continued == ["req-a"] for f in frames[:-1]) and frames[-1].continued == []
    pieces = [f.deltas[0] for f in frames]
    assert all(p.finish_reason is None and p.metrics is None for p in pieces[:-1])
    assert join_pieces(pieces) == delta
    empty = TokenDelta("req-b", [1] * 3000, logprobs=[], prompt_logprobs=[])
    pieces = [d for f in encode_step([empty], None, budget=2 << 10) for d in decode(f).deltas]
    assert len(pieces) > 1 and join_pieces(pieces) == empty  # [] stays [], None stays None


def test_small_deltas_share_the_frames_of_a_cut_one() -> None:
    small = [TokenDelta(f"req-s{i}", [i] * 50) for i in range(200)]
    big = _big_final_delta("req-b", 40, seed=5)
    deltas = [*small[:100], big, *small[100:]]
    frames = [decode(f) for f in encode_step(deltas, None, 8 << 10)]
    for frame in frames:
        ids = [d.request_id for d in frame.deltas]
        assert len(ids) == len(set(ids))  # never two pieces of one delta in one frame
    whole = len(encode(StepOutputs(deltas)))
    assert len(frames) <= 2 * whole // (8 << 10) + 1  # packed, not one delta a frame
    assert [d for f in frames for d in f.deltas if d.request_id != "req-b"] == small


def test_a_refused_frame_fails_every_open_request_it_carried(client) -> None:
    """Before: the frame was counted and dropped, and its requests waited forever."""
    queues = _open(client, "req-a", "req-b", "req-c")
    good = encode(StepOutputs([TokenDelta("req-a", [1]), TokenDelta("req-b", [2])]))
    malformed = good.replace(b"[2]", b"[-2.5]")
    lost = client._take(malformed)
    for request_id in ("req-a", "req-b"):
        assert [(d.error_code, d.finished) for d in _drain(queues[request_id])] == [(500, True)]
    assert _drain(queues["req-c"]) == []  # not in that frame: untouched
    assert sorted(lost) == ["req-a", "req-b"]  # the reader aborts them in the engine
    assert client.bad_messages.total == 1


def test_an_oversized_frame_fails_the_requests_it_carried(client) -> None:
    queues = _open(client, "req-big", "req-small", "req-other")
    head = b'{"type": "StepOutputs", "body": {"deltas": [{"request_id": "req-small", '
    head += b'"new_text": "\\"request_id\\": \\"req-other\\""}, {"request_id": "req-big", '
    frame = head + b'"new_text": "' + b"x" * MAX_MESSAGE_BYTES + b'"}]}}'
    lost = client._take(frame)
    assert [d.error_code for d in _drain(queues["req-big"])] == [500]
    assert [d.error_code for d in _drain(queues["req-small"])] == [500]
    assert _drain(queues["req-other"]) == []  # named only inside a text: not failed
    assert sorted(lost) == ["req-big", "req-small"]


def test_a_lost_piece_fails_its_request_and_nothing_is_left_held(client) -> None:
    queues = _open(client, "req-a")
    frames = encode_step([_big_final_delta("req-a", 60, seed=4)], None, budget=8 << 10)
    client._take(frames[0])
    assert client._pieces and _drain(queues["req-a"]) == []
    assert client._take(frames[1][:-5]) == ["req-a"]  # a cut frame
    assert [d.error_code for d in _drain(queues["req-a"])] == [500]
    assert client._pieces == {}
