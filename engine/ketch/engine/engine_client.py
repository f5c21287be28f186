"""The API server's handle on the engine process: start it, stream requests through it.

``EngineClient`` spawns the engine process, binds the two IPC sockets in the private run
directory (``ketch.engine.rundir``; a killed run's stale socket files are replaced), and
routes each step's deltas to per-request asyncio queues. The engine sends token ids; their text
is made here (``OutputProcessor``: detokenizer, stop strings), and a request whose text reaches
a stop string is ended in the engine at once. If the engine process dies, every open
request gets an error delta at once and ``is_alive`` turns False, so the server can report
unhealthy and exit instead of hanging. A frame from the engine that is refused (too large,
malformed) fails every open request it names, which the engine is told to abort, so none of
them waits for output that will not come.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import zmq
import zmq.asyncio

from ketch.engine import rundir
from ketch.engine.config import EngineConfig
from ketch.engine.engine_messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineReady,
    StepOutputs,
    TokenDelta,
    decode,
    encode,
    join_pieces,
)
from ketch.engine.engine_process import run_engine_process
from ketch.engine.models.paths import resolve_model_path
from ketch.engine.output_processor import OutputProcessor
from ketch.engine.outputs import RequestDelta
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.serving.config import ServerConfig
from ketch.engine.stats import EngineSnapshot, RequestMetrics
from ketch.engine.tokenizer import Tokenizer
from ketch.engine.wire import BadMessages, MessageError
from ketch.engine.worker.shm import remove_segments

logger = logging.getLogger(__name__)

_LIVENESS_POLL_S = 0.5
# A request id as json.dumps writes one in a frame (a quote inside any text is escaped, so a
# generated text cannot forge one).
_REQUEST_ID = re.compile(rb'"request_id": ?"([^"\\]{1,256})"')


class EngineDeadError(RuntimeError):
    """The engine process is gone; requests cannot be served."""


def ipc_addresses(port: int, run_dir: Path | None = None) -> tuple[str, str]:
    """Socket paths derived from the server's port, so two servers on one host never clash."""
    return rundir.api_addresses(port, run_dir)


