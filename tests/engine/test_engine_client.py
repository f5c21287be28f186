"""The API server's side of the engine sockets (``EngineClient``), without an engine process."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ketch.engine.config import EngineConfig
from ketch.engine.engine_client import EngineClient, _coalesce
from ketch.engine.engine_messages import StepOutputs, TokenDelta, encode
from ketch.engine.models.paths import resolve_model_path
from ketch.engine.output_processor import OutputProcessor
from ketch.engine.outputs import RequestDelta, TokenLogprob
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.tokenizer import Tokenizer


def test_a_malformed_engine_frame_is_counted_and_dropped(tmp_path: Path) -> None:
    """The reader routes every good frame after a bad one: a bad frame is no reason to stop
    (the requests it names fail: see test_engine_frames)."""
    client = EngineClient(EngineConfig(model="tiny"), port=1, run_dir=tmp_path)
    try:
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        client._queues["r"] = queue
        tokenizer = Tokenizer(resolve_model_path("tiny"))
        client.processor = OutputProcessor(tokenizer)
        client.processor.add_request("r", [1], SamplingParams())
        bad = encode(StepOutputs([TokenDelta("other", [1])])).replace(b"[1]", b"[-1.5]")
        for frame in (b"\xff", b'{"type": "StepOutputs", "body": {"deltas": [5]}}', bad):
            client._take(frame)
        assert client.bad_messages.total == 3 and queue.empty()
        client._take(encode(StepOutputs([TokenDelta("r", [1])])))
        assert queue.get_nowait() == RequestDelta("r", [1], tokenizer.decode([1]))
    finally:
        client._requests.close(linger=0)
        client._outputs.close(linger=0)
        client._context.term()


def _queue(*deltas: RequestDelta) -> asyncio.Queue[RequestDelta]:
    queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
    for delta in deltas:
        queue.put_nowait(delta)
    return queue


def test_a_backlog_folds_into_one_delta_up_to_its_end() -> None:
    lp = [TokenLogprob(t, -1.0) for t in range(4)]
    first = RequestDelta("r", [0], "a", logprobs=lp[:1], prompt_logprobs=[])
    queue = _queue(
        RequestDelta("r", [1, 2], "bc", logprobs=lp[1:3], num_cached_tokens=4),
        RequestDelta("r", [3], "d", "length", logprobs=lp[3:], num_cached_tokens=4),
        RequestDelta("r", [9], "late"),
    )
    folded = _coalesce(first, queue)
    assert folded.new_token_ids == [0, 1, 2, 3] and folded.new_text == "abcd"
    assert folded.logprobs == lp and folded.finish_reason == "length"
    assert folded.prompt_logprobs == [] and folded.num_cached_tokens == 4  # [] is kept
    assert queue.qsize() == 1  # what came after the end is not folded in
    error = RequestDelta("r", error="the engine died", error_code=503)
    assert _coalesce(RequestDelta("r", [0]), _queue(RequestDelta("r", [1]), error)) == error
