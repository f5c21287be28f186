"""Engine <-> server messages survive encode/decode unchanged, and bad input is refused."""

from __future__ import annotations

import pytest

from ketch.engine.core.messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineReady,
    RequestDelta,
    StepOutputs,
    decode,
    encode,
)
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.stats import EngineSnapshot, RequestMetrics

MESSAGES = [
    AddRequest("a", [1, 2, 3], SamplingParams(temperature=0.5, stop=["x"], seed=3), True),
    AbortRequests(["a", "b"]),
    StepOutputs(
        [
            RequestDelta("a", [4, 5], "hé", None, None, 3, 0, [(4, -0.1, [(4, -0.1), (9, -2.0)])]),
            RequestDelta("b", finish_reason="stop", stop_reason="x"),
            RequestDelta("c", error="prompt is empty"),
        ]
    ),
    StepOutputs(
        [
            RequestDelta(
                "d",
                [1],
                "x",
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
