"""Engine <-> worker messages: the scheduler's per-step changes and the sampled tokens.

Both travel in the tagged JSON of ``ketch.engine.wire``, decoded and checked by its one codec.
"""

from __future__ import annotations

from ketch.engine import wire
from ketch.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

_STEP = wire.registry(SchedulerOutput)
_RESULT = wire.registry(ModelRunnerOutput)


def encode_step(sched: SchedulerOutput) -> bytes:
    return wire.encode(sched)


def decode_step(data: bytes) -> SchedulerOutput:
    return wire.decode(data, _STEP, "engine-worker step")


def encode_result(output: ModelRunnerOutput) -> bytes:
    return wire.encode(output)


def decode_result(data: bytes) -> ModelRunnerOutput:
    return wire.decode(data, _RESULT, "engine-worker result")