class EngineClient:
    """Runs one engine process and multiplexes requests over it."""

    def __init__(
        self,
        config: EngineConfig,
        port: int,
        run_dir: Path | None = None,
        worker_port: int | None = None,
        server: ServerConfig | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """``worker_port``: run the model in a separate worker process fed over that port.
        ``server``: the instance's settings (cache manager and prefill/decode links).
        ``tokenizer``: the model's, for the text (loaded once the engine is up if not given)."""
        self.config = config
        self.worker_port = worker_port
        self.server = server
        self.last_snapshot: EngineSnapshot | None = None
        self.port = port
        self.input_addr, self.output_addr = ipc_addresses(port, run_dir)
        self._context = zmq.asyncio.Context()
        self._requests = self._context.socket(zmq.PUSH)
        self._outputs = self._context.socket(zmq.PULL)
        self._queues: dict[str, asyncio.Queue[RequestDelta]] = {}
        self._pieces: dict[str, list[TokenDelta]] = {}  # a cut delta's pieces so far
        self._tokenizer = tokenizer
        self.processor: OutputProcessor | None = None  # once started
        self._process: multiprocessing.process.BaseProcess | None = None
        self._reader: asyncio.Task[None] | None = None
        self.bad_messages = BadMessages("api-server")
        self.ready: EngineReady | None = None
        self.dead_reason: str | None = None
        # Called with each EngineSnapshot the engine sends (the server feeds its metrics).
        self.on_snapshot: Callable[[EngineSnapshot], None] | None = None
        # Called with the metrics of every request that ends, aborted ones included.
        self.on_finished: Callable[[RequestMetrics], None] | None = None

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self._process is not None and self._process.is_alive()

    async def start(self, timeout: float = 300.0) -> EngineReady:
        """Spawns the engine and waits until its model is loaded; raises if it cannot start."""
        for addr in (self.input_addr, self.output_addr):
            rundir.claim(addr, f"the API server's engine socket for --port {self.port}")
        self._requests.bind(self.input_addr)
        self._outputs.bind(self.output_addr)
        spawn = multiprocessing.get_context("spawn")
        self._process = spawn.Process(
            target=run_engine_process,
            args=(self.config, self.input_addr, self.output_addr, self.worker_port, self.server),
            kwargs={"parent_pid": os.getpid()},  # SIGTERM reaches it when this process dies
            name="ketch-engine",
            daemon=False,  # it has a worker child; it exits by itself when this process goes
        )
        self._process.start()
        message = await self._first_message(timeout)
        if not isinstance(message, EngineReady):
            await self.shutdown()
            error = message.error if isinstance(message, EngineFailed) else repr(message)
            raise RuntimeError(f"the engine failed to start: {error}")
        self.ready = message
        tokenizer = self._tokenizer or Tokenizer(resolve_model_path(self.config.model))
        self.processor = OutputProcessor(tokenizer)
        self._reader = asyncio.create_task(self._read_outputs())
        return message

    async def _first_message(self, timeout: float) -> object:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            if await self._outputs.poll(int(_LIVENESS_POLL_S * 1000)):
                return decode(await self._outputs.recv())
            if not self._process or not self._process.is_alive():
                raise RuntimeError("the engine process exited during start-up")
        raise TimeoutError(f"the engine did not become ready within {timeout:.0f} s")

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        final_only: bool = False,
        prefill_peer: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Streams a request's deltas (with their text) until it finishes; aborts it if the
        caller stops early. ``final_only``: one delta, at the end.

        ``prefill_peer`` (decode role): the prefill peer's pd-comm "host:port"."""
        if not self.is_alive or self.processor is None:
            raise EngineDeadError(self.dead_reason or "the engine process is not running")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        processor = self.processor
        engine_final_only = processor.add_request(request_id, prompt_token_ids, params, final_only)
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            add = AddRequest(request_id, prompt_token_ids, params, engine_final_only, prefill_peer)
            await self._requests.send(encode(add))
            while not finished:
                delta = _coalesce(await queue.get(), queue)
                finished = delta.finished
                yield delta
        finally:
            self._queues.pop(request_id, None)
            self._pieces.pop(request_id, None)
            stopping = processor.is_stopping(request_id)  # being ended already
            processor.drop(request_id)
            if not finished and not stopping and self.is_alive:
                await self.abort([request_id])

    async def abort(self, request_ids: list[str], stopped: dict[str, int] | None = None) -> None:
        """Ends engine requests: ``request_ids`` aborted, ``stopped`` ended at a stop string
        after that many output tokens."""
        await self._requests.send(encode(AbortRequests(request_ids, stopped or {})))

    async def _read_outputs(self) -> None:
        while True:
            if await self._outputs.poll(int(_LIVENESS_POLL_S * 1000)):
                # Take everything already queued in one go: one event-loop wake-up per batch
                # of engine steps, not per step.
                while True:
                    try:
                        data = self._outputs.recv(zmq.NOBLOCK).result()
                    except zmq.Again:
                        break
                    lost = self._take(data)
                    failed, stopped = self.processor.take_aborts() if self.processor else ([], {})
                    if lost or failed or stopped:  # nobody would read their output
                        await self.abort(lost + failed, stopped)
            elif not self._process or not self._process.is_alive():
                code = self._process.exitcode if self._process else None
                self._fail_all(f"the engine process exited (exit code {code})")
                return

    def _take(self, data: bytes) -> list[str]:
        """Routes one frame from the engine. A refused one (too large, malformed) is counted
        and dropped, never the end of the reader; each open request it names fails at once
        (its output is lost). Returns those requests' ids."""
        try:
            message = decode(data)
        except MessageError as exc:
            self.bad_messages.note("the engine process", exc)
            return self._fail_named(data, exc)
        self._dispatch(message)
        return []

    def _fail_named(self, data: bytes, exc: MessageError) -> list[str]:
        named = {m.decode("ascii", "replace") for m in _REQUEST_ID.findall(bytes(data))}
        lost = sorted(rid for rid in named if rid in self._queues)
        if lost:
            logger.error(
                "a refused engine frame carried %d open request(s): failing them", len(lost)
            )
        reason = f"its output from the engine was lost ({str(exc)[:200]})"
        for request_id in named:  # their engine end may have been in it: none will come
            if self.processor is not None:
                self.processor.forget(request_id)
        for request_id in lost:
            self._pieces.pop(request_id, None)
            self._queues[request_id].put_nowait(
                RequestDelta(request_id=request_id, error=reason, error_code=500)
            )
        return lost

    def _dispatch(self, message: object) -> None:
        if not isinstance(message, StepOutputs):
            return
        if message.snapshot is not None:
            self.last_snapshot = message.snapshot
            if self.on_snapshot is not None:
                self.on_snapshot(message.snapshot)
        # Around a delta cut into pieces (rare): its pieces are held, then queued joined.
        cut = set(message.continued) if message.continued or self._pieces else None
        processor = self.processor
        for delta in message.deltas:
            if cut is not None and delta.request_id in self._queues:
                joined = self._join(delta, delta.request_id in cut)
                if joined is None:
                    continue
                delta = joined
            # The text (None: not to be handed out); a stop string corrects the metrics.
            out = processor.process(delta) if processor is not None else None
            if delta.metrics is not None and self.on_finished is not None:
                self.on_finished(delta.metrics)
            queue = self._queues.get(delta.request_id)
            if queue is not None and out is not None:
                queue.put_nowait(out)

    def _join(self, delta: TokenDelta, continued: bool) -> TokenDelta | None:
        """The whole delta once its last piece is here (None before); others pass through."""
        held = self._pieces.get(delta.request_id)
        if continued:
            if held is None:
                self._pieces[delta.request_id] = [delta]
            else:
                held.append(delta)
            return None
        if held is None:
            return delta
        del self._pieces[delta.request_id]
        return join_pieces([*held, delta])

    def _fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        logger.error("%s; failing %d open requests", reason, len(self._queues))
        self._pieces.clear()
        if self.processor is not None:
            self.processor.clear()
        for request_id, queue in self._queues.items():
            queue.put_nowait(RequestDelta(request_id=request_id, error=reason, error_code=503))

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine process and removes the socket files."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._process is not None and self._process.is_alive():
            self._process.terminate()
            await asyncio.to_thread(self._process.join, timeout)
            if self._process.is_alive():
                self._process.kill()
        self._requests.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        for addr in (self.input_addr, self.output_addr):
            rundir.release(addr)
        if self.worker_port is not None:
            remove_segments(self.worker_port)  # the engine may have died before it could


def _coalesce(delta: RequestDelta, queue: asyncio.Queue[RequestDelta]) -> RequestDelta:
    """Folds deltas that queued up while the consumer was busy into one.

    Under load the engine steps faster than a client can be written to; sending what piled up
    as one update keeps per-token overhead from growing with the backlog.
    """
    if delta.finished or queue.empty():
        return delta
    pending = [delta]
    while not pending[-1].finished and not queue.empty():
        nxt = queue.get_nowait()
        if nxt.error is not None:
            return nxt
        pending.append(nxt)
    last = pending[-1]
    logprobs = None
    if any(d.logprobs is not None for d in pending):
        logprobs = [lp for d in pending for lp in d.logprobs or ()]
    return RequestDelta(
        request_id=delta.request_id,
        new_token_ids=[t for d in pending for t in d.new_token_ids],
        new_text="".join(d.new_text for d in pending),
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_cached_tokens=last.num_cached_tokens,
        logprobs=logprobs,
        prompt_logprobs=next(
            (d.prompt_logprobs for d in pending if d.prompt_logprobs is not None), None
        ),
        metrics=last.metrics,
        embedding=last.embedding,
    )
