"""``ketch serve``: start the engine process and the HTTP server, and own their lifecycle.

- Ports are checked before anything starts; a busy one is a one-line error naming the flag.
- SIGTERM drains: /ready turns 503, new requests get 503, in-flight ones get up to
  ``--drain-timeout`` seconds, then the engine stops and the process exits 0.
- If the engine process dies, /health turns 503 at once and the process exits 1 shortly after,
  so Kubernetes restarts the pod instead of leaving it hanging.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response

from ketch.engine.capabilities import precision_line
from ketch.engine.config import EngineConfig
from ketch.engine.engine_client import EngineClient
from ketch.engine.metrics import EngineMetrics
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.paths import resolve_model_path
from ketch.engine.peer_auth import require_peer_key
from ketch.engine.ports import Listener, check_free
from ketch.engine.serving import reasoning
from ketch.engine.serving.admission import local_admin_key
from ketch.engine.serving.api_server import create_app
from ketch.engine.serving.config import ServerConfig
from ketch.engine.serving.pairing import PrefillPeers
from ketch.engine.serving.state import ServingState
from ketch.engine.serving.uvicorn_server import make_server, stop_event
from ketch.engine.tokenizer import RELEASE_GIL_CHARS, Tokenizer

logger = logging.getLogger("ketch.serve")

_WATCH_INTERVAL_S = 0.5
_EXIT_ENGINE_DIED = 1
_DEATH_GRACE_S = 3.0
_SWITCH_INTERVAL_S = 0.001


def check_ports(config: ServerConfig) -> None:
    """Fails fast, naming the flag, if a port this instance binds is taken."""
    check_free(listeners(config))


def listeners(config: ServerConfig) -> dict[int, Listener]:
    """``{port: Listener}`` for the TCP ports ``ketch serve`` binds. The worker and cache queues
    are Unix sockets in the private run directory (``ketch.engine.rundir``), not ports."""
    ports = {config.port: Listener("--port", config.host, API_PROBE_PATHS)}
    if config.metrics_port is not None:
        ports[config.metrics_port] = Listener("--metrics-port", config.host, METRICS_PROBE_PATHS)
    if config.role != "mixed":
        ports[config.pd_comm_port] = Listener("--pd-comm-port", config.host)
    return ports


def read_api_key(config: ServerConfig) -> str | None:
    return _read_key(config.api_key_file, "--api-key-file", "KETCH_API_KEY")


def read_admin_key(config: ServerConfig) -> str | None:
    return _read_key(config.admin_key_file, "--admin-key-file", "KETCH_ADMIN_KEY")


def _read_key(file: str | None, flag: str, env: str) -> str | None:
    if file:
        path = Path(file)
        if not path.is_file():
            raise ValueError(f"{flag} {path} does not exist")
        key = path.read_text().strip()
        if not key:
            raise ValueError(f"{flag} {path} is empty")
        return key
    # as from a file: a Secret written with a trailing newline must not make every request a 401
    key = os.environ.get(env, "").strip()
    if os.environ.get(env) and not key:
        raise ValueError(f"${env} is set but holds only whitespace")
    return key or None


async def serve(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Runs until SIGTERM/SIGINT (returns 0) or until the engine dies (returns 1)."""
    check_ports(config)
    tracing = _start_tracing(config.otlp_traces_endpoint, "ketch-serve")
    api_key, admin_key = read_api_key(config), read_admin_key(config)
    if admin_key is None:  # /pause and /resume never trust the client's address
        admin_key, where = local_admin_key(f"admin-key-{config.port}")
        logger.info("no --admin-key-file: /pause and /resume need the admin key in %s", where)
    if config.role != "mixed":  # a missing or bad key fails here, before the model loads
        require_peer_key(
            config.peer_key_file, config.insecure_no_peer_key, f"the {config.role} role"
        )
    model_path = resolve_model_path(engine_config.model)
    # The checkpoint's architecture and fields first: the clearest error for a model Ketch does
    # not serve, before the tokenizer or the engine's processes are started.
    ModelConfig.from_dir(model_path, context_len=engine_config.max_model_len)
    tokenizer = Tokenizer(model_path)
    reasoning_parser = _reasoning_parser(config, tokenizer)
    name = config.served_model_name or engine_config.model
    engine = EngineClient(
        engine_config,
        config.port,
        worker_port=config.engine_worker_queue_port,
        server=config,
        tokenizer=tokenizer,
    )
    logger.info("starting the engine for %s", model_path)
    ready = await engine.start()
    state = ServingState(
        config=config,
        engine=engine,
        tokenizer=tokenizer,
        model_name=name,
        metrics=EngineMetrics(name),
        max_model_len=ready.max_model_len,
        vocab_size=ready.vocab_size,
        hidden_size=ready.hidden_size,
        api_key=api_key,
        admin_key=admin_key,
        prefill_peers=PrefillPeers(config.pd_prefill_peers, config.pd_comm_port),
        reasoning_parser=reasoning_parser,
    )
    state.metrics.set_model(
        ready.dtype, ready.quantization, ready.kv_cache_dtype, ready.weight_bytes
    )
    state.metrics.set_block_size(engine_config.block_size)
    precision = precision_line(ready.dtype, ready.quantization, ready.kv_cache_dtype)
    logger.info("%s: %s; %.1f MiB of weights in all", name, precision, ready.weight_bytes / 2**20)
    engine.on_snapshot = state.metrics.update
    engine.on_finished = state.metrics.observe_finished
    app = create_app(state)
    if tracing is not None:
        from ketch.engine.serving import trace_spans

        trace_spans.install(app, tracing, name)
    server = make_server(app, config.host, config.port, config.drain_timeout)
    # tokenizers' thread pool starts with its first long text, and its threads keep the
    # priority of the thread that started it: start it from a (lower-priority) offload thread.
    await state.text_jobs.run(tokenizer.encode, "warm up " * (RELEASE_GIL_CHARS // 8 + 1))
    # Everything built so far lives as long as the process: the collector need not scan it
    # again. A full collection then looks at requests' objects only (a 1 MiB JSON body makes
    # ~60 k of them: one full scan of the whole heap meanwhile held the event loop ~50 ms).
    gc.collect()
    gc.freeze()
    # Long chats are rendered on a thread (jinja is Python: it holds the GIL); the event loop
    # gets the GIL back within this interval (default 5 ms) each time it needs it.
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    stop = stop_event()
    server_task = asyncio.create_task(server.serve())
    metrics_server = _metrics_server(state)
    metrics_task = asyncio.create_task(metrics_server.serve()) if metrics_server else None
    logger.info(
        "serving %s on http://%s:%d (max_model_len %d)",
        name,
        config.host,
        config.port,
        ready.max_model_len,
    )
    code = await _wait(state, stop, server_task)
    if code == 0:
        await _drain(state)
    server.should_exit = True
    if metrics_server is not None:
        metrics_server.should_exit = True
    await asyncio.gather(
        server_task, *([metrics_task] if metrics_task else []), return_exceptions=True
    )
    state.close()  # the grammar workers and tokenizing threads
    await engine.shutdown()
    if tracing is not None:
        await asyncio.to_thread(tracing.shutdown)  # the spans still queued, a few seconds at most
    return code


def _start_tracing(endpoint: str | None, service: str):
    """The process's tracer with --otlp-traces-endpoint (OpenTelemetry imported only then)."""
    if endpoint is None:
        return None
    from ketch.engine import tracing

    return tracing.start(endpoint, service)


def _reasoning_parser(config: ServerConfig, tokenizer: Tokenizer) -> str | None:
    """The reasoning parser this model gets (``--reasoning-parser``), logged with why."""
    name, why = reasoning.choose(config.reasoning_parser, tokenizer.chat_template_source)
    logger.info("reasoning parser: %s (%s)", name or "none", why)
    hidden = [t for t in (reasoning.OPEN, reasoning.CLOSE) if tokenizer.is_special(t)]
    if name is not None and hidden:
        logger.warning(
            "the tokenizer marks %s as special tokens, which skip_special_tokens (the default) "
            "removes from the text: reasoning is split only for requests that set "
            "skip_special_tokens to false",
            " and ".join(hidden),
        )
    return name


def _metrics_server(state: ServingState) -> uvicorn.Server | None:
    """A second listener serving only /metrics, when --metrics-port is set."""
    port = state.config.metrics_port
    if port is None:
        return None
    app = FastAPI(docs_url=None, redoc_url=None)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    return make_server(app, state.config.host, port)


async def _wait(state: ServingState, stop: asyncio.Event, server_task: asyncio.Task) -> int:
    while not stop.is_set():
        if not state.engine.is_alive:
            await asyncio.sleep(_DEATH_GRACE_S)  # /health answers 503; open streams get errors
            logger.error("the engine died (%s); exiting", state.engine.dead_reason or "exited")
            return _EXIT_ENGINE_DIED
        if server_task.done():
            return 1
        await asyncio.sleep(_WATCH_INTERVAL_S)
    return 0


async def _drain(state: ServingState) -> None:
    state.draining = True
    timeout = state.config.drain_timeout
    logger.info("draining: %d requests in flight, waiting up to %.0f s", state.in_flight, timeout)
    try:
        await asyncio.wait_for(_idle(state), timeout)
    except TimeoutError:
        logger.warning(
            "drain timeout: %d requests still in flight (%d in the engine) are cut",
            state.in_flight,
            _engine_busy(state),
        )


async def _idle(state: ServingState) -> None:
    """No HTTP request in flight, and (a prefill instance, whose work arrives over pd-comm) no
    request in its engine either."""
    await state.idle.wait()
    while state.config.role == "prefill" and _engine_busy(state) and state.engine.is_alive:
        await asyncio.sleep(0.1)


def _engine_busy(state: ServingState) -> int:
    snapshot = state.engine.last_snapshot
    return 0 if snapshot is None else snapshot.num_requests_running + snapshot.num_requests_waiting


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    from ketch.engine.cli_args import add_config_args, add_engine_args

    parser = commands.add_parser(
        "serve",
        allow_abbrev=False,
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Runs the engine process and the OpenAI-compatible API server. Every "
        "setting can also come from --config FILE (JSON or YAML); flags override the file.",
    )
    parser.add_argument("--config", metavar="FILE", help="JSON/YAML file of settings")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    add_config_args(parser, ServerConfig, "server")
    add_engine_args(parser)


# GET paths a probe may use on each HTTP listener (api_server.create_app, _metrics_server).
API_PROBE_PATHS = ("/health", "/ready", "/metrics", "/v1/models")
METRICS_PROBE_PATHS = ("/metrics",)


def config_file_classes() -> tuple[type, ...]:
    """The settings a ``ketch serve --config`` file may hold (any other key is an error)."""
    return (EngineConfig, ServerConfig)


def listening_ports(args: argparse.Namespace, file_values: dict | None = None) -> dict[int, str]:
    """``{port: Listener(flag)}`` that ``ketch serve`` binds with these flags and file values.

    Builds the configs ``run_serve`` builds (a bad value raises its ValueError)."""
    from ketch.engine.cli_args import config_from_args

    config_from_args(EngineConfig, args, file_values)
    return listeners(config_from_args(ServerConfig, args, file_values))


def run_serve(args: argparse.Namespace) -> int:
    from ketch.engine.cli_args import config_from_args, read_config_file

    values = read_config_file(args.config, *config_file_classes()) if args.config else {}
    engine_config = config_from_args(EngineConfig, args, values)
    server_config = config_from_args(ServerConfig, args, values)
    return asyncio.run(serve(engine_config, server_config))
