"""The engine process: an ``LLMEngine`` running its step loop, fed and drained over ZMQ.

The API server binds two IPC sockets and spawns this process, which connects to them: requests
arrive on one (PUSH -> PULL), each step's deltas (token ids: the server makes the text) leave on
the other. HTTP work therefore never
stalls the step loop, and a crash here is seen by the server as a dead process, not a hang.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

import zmq

from ketch.engine.cache_manager.client import CacheManagerClient
from ketch.engine.config import EngineConfig
from ketch.engine.disagg.coordinator import PDCoordinator
from ketch.engine.engine_messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineReady,
    StepOutputs,
    TokenDelta,
    decode,
    encode,
    encode_step,
)
from ketch.engine.lifecycle import exit_with_parent
from ketch.engine.serving.config import ServerConfig
from ketch.engine.stats import EngineSnapshot
from ketch.engine.structured.compiler import UNUSABLE
from ketch.engine.wire import BadMessages, MessageError

if TYPE_CHECKING:  # paddle is imported only inside the engine process
    from ketch.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 100


def run_engine_process(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    worker_port: int | None = None,
    server: ServerConfig | None = None,
    parent_pid: int | None = None,
) -> None:
    """Process entry point: load the model, then serve until stopped (SIGTERM) or orphaned.

    With ``server`` (``ketch serve``) the engine also links to its cache manager on
    ``cache_queue_port`` (when the model runs in a worker, whose KV cache it can map) and, in a
    prefill or decode role, talks to its peers on ``pd_comm_port``. ``parent_pid``: the
    server's pid; its death sends this process SIGTERM (clean exit, worker and shared memory
    included)."""
    if parent_pid is not None:
        exit_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s engine: %(message)s")
    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)  # a dead server must not hold this process at exit
    requests = context.socket(zmq.PULL)
    requests.connect(input_addr)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)  # a start-up error still reaches the server: bounded
    outputs.connect(output_addr)
    try:
        _run(config, requests, outputs, worker_port, server)
    finally:
        requests.close()
        outputs.close()
        context.term()


def _run(
    config: EngineConfig,
    requests: zmq.Socket,
    outputs: zmq.Socket,
    worker_port: int | None,
    server: ServerConfig | None,
) -> None:
    # paddle's import installs a SIGTERM handler that reports a fatal error and dies at once:
    # import it first, then exit cleanly instead, through the finally blocks, which stop the
    # worker and remove the shared memory even while the model is still loading.
    from ketch.engine.llm_engine import LLMEngine

    signal.signal(signal.SIGTERM, _exit_once)
    try:
        engine = LLMEngine(config, worker_port)
    except Exception as exc:  # any start-up failure is reported, then the process exits
        outputs.send(encode(EngineFailed(error=f"{type(exc).__name__}: {exc}")))
        sys.exit(1)
    try:
        links = EngineLinks.create(engine, server)
    except Exception as exc:
        outputs.send(encode(EngineFailed(error=f"{type(exc).__name__}: {exc}")))
        engine.close()
        sys.exit(1)
    try:
        mc = engine.model_config
        rc = engine.runner_config
        ready = EngineReady(
            engine.max_model_len,
            engine.kv_cache.pool.num_blocks,
            mc.vocab_size,
            mc.hidden_size,
            dtype=rc.dtype,
            quantization=rc.quantization,
            kv_cache_dtype=rc.kv_cache_dtype,
            weight_bytes=engine.weight_bytes,
        )
        outputs.send(encode(ready))
        # Gauges (KV blocks, batch limits) are right from the start, before any request.
        outputs.send(encode(StepOutputs(deltas=[], snapshot=links.snapshot())))
        _serve(engine, links, requests, outputs)
    finally:
        links.close()
        engine.close()


def _exit_once(*_: object) -> None:
    """SIGTERM: leave through the finally blocks; a second SIGTERM (the server's, after the
    process group's) must not cut that clean-up short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(0)


class EngineLinks:
    """The engine's optional links: its cache manager and its prefill/decode peers."""

    def __init__(
        self, engine: LLMEngine, cache: CacheManagerClient | None, pd: PDCoordinator | None
    ) -> None:
        self.engine, self.cache, self.pd = engine, cache, pd
        self._preemptions = 0
        self._initial = [cache.socket] if cache else []

    @classmethod
    def create(cls, engine: LLMEngine, server: ServerConfig | None) -> EngineLinks:
        if server is None:
            return cls(engine, None, None)
        cache = None
        if engine.kv_layout.segment and engine.config.runner == "model":
            cache = CacheManagerClient(
                server.cache_queue_port,
                engine.kv_layout,
                on_attach=lambda slots: engine.kv_cache.attach_swap(cache, slots),
                on_detach=lambda _: _detached(engine, links),
            )
        elif server.role != "mixed":
            raise ValueError(
                f"role {server.role} moves KV blocks between instances, so the model must run "
                "in a worker with a shared KV cache (not --runner null)"
            )
        pd = PDCoordinator(engine, server, cache) if server.role != "mixed" else None
        links = cls(engine, cache, pd)
        return links

    def retired_sockets(self) -> list[zmq.Socket]:
        """Sockets to drop from the poller (and close): pd-comm peers no longer used."""
        return self.pd.take_retired_sockets() if self.pd else []

    def new_sockets(self) -> list[zmq.Socket]:
        """Sockets to add to the loop's poller: the cache link's at first, then the pd-comm
        ones as peers are first used."""
        sockets, self._initial = self._initial, []
        return sockets + (self.pd.take_new_sockets() if self.pd else [])

    @property
    def attached(self) -> bool:
        return self.cache is not None and self.cache.attached

    @property
    def busy(self) -> bool:
        return self.pd is not None and self.pd.num_waiting > 0

    def tick(self) -> list[TokenDelta]:
        if self.cache is not None:
            self.cache.tick()
        if self.pd is None:
            return []
        outputs, errors = self.pd.tick()
        return [*outputs, *errors]

    def failures(self) -> list[tuple[str, str]]:
        """Requests that failed alone; a peer's prefills are answered to that peer."""
        failures = self.engine.take_failures()
        if failures and self.pd is not None and self.pd.prefill is not None:
            failures = self.pd.prefill.on_failures(failures)
        return failures

    def after_step(self, outputs: list[TokenDelta]) -> None:
        if self.pd is None:
            return
        self.pd.on_step_outputs(outputs)
        # A prefill/decode instance never preempts silently: the request is recomputed here
        # (this engine has the whole model), which costs the prefill it was spared.
        preemptions = self.engine.scheduler.stats.num_preemptions
        if preemptions > self._preemptions:
            logger.warning(
                "%s instance out of KV blocks: %d running request(s) preempted and recomputed "
                "here; give it more KV cache memory or more replicas",
                self.pd.role,
                preemptions - self._preemptions,
            )
            self._preemptions = preemptions

    def snapshot(self) -> EngineSnapshot:
        return self.engine.snapshot(
            extra_waiting=self.pd.num_waiting if self.pd else 0,
            cache_attached=self.attached,
        )

    def close(self) -> None:
        if self.pd is not None:
            self.pd.close()
        if self.cache is not None:
            self.cache.close()


def _detached(engine: LLMEngine, links: EngineLinks) -> None:
    engine.kv_cache.detach_swap()
    if links.pd is not None:
        links.pd.on_cache_detached()


def _serve(
    engine: LLMEngine, links: EngineLinks, requests: zmq.Socket, outputs: zmq.Socket
) -> None:
    poller = zmq.Poller()
    poller.register(requests, zmq.POLLIN)
    bad_messages = BadMessages("engine")
    parent = os.getppid()
    while True:
        for socket in links.new_sockets():
            poller.register(socket, zmq.POLLIN)
        for socket in links.retired_sockets():
            poller.unregister(socket)
            socket.close(linger=0)
        busy = engine.has_unfinished_requests()
        events = dict(poller.poll(0 if busy else _IDLE_POLL_MS))
        if os.getppid() != parent:
            logger.warning("the server process is gone; the engine exits")
            return
        if not busy:
            engine.check_health()  # a dead worker ends this process (non-zero exit)
        deltas: list[TokenDelta] = []
        while events.get(requests) and requests.poll(0):
            data = requests.recv()
            try:
                message = decode(data)
            except MessageError as exc:  # the API server's bug, not a reason to stop serving
                bad_messages.note("api-server", exc)
                continue
            _apply(engine, links, message, deltas)
        if deltas and engine.has_unfinished_requests():  # answers go out before the step
            for frame in encode_step(deltas, None):
                outputs.send(frame)
            deltas = []
        before = (links.attached, engine.kv_cache.pool.num_free_blocks)
        deltas += links.tick()
        after = (links.attached, engine.kv_cache.pool.num_free_blocks)
        changed = bool(deltas) or events.get(requests) or links.busy or before != after
        if engine.has_unfinished_requests():
            step_outputs = engine.step()
            links.after_step(step_outputs)
            deltas += step_outputs
            for request_id, error in links.failures():  # one request's fault, not the engine's
                deltas.append(_failure(request_id, error))
            changed = True
        if changed:  # one frame, unless the step's output is over the frame budget
            for frame in encode_step(deltas, links.snapshot()):
                outputs.send(frame)


def _apply(
    engine: LLMEngine, links: EngineLinks, message: object, rejected: list[TokenDelta]
) -> None:
    if isinstance(message, AddRequest):
        try:
            if message.prefill_peer is not None:
                if links.pd is None:
                    raise ValueError("this instance is not in the decode role")
                if message.params.pooling is not None:
                    raise ValueError("an embedding request is computed here, not on a peer")
                request = engine.add_request(
                    message.request_id,
                    message.prompt_token_ids,
                    message.params,
                    message.final_only,
                    queue=False,
                )
                try:
                    links.pd.add_remote(request, message.prefill_peer)
                except ValueError:
                    engine.forget_request(request)  # refused: nothing of it stays here
                    raise
            else:
                engine.add_request(
                    message.request_id,
                    message.prompt_token_ids,
                    message.params,
                    message.final_only,
                )
        except ValueError as exc:  # PeerLimitError says 503
            code = getattr(exc, "status_code", 400)
            rejected.append(TokenDelta(message.request_id, error=str(exc), error_code=code))
    elif isinstance(message, AbortRequests):
        metrics = engine.abort_request(message.request_ids)
        if links.pd is not None:
            metrics += links.pd.abort(message.request_ids)
        for m in metrics:
            rejected.append(TokenDelta(request_id="", finish_reason="abort", metrics=m))
        if message.stopped:  # ended at a stop string by the API server
            rejected += engine.end_at_stop_strings(message.stopped)


def _failure(request_id: str, error: str) -> TokenDelta:
    """A request that failed alone: its grammar's fault is the sender's (400), the rest ours."""
    if error.startswith(UNUSABLE):
        return TokenDelta(request_id, error=error, error_code=400)
    return TokenDelta(request_id, error=f"internal error: {error}", error_code=500)
