"""``ketch router``: an OpenAI-compatible front that spreads requests over engine instances.

- Settings come from ``--config FILE`` (YAML/JSON, keys as in ``RouterConfig``) and flags, which
  override the file; a bad setting or a busy port is a one-line error (exit 2).
- Before listening, every listed instance is resolved and checked once, so the first requests
  already see which instances are up.
- SIGTERM/SIGINT: /ready turns 503, new requests get 503, in-flight streams get up to
  ``--drain-timeout`` seconds, then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from ketch.engine.ports import Listener, check_free
from ketch.engine.router.app import RouterState, create_app
from ketch.engine.router.config import RouterConfig
from ketch.engine.router.registration import read_registration_token
from ketch.engine.serving.admission import local_admin_key
from ketch.engine.serving.uvicorn_server import make_server, stop_event

logger = logging.getLogger("ketch.router")

_DESCRIPTION = """Spreads OpenAI requests (/v1/completions, /v1/chat/completions, /v1/models)
over `ketch serve` instances. Instances come from --mixed, or --prefill and --decode (for
prefill/decode disaggregation: each request goes to a decode instance with the chosen prefill
instance in the x-ketch-prefill header), as host:port, http://host:port or a DNS name without
port (a headless Service: every address it resolves to is an instance on --engine-port). Instances
may also register themselves when --registration is on: POST /v1/ketch/register {"url":
"http://host:port", "role": "mixed"} with 'Authorization: Bearer <token>' (the token from
--registration-token-file or KETCH_ROUTER_REGISTRATION_TOKEN; required), repeated as a
heartbeat within --registration-ttl; DELETE to leave (at most 256 registered at once).
GET /v1/ketch/instances lists what the router knows, to 'Authorization: Bearer <key>' with the
registration token or the admin key the router writes to router-admin-key-<port> in its run
directory ($KETCH_RUN_DIR, else <tmp>/ketch-<uid>; read it with kubectl exec). Clients get no
backend addresses or errors in 502/503 bodies or /ready: those go to the log.

A request is tried on a second instance only when the connection to the first failed (nothing
was sent); an instance's own answer, 503 included, is passed back, and a failure after sending
is a 502 (504 past --request-timeout). Bodies over --max-request-bytes get 413, bodies not sent
within --body-timeout 408. With --epp-port (conventionally 9002) the router is also a Gateway
API Inference Extension endpoint picker: an Envoy ext_proc gRPC service naming the instance
for each request a gateway routes (see docs/router.md). Every setting can come from --config
FILE (JSON or YAML); flags override the file."""

_EXAMPLES = """examples:
  ketch router --mixed 10.0.0.5:8000,10.0.0.6:8000 --policy prefix-hash
  ketch router --prefill isvc-prefill-peers.default.svc --decode isvc-decode-peers.default.svc
  ketch router --config /etc/ketch/router.yaml --port 9100
  ketch router --mixed isvc-peers.default.svc --policy prefix-hash --epp-port 9002
"""


def add_router_parser(commands: argparse._SubParsersAction) -> None:
    from ketch.engine.cli_args import add_config_args

    parser = commands.add_parser(
        "router",
        allow_abbrev=False,
        help="spread OpenAI requests over engine instances",
        description=_DESCRIPTION,
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", help="JSON/YAML file of settings")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    add_config_args(parser, RouterConfig, "router")


# GET paths a probe may use on the router's port (router.app).
HTTP_PROBE_PATHS = ("/health", "/ready", "/metrics", "/v1/models", "/v1/ketch/instances")


def config_file_classes() -> tuple[type, ...]:
    """The settings a ``ketch router --config`` file may hold."""
    return (RouterConfig,)


def config_from(args: argparse.Namespace, file_values: dict | None = None) -> RouterConfig:
    """The router's config from flags over ``file_values`` (read from ``--config`` if None)."""
    from ketch.engine.cli_args import config_from_args, read_config_file

    if file_values is None:
        file_values = read_config_file(args.config, *config_file_classes()) if args.config else {}
    return config_from_args(RouterConfig, args, file_values)


def listening_ports(args: argparse.Namespace, file_values: dict | None = None) -> dict[int, str]:
    """``{port: Listener(flag)}`` that ``ketch router`` binds: its one HTTP port."""
    return _listeners(config_from(args, file_values or {}))


def run_router(args: argparse.Namespace) -> int:
    config = config_from(args)
    token = read_registration_token(config, os.environ)  # a ValueError when one is missing
    check_port(config)
    return asyncio.run(serve_router(config, token))


def check_port(config: RouterConfig) -> None:
    """Fails fast, naming the flag, if the router's port is taken."""
    check_free(_listeners(config))


def _listeners(config: RouterConfig) -> dict[int, Listener]:
    listeners = {config.port: Listener("--port", config.host, HTTP_PROBE_PATHS)}
    if config.epp_port is not None:  # gRPC (ext_proc and gRPC health), no HTTP probe paths
        listeners[config.epp_port] = Listener("--epp-port", config.host)
    return listeners


async def serve_router(config: RouterConfig, registration_token: str | None = None) -> int:
    """Runs until SIGTERM/SIGINT; returns 0 after draining."""
    admin_key, where = local_admin_key(f"router-admin-key-{config.port}")
    logger.info("/v1/ketch/instances needs the admin key in %s (or the registration token)", where)
    state = RouterState.from_config(config, registration_token, admin_key)
    await state.registry.start()
    picker = None
    if config.epp_port is not None:
        from ketch.engine.router.epp import EndpointPicker

        picker = EndpointPicker(state)
        await picker.start()
    server = make_server(create_app(state), config.host, config.port, config.drain_timeout)
    stop = stop_event()
    server_task = asyncio.create_task(server.serve())
    healthy = sum(i.healthy for i in state.registry.instances.values())
    logger.info(
        "routing (%s) on http://%s:%d over %d instance(s), %d healthy",
        config.policy,
        config.host,
        config.port,
        len(state.registry.instances),
        healthy,
    )
    stop_task = asyncio.create_task(stop.wait())
    await asyncio.wait({server_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if server_task.done():
        code = 1  # uvicorn failed (e.g. could not bind)
    else:
        state.draining = True
        if picker is not None:
            await picker.refresh_health()  # readiness NOT_SERVING while draining
        logger.info("draining: %d requests in flight", state.in_flight)
        try:
            await asyncio.wait_for(state.idle.wait(), config.drain_timeout)
        except TimeoutError:
            logger.warning("drain timeout: %d requests still in flight are cut", state.in_flight)
        server.should_exit = True
    stop_task.cancel()
    await asyncio.gather(server_task, return_exceptions=True)
    if picker is not None:
        await picker.stop(grace=config.drain_timeout)
    await state.registry.close()
    return code
