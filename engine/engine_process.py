"""The engine process: an ``LLMEngine`` running its step loop, fed and drained over ZMQ.

The API server binds two IPC sockets and spawns this process, which connects to them: requests
arrive on one (PUSH -> PULL), each step's deltas leave on the other. HTTP work therefore never
stalls the step loop, and a crash here is seen by the server as a dead process, not a hang.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

import zmq

from ketch.engine.config import EngineConfig
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
from ketch.engine.outputs import RequestOutput

if TYPE_CHECKING:  # paddle is imported only inside the engine process
    from ketch.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 100


def run_engine_process(
    config: EngineConfig, input_addr: str, output_addr: str, worker_port: int | None = None
) -> None:
    """Process entry point: load the model, then serve until stopped (SIGTERM) or orphaned."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s engine: %(message)s")
    context = zmq.Context()
    requests = context.socket(zmq.PULL)
    requests.connect(input_addr)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_addr)
    try:
        from ketch.engine.llm_engine import LLMEngine

        engine = LLMEngine(config, worker_port)
    except Exception as exc:  # any start-up failure is reported, then the process exits
        outputs.send(encode(EngineFailed(error=f"{type(exc).__name__}: {exc}")))
        outputs.close(linger=2000)
        sys.exit(1)
    # After paddle's import, which installs a handler that reports SIGTERM as a fatal error:
    # exit cleanly instead, through the finally below, which stops the worker.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        outputs.send(encode(EngineReady(engine.max_model_len, engine.kv_cache.pool.num_blocks)))
        # Gauges (KV blocks, batch limits) are right from the start, before any request.
        outputs.send(encode(StepOutputs(deltas=[], snapshot=engine.snapshot())))
        _serve(engine, requests, outputs)
    finally:
        engine.close()


def _serve(engine: LLMEngine, requests: zmq.Socket, outputs: zmq.Socket) -> None:
    poller = zmq.Poller()
    poller.register(requests, zmq.POLLIN)
    parent = os.getppid()
    while True:
        busy = engine.has_unfinished_requests()
        events = dict(poller.poll(0 if busy else _IDLE_POLL_MS))
        if os.getppid() != parent:
            logger.warning("the server process is gone; the engine exits")
            return
        if not busy:
            engine.check_health()  # a dead worker ends this process (non-zero exit)
        deltas: list[RequestDelta] = []
        changed = False
        while events.get(requests) and requests.poll(0):
            _apply(engine, decode(requests.recv()), deltas)
            changed = True
        if engine.has_unfinished_requests():
            deltas += [_delta(o) for o in engine.step()]
            changed = True
        if changed:
            outputs.send(encode(StepOutputs(deltas=deltas, snapshot=engine.snapshot())))


def _apply(engine: LLMEngine, message: object, rejected: list[RequestDelta]) -> None:
    if isinstance(message, AddRequest):
        try:
            engine.add_request(
                message.request_id, message.prompt_token_ids, message.params, message.final_only
            )
        except ValueError as exc:
            rejected.append(RequestDelta(request_id=message.request_id, error=str(exc)))
    elif isinstance(message, AbortRequests):
        for metrics in engine.abort_request(message.request_ids):
            rejected.append(RequestDelta(request_id="", finish_reason="abort", metrics=metrics))


def _delta(output: RequestOutput) -> RequestDelta:
    completion = output.outputs[0]
    new = completion.delta_token_ids
    logprobs = None
    if completion.logprobs is not None and new:
        logprobs = [(lp.token_id, lp.logprob, lp.top) for lp in completion.logprobs[-len(new) :]]
    return RequestDelta(
        request_id=output.request_id,
        new_token_ids=new,
        new_text=completion.delta_text,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        num_prompt_tokens=len(output.prompt_token_ids),
        num_cached_tokens=output.num_cached_tokens,
        logprobs=logprobs,
        metrics=output.metrics,
    )
