"""The wire format refuses NaN and infinities (security review L7).

Python's ``json`` reads ``NaN``, ``Infinity`` and ``-Infinity`` (and ``1e999`` as infinity) by
default; a ``PrefillRequest.expires_at`` of Infinity or NaN disabled the prefill deadline, and a
NaN logprob in ``PrefillDone`` became a 500 at the decode side. Every such frame is now a
``MessageError`` naming the protocol; and what the engine itself produces (logprobs of a token
the logits rule out, a broken pooled vector) never carries one.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from ketch.engine.core.scheduler_output import ModelRunnerOutput
from ketch.engine.disagg import messages as pd
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.wire import MessageError
from ketch.engine.worker import messages as worker
from ketch.engine.worker import sampler
from ketch.engine.worker.model_runner import ModelRunner
from ketch.engine.worker.sampler import SamplingState, prompt_logprobs, sample

KV = {"num_layers": 2, "kv_heads": 2, "num_blocks": 10, "block_size": 16, "head_dim": 8}


def _frame(kind: str, body: dict, literal: str | None = None) -> bytes:
    text = json.dumps({"type": kind, "body": body})  # allow_nan: writes NaN, Infinity
    return (text.replace('"@@"', literal) if literal else text).encode()


def _prefill_request(expires_at) -> dict:
    request = pd.PrefillRequest(
        1, "r", [1, 2], SamplingParams(), 0, "m", pd.KVLayout(**KV), "h:1", [3], 0
    )
    body = json.loads(pd.encode(request))["body"]
    body["expires_at"] = expires_at
    return body


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), float("-inf"), "@@"], ids=["nan", "inf", "-inf", "1e999"]
)
def test_a_prefill_deadline_that_is_not_finite_is_refused(value) -> None:
    frame = _frame("PrefillRequest", _prefill_request(value), "1e999")
    with pytest.raises(MessageError, match=r"malformed prefill/decode message: .*finite"):
        pd.decode(frame)
    assert pd.decode(_frame("PrefillRequest", _prefill_request(1.5e9))).expires_at == 1.5e9


@pytest.mark.parametrize("value", [float("nan"), float("-inf")], ids=["nan", "-inf"])
def test_a_logprob_that_is_not_finite_is_refused(value) -> None:
    done = {"request_id": "r", "token_id": 3, "logprob": {"token_id": 3, "logprob": value}}
    with pytest.raises(MessageError, match="finite"):
        pd.decode(_frame("PrefillDone", done))
    result = {"request_ids": ["r"], "sampled_token_ids": [3]}
    result["logprobs"] = [{"token_id": 3, "logprob": -0.5, "top": [[3, value]]}]
    with pytest.raises(MessageError, match=r"malformed engine-worker result message: .*finite"):
        worker.decode_result(_frame("ModelRunnerOutput", result))


def test_a_constant_anywhere_is_refused() -> None:
    """Not only in float fields: NaN where an int or a string belongs is no message either."""
    for body in ({"request_id": "r", "token_id": float("nan")}, {"request_id": float("inf")}):
        with pytest.raises(MessageError, match="finite"):
            pd.decode(_frame("PrefillDone", body))


def test_logprobs_the_engine_reports_are_always_finite() -> None:
    """A token the logits rule out (-inf) or broken logits (NaN) are reported as the floor, so
    the worker's result still travels."""
    logits = np.full((2, 8), -np.inf, dtype=np.float32)
    logits[0, 2] = 1.0
    logits[1, :] = np.nan
    states = [
        SamplingState.create(SamplingParams(temperature=0, logprobs=3), [1], 1, 0, ())
        for _ in range(2)
    ]
    tokens, logprobs = sample(logits, states)
    assert tokens[0] == 2 and logprobs[0].logprob == 0.0
    values = [lp.logprob for lp in logprobs] + [v for lp in logprobs for _, v in lp.top]
    assert all(np.isfinite(values)) and sampler.LOGPROB_FLOOR in values
    scored = prompt_logprobs(logits, [2, 5], 2)
    assert all(np.isfinite([s.logprob for s in scored] + [v for s in scored for _, v in s.top]))
    result = ModelRunnerOutput(["a", "b"], tokens, logprobs, prompt_logprobs={"a": scored})
    assert worker.decode_result(worker.encode_result(result)) == result


def test_a_pooled_vector_that_is_not_finite_fails_its_request_in_the_worker() -> None:
    forgotten: list[str] = []
    runner = SimpleNamespace(_forget=forgotten.append)
    failed: dict[str, str] = {}
    pooled = {"good": [0.5, 1.0], "bad": [0.5, float("nan")]}
    kept = ModelRunner._finite_only(runner, pooled, failed)
    assert kept == {"good": [0.5, 1.0]}
    assert failed == {"bad": "the pooled hidden state is not finite"} and forgotten == ["bad"]
    output = ModelRunnerOutput([], [], pooled=kept, failed=failed)
    assert worker.decode_result(worker.encode_result(output)) == output
