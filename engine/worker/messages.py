"""Engine <-> worker messages: the scheduler's per-step changes and the sampled tokens, as JSON."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ketch.engine.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from ketch.engine.sampling_params import SamplingParams


def encode_step(sched: SchedulerOutput) -> bytes:
    body = dataclasses.asdict(sched)
    body["finished_request_ids"] = sorted(sched.finished_request_ids)
    return json.dumps(body).encode()


def decode_step(data: bytes) -> SchedulerOutput:
    body: dict[str, Any] = json.loads(data)
    new = [
        NewRequestData(**{**n, "sampling_params": SamplingParams(**n["sampling_params"])})
        for n in body["new_requests"]
    ]
    return SchedulerOutput(
        new_requests=new,
        cached_requests=CachedRequestData(**body["cached_requests"]),
        num_scheduled_tokens=body["num_scheduled_tokens"],
        total_num_scheduled_tokens=body["total_num_scheduled_tokens"],
        finished_request_ids=set(body["finished_request_ids"]),
        preempted_request_ids=body["preempted_request_ids"],
    )


def encode_result(output: ModelRunnerOutput) -> bytes:
    return json.dumps(dataclasses.asdict(output)).encode()


def decode_result(data: bytes) -> ModelRunnerOutput:
    body = json.loads(data)
    logprobs = body["logprobs"]
    if logprobs is not None:
        logprobs = [None if lp is None else (lp[0], [tuple(x) for x in lp[1]]) for lp in logprobs]
    return ModelRunnerOutput(body["request_ids"], body["sampled_token_ids"], logprobs)
