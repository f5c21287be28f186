"""Settings of the cache-manager sidecar (``ketch cache-manager``).

The port fields share their names and defaults with ``ServerConfig``, so the one role YAML file
that configures ``ketch serve`` also tells the sidecar where to listen. Every field carries its
help text in ``metadata``; the flags are generated from it (``ketch.engine.cli_args``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ketch.engine.config import parse_memory_size

KV_TRANSPORTS = ("tcp",)
_GIB = 1024**3


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


def parse_swap_space(value: int | float | str) -> int:
    """Bytes of host swap space: ``"4GiB"``, ``"4Gi"``, ``"512MiB"``; a plain number is GiB.

    ``0`` (or ``"0"``, ``"0GiB"``) disables swapping.
    """
    hint = "use e.g. '4GiB', '4Gi', '512MiB' or a number of GiB; 0 disables swap"
    if isinstance(value, bool):
        raise ValueError(f"swap_space={value!r} is not a size; {hint}")
    if isinstance(value, int | float):
        number = float(value)
    else:
        text = str(value).strip()
        try:
            number = float(text)
        except ValueError:
            if re.fullmatch(r"0*\.?0*\s*[A-Za-z]*", text) and re.match(r"[0.]*0", text):
                return 0  # "0GiB"
            try:
                return parse_memory_size(text, "swap_space")
            except ValueError:
                raise ValueError(f"swap_space={value!r} is not a size; {hint}") from None
    if number < 0:
        raise ValueError(f"swap_space must not be negative, got {value!r}")
    return int(number * _GIB)


@dataclass(frozen=True)
class CacheManagerConfig:
    """What the cache-manager sidecar listens on and how much host memory it may use."""

    host: str = _opt("0.0.0.0", "Address the KV transfer port and the HTTP port listen on.")
    cache_queue_port: int = _opt(
        8003,
        "Names the engine <-> cache-manager socket: cache-N.sock in the private run directory "
        "($KETCH_RUN_DIR, else <tmp>/ketch-<uid>; no TCP port). Must equal ketch serve's.",
    )
    kv_transfer_port: int = _opt(
        8005, "Port this cache manager receives KV blocks on from peer cache managers."
    )
    cache_manager_port: int = _opt(8006, "HTTP port of /health and /metrics.")
    swap_space: str = _opt(
        "4GiB",
        "Host memory for KV blocks swapped out of the engine's cache, e.g. 4GiB, 4Gi, 512MiB; "
        "a plain number is GiB; 0 disables swapping.",
    )
    transfer_timeout: float = _opt(
        10.0, "Seconds a KV push waits for the peer's acknowledgement.", minimum=0.1
    )
    kv_transport: str = _opt(
        "tcp", "How KV blocks travel between cache managers.", choices=KV_TRANSPORTS
    )
    peer_key_file: str | None = _opt(
        None,
        "File holding the key shared by an InferenceService's prefill and decode pods; or set "
        "KETCH_PEER_KEY. Then every KV transfer and its acknowledgement must carry its HMAC. "
        "Without one, the KV transfer port trusts the network.",
    )

    def __post_init__(self) -> None:
        ports = {
            "cache_queue_port": self.cache_queue_port,
            "kv_transfer_port": self.kv_transfer_port,
            "cache_manager_port": self.cache_manager_port,
        }
        for name, value in ports.items():
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
                raise ValueError(f"{name} must be a port number 1-65535, got {value!r}")
        values = list(ports.values())
        clashes = sorted({v for v in values if values.count(v) > 1})
        if clashes:
            raise ValueError(f"ports must be distinct; {clashes} used more than once")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError("host must be an address such as 0.0.0.0 or 127.0.0.1")
        parse_swap_space(self.swap_space)
        timeout = self.transfer_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0.1:
            raise ValueError(f"transfer_timeout must be >= 0.1 seconds, got {timeout!r}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(
                f"kv_transport must be one of {list(KV_TRANSPORTS)}, got {self.kv_transport!r}"
            )

    @property
    def swap_bytes(self) -> int:
        return parse_swap_space(self.swap_space)
