"""``ketch cache-manager``: the KV cache sidecar of one engine instance.

Reads the same role file as ``ketch serve --config`` (engine and server keys are accepted and
only the cache manager's own are used), checks its ports, then runs ``server.run`` until
SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ketch.engine.cache_manager.config import CacheManagerConfig

if TYPE_CHECKING:
    from ketch.engine.ports import Listener

_DESCRIPTION = """\
The cache-manager sidecar of one Ketch instance (same pod as `ketch serve`, sharing /dev/shm
and /tmp, where the private run directory holds the socket to the engine). It maps the
engine's KV cache segment and executes what the engine asks:
  - swap: copy KV blocks evicted from the engine's cache into host swap space
    (--swap-space) and back;
  - push: send KV blocks to another instance's cache manager (prefill -> decode transfer),
    and receive blocks from peers into this engine's cache (--kv-transfer-port); prefill and
    decode roles only (--role, from the role file): these need a peer key
    (--peer-key-file or KETCH_PEER_KEY) unless --insecure-no-peer-key.
The engine decides which blocks go where; this process copies, checks and reports.
/health and /metrics are served on --cache-manager-port. Settings can come from --config
FILE, the same role file `ketch serve --config` reads; flags override it."""

_EPILOG = """\
example:
  ketch cache-manager --config /etc/ketch/prefill.yaml --swap-space 4Gi
"""


def add_cache_manager_parser(commands: argparse._SubParsersAction) -> None:
    from ketch.engine.cli_args import add_config_args

    parser = commands.add_parser(
        "cache-manager",
        allow_abbrev=False,
        help="run the KV cache sidecar (host swap, KV transfer between instances)",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", metavar="FILE", help="JSON/YAML role file (the one `ketch serve` reads)"
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    add_config_args(parser, CacheManagerConfig, "cache manager")


def check_ports(config: CacheManagerConfig) -> None:
    """Fails fast, naming the flag, if a port the sidecar binds is taken."""
    from ketch.engine.ports import check_free

    check_free(_listeners(config))


# GET paths the sidecar's HTTP port serves (cache_manager.http).
HTTP_PROBE_PATHS = ("/health", "/metrics")


def config_file_classes() -> tuple[type, ...]:
    """The settings a ``ketch cache-manager --config`` file (the role file) may hold."""
    from ketch.engine.config import EngineConfig
    from ketch.engine.serving.config import ServerConfig

    return (EngineConfig, ServerConfig, CacheManagerConfig)


def config_from(args: argparse.Namespace, file_values: dict | None) -> CacheManagerConfig:
    from ketch.engine.cli_args import config_from_args

    try:
        return config_from_args(CacheManagerConfig, args, file_values)
    except TypeError as exc:  # a file value of the wrong kind
        raise ValueError(f"bad cache-manager setting: {exc}") from exc


def listening_ports(args: argparse.Namespace, file_values: dict | None = None) -> dict[int, str]:
    """``{port: Listener(flag)}`` that ``ketch cache-manager`` binds (as ``check_ports`` does)."""
    return _listeners(config_from(args, file_values))


def _listeners(config: CacheManagerConfig) -> dict[int, Listener]:
    from ketch.engine.ports import Listener

    ports = {
        config.cache_manager_port: Listener("--cache-manager-port", config.host, HTTP_PROBE_PATHS)
    }
    if config.moves_kv:  # a mixed instance's sidecar opens no KV transfer port
        ports[config.kv_transfer_port] = Listener("--kv-transfer-port", config.host)
    return ports


def run_cache_manager(args: argparse.Namespace) -> int:
    from ketch.engine.cache_manager.server import run
    from ketch.engine.cli_args import read_config_file

    file_values = {}
    if args.config:
        file_values = read_config_file(args.config, *config_file_classes())
    config = config_from(args, file_values)
    check_ports(config)
    return run(config)
