"""The one codec every internal protocol decodes with (``ketch.engine.wire``).

Every message class of every protocol round-trips; every kind of bad frame is a MessageError
naming the protocol and the field (never another exception), from hand-written extreme cases
and from a few thousand seeded hostile frames shaped after the real classes.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hostile import frames

from ketch.engine import engine_messages, wire
from ketch.engine.cache_manager import protocol as cm
from ketch.engine.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from ketch.engine.disagg import messages as pd
from ketch.engine.outputs import TokenLogprob
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.worker import messages as worker

LAYOUT = cm.KVLayout(num_layers=2, kv_heads=2, num_blocks=10, block_size=16, head_dim=8)
PARAMS = SamplingParams(temperature=0.7, stop=["x"], stop_token_ids=[3], seed=2**64 - 1)
PROTOCOLS = {  # protocol -> (decode, unused, its message classes)
    "engine": (engine_messages.decode, None, list(engine_messages._TYPES.values())),
    "prefill/decode": (pd.decode, None, list(pd._TYPES.values())),
    "cache-manager": (cm.decode, None, list(cm._TYPES.values())),
    "engine-worker step": (worker.decode_step, None, [SchedulerOutput]),
    "engine-worker result": (worker.decode_result, None, [ModelRunnerOutput]),
}  # fmt: skip


def test_steps_and_results_round_trip() -> None:
    step = SchedulerOutput(
        new_requests=[NewRequestData("a", [1, 2, 3], 3, [4, 5], 0, PARAMS, seed=7)],
        cached_requests=CachedRequestData(["b"], [[6]], [True], [16]),
        num_scheduled_tokens={"a": 3, "b": 1},
        total_num_scheduled_tokens=4,
        finished_request_ids={"c", "d"},
        preempted_request_ids=["e"],
    )
    assert worker.decode_step(worker.encode_step(step)) == step
    scored = {"a": [TokenLogprob(2, -3.5, [(7, -0.2)])]}
    logprobs = [TokenLogprob(5, -0.5, [(5, -0.5), (9, -1.5)]), None]
    result = ModelRunnerOutput(["a", "b"], [5, 6], logprobs, prompt_logprobs=scored)
    assert worker.decode_result(worker.encode_result(result)) == result
    assert worker.decode_result(worker.encode_result(ModelRunnerOutput([], []))).logprobs is None


def test_pd_and_cache_manager_messages_round_trip() -> None:
    for message in [
        pd.PrefillRequest(1, "r", [1, 2], PARAMS, 2**63, "m", LAYOUT, "h:1", [3, 4], 0, "e"),
        pd.PrefillDone("r", 5, TokenLogprob(5, -0.1, [(5, -0.1)]), 16, 1024, 0.5, 1.7e9),
        pd.PrefillDone("r", 5, prompt_logprobs=[TokenLogprob(2, -3.5, [(7, -0.2)])]),
        pd.PrefillFailed("r", "no", 503),
        cm.Swap(3, [(1, 2)], [(3, 4)]),
        cm.TransferHeader(2, "r", LAYOUT, [1, 2], "e", "n" * 32, layers=[0, 1], part=0, parts=1),
    ]:
        module = pd if type(message).__module__ == pd.__name__ else cm
        assert module.decode(module.encode(message)) == message


def test_encode_writes_what_asdict_would() -> None:
    """encode walks dataclasses shallowly (json does the rest); the bytes are those of
    ``dataclasses.asdict`` (sets sorted), so any peer reads them as before."""
    messages = [
        SchedulerOutput(
            [NewRequestData("a", [1, 2], 2, [4], 0, PARAMS, seed=7)],
            CachedRequestData(["b"], [[6]], [True], [16]), {"a": 2, "b": 1}, 3, {"d", "c"},
        ),
        ModelRunnerOutput(["a"], [5], [(-0.5, [(5, -0.5)])], {"a": [(-1.0, [(2, -0.1)])]}),
        pd.PrefillRequest(
            1, "r", [1, 2], PARAMS, 2**63, "m", LAYOUT, "h:1", [3, 4], 0, "e"
        ),
        pd.PrefillDone("r", 5, TokenLogprob(5, -0.1, [(5, -0.1)]), 16),
        cm.Swap(3, [(1, 2)], [(3, 4)]),
        engine_messages.StepOutputs([engine_messages.TokenDelta("a", [1])]),
    ]  # fmt: skip

    def plain(value: object) -> object:
        if isinstance(value, set | frozenset):
            return sorted(value)
        raise TypeError

    for message in messages:
        body = dataclasses.asdict(message)
        want = json.dumps({"type": type(message).__name__, "body": body}, default=plain)
        assert wire.encode(message) == want.encode()
    with pytest.raises(TypeError):
        wire.encode({"type": "PdPing", "body": {}})


def _tagged(kind: str, body: object) -> bytes:
    return json.dumps({"type": kind, "body": body}).encode()


@pytest.mark.parametrize(
    "data, words",
    [
        (b"\xff\xfe", "not json"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b"[]", "type"),
        (_tagged("Nope", {}), "unknown message type"),
        (json.dumps({"type": ["x"], "body": {}}).encode(), "unknown message type"),
        (_tagged("PdPing", {"request_ids": [["unhashable"]]}), "request_ids[0]"),
        (_tagged("PdPing", {"request_ids": "abc"}), "expected a list"),
        (_tagged("AbortPrefill", {"request_id": {"a": 1}}), "request_id"),
        (_tagged("AbortPrefill", {}), "missing field"),
        (_tagged("AbortPrefill", {"request_id": "r", "extra": 1}), "unknown field"),
        (_tagged("PrefillDone", {"request_id": "r", "token_id": "5"}), "token_id"),
        (_tagged("PrefillDone", {"request_id": "r", "token_id": True}), "token_id"),
        (_tagged("PrefillDone", {"request_id": "r", "token_id": 10**30}), "64-bit"),
        (_tagged("PrefillDone", {"request_id": "r", "token_id": 1, "finished_at": "x"}), "at"),
        (_tagged("PrefillDone", {"request_id": "r", "token_id": 1, "logprob": [1.0]}), "logprob"),
        (_tagged("PrefillDone", {"request_id": "r", "token_id": 1, "logprob": [-1.0, []]}),
         "logprob: expected an object"),
        (_tagged("PrefillDone", {"request_id": "r", "token_id": 1,
                                 "logprob": {"token_id": 2, "logprob": -1.0}}), "of token 2"),
        (_tagged("PrefillDone", {"request_id": "r", "token_id": 1,
                                 "logprob": {"token_id": 1, "logprob": "x"}}), "logprob.logprob"),
        (_tagged("PrefillDone", {"request_id": "r", "token_id": 1,
                                 "logprob": {"token_id": 1, "logprob": -1.0, "top": [[1]]}}),
         "logprob.top[0]: expected 2 items"),
        (_tagged("PrefillDone", {"request_id": "r", "token_id": 1,
                                 "prompt_logprobs": [{"token_id": -4, "logprob": -1.0}]}),
         "prompt_logprobs[0]: token_id must be >= 0"),
        (_tagged("PrefillDone", {"request_id": "r", "token_id": 1,
                                 "prompt_logprobs": [{"logprob": -1.0}]}), "missing field"),
        (_tagged("PrefillFailed", {"request_id": "r", "error": "", "status_code": 200}), "status"),
        (_tagged("PrefillFailed", {"request_id": "r", "error": "", "status_code": 10**9}), "code"),
    ],
)  # fmt: skip
def test_bad_frames_are_message_errors_naming_the_problem(data: bytes, words: str) -> None:
    with pytest.raises(wire.MessageError) as refused:
        pd.decode(data)
    assert "prefill/decode" in str(refused.value)
    assert words.lower() in str(refused.value).lower()


def test_sampling_params_ranges_are_checked_on_decode() -> None:
    body = json.loads(pd.encode(
        pd.PrefillRequest(1, "r", [1], PARAMS, 1, "m", LAYOUT, "h:1", [1], 0)
    ))["body"]  # fmt: skip
    for field, value in [("seed", 2**64), ("top_p", 5), ("n", 0), ("stop_token_ids", [-1])]:
        broken = {**body, "params": {**body["params"], field: value}}
        with pytest.raises(wire.MessageError, match=field):
            pd.decode(_tagged("PrefillRequest", broken))
    with pytest.raises(wire.MessageError, match="seed"):
        pd.decode(_tagged("PrefillRequest", {**body, "seed": 2**64}))


def test_frame_size_limits() -> None:
    huge = _tagged("PdPing", {"request_ids": ["x" * 1000] * (pd.MAX_PD_MESSAGE_BYTES // 1000)})
    with pytest.raises(wire.MessageError, match="limit"):
        pd.decode(huge)
    with pytest.raises(wire.MessageError, match="bytes"):
        pd.decode("not bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_thousands_of_hostile_frames_only_ever_raise_message_errors(protocol: str) -> None:
    decode, _, kinds = PROTOCOLS[protocol]
    refused = accepted = 0
    for message in frames(kinds, seed=hash(protocol) % 1000, count=1500):
        for frame in message:
            try:
                decoded = decode(frame)
            except wire.MessageError:
                refused += 1
            else:
                accepted += 1
                assert type(decoded) in kinds
    assert refused > 1000, (refused, accepted)
