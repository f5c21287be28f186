"""Engine <-> server messages survive encode/decode unchanged, and bad input is refused."""

from __future__ import annotations

import json

import pytest

from ketch.engine.engine_messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineReady,
    StepOutputs,
    TokenDelta,
    decode,
    encode,
)
from ketch.engine.outputs import TokenLogprob
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.stats import EngineSnapshot, RequestMetrics
from ketch.engine.wire import MessageError

MESSAGES = [
    AddRequest("a", [1, 2, 3], SamplingParams(temperature=0.5, stop=["x"], seed=3), True),
    AbortRequests(["a", "b"]),
    AbortRequests([], stopped={"c": 3}),
    StepOutputs(
        [
            TokenDelta(
                "a",
                [4, 5],
                None,
                None,
                3,
                0,
                [TokenLogprob(4, -0.1, [(4, -0.1), (9, -2.0)]), TokenLogprob(5, -0.7)],
                [TokenLogprob(3, -5.0, [(8, -0.5)])],
            ),
            TokenDelta("b", finish_reason="stop", stop_reason=7),
            TokenDelta("c", error="prompt is empty"),
        ]
    ),
    StepOutputs(
        [
            TokenDelta(
                "d",
                [1],
                "length",
                metrics=RequestMetrics(1.0, 1.5, 2.0, 3.0, 4, 1, 0, 0, "length"),
            )
        ],
        EngineSnapshot(1, 2, 0.5, 10, 20, 3, 64, 0, 100, 50),
    ),
    EngineReady(max_model_len=512, num_kv_blocks=100),
    EngineFailed(error="ModelLoadError: no config.json"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: object) -> None:
    assert decode(encode(message)) == message


def test_unknown_type_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown message type"):
        decode(b'{"type": "Pickle", "body": {}}')


def test_invalid_sampling_params_are_refused_on_decode() -> None:
    data = encode(AddRequest("a", [1], SamplingParams()))
    with pytest.raises(ValueError, match="temperature"):
        decode(data.replace(b'"temperature": 1.0', b'"temperature": -1'))


def _step(delta: dict) -> bytes:
    return json.dumps({"type": "StepOutputs", "body": {"deltas": [delta]}}).encode()


LP = {"token_id": 4, "logprob": -0.1}


@pytest.mark.parametrize(
    "delta, words",
    [
        ({"logprobs": [[4, -0.1, []]]}, "deltas[0].logprobs[0]: expected an object"),
        ({"logprobs": [{"token_id": 4}]}, "missing field(s) ['logprob']"),
        ({"logprobs": [{**LP, "token_id": -1}]}, "token_id must be"),
        ({"logprobs": [{**LP, "top": [[4]]}]}, "logprobs[0].top[0]: expected 2 items"),
        ({"logprobs": [{**LP, "top": [["4", 1.0]]}]}, "top[0][0]: expected an integer"),
        ({"logprobs": [{**LP, "rank": 1}]}, "unknown field"),
        ({"prompt_logprobs": LP}, "prompt_logprobs: expected a list"),
        ({"error": "x", "error_code": 200}, "error_code must be an HTTP error"),
        ({"new_token_ids": [True]}, "new_token_ids[0]: expected an integer"),
        ({"new_text": "x"}, "unknown field"),  # the engine sends no text
        ({"stop_reason": "x"}, "stop_reason: expected"),  # a stop token id, or none
    ],
)
def test_bad_deltas_are_refused_naming_the_field(delta: dict, words: str) -> None:
    """What the engine process sends is checked by the API server like any peer's frame: a
    malformed delta is a MessageError (the reader counts and drops it), never another error."""
    with pytest.raises(MessageError) as refused:
        decode(_step({"request_id": "a", **delta}))
    assert words in str(refused.value) and "engine" in str(refused.value)
