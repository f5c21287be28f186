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
ROLES = ("mixed", "prefill", "decode")  # as ServerConfig's
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
    role: str = _opt(
        "mixed",
        "The role of the engine beside it (the role file's 'role'). Only prefill and decode "
        "move KV between instances: a mixed instance's cache manager opens no KV transfer port "
        "and needs no peer key.",
        choices=ROLES,
    )
    cache_queue_port: int = _opt(
        8003,
        "Names the engine <-> cache-manager socket: cache-N.sock in the private run directory "
        "($KETCH_RUN_DIR, else <tmp>/ketch-<uid>; no TCP port). Must equal ketch serve's.",
    )
    kv_transfer_port: int = _opt(
        8005,
        "Port this cache manager receives KV blocks on from peer cache managers (prefill and "
        "decode roles only). A frame over 1 GiB ends the connection; with a peer key, a peer "
        "that has not proved it holds the key within 5 s of connecting is dropped before it can "
        "send a message.",
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
    max_queued_pushes_per_peer: int = _opt(
        32,
        "Most KV pushes queued or being sent to one destination; more are refused at once "
        "(the prefill request fails with a clear error) instead of waiting behind a slow peer.",
        minimum=1,
    )
    push_threads: int = _opt(
        4,
        "Destinations KV is pushed to at the same time. Each destination is served by one "
        "thread at a time, in turn with the others, so a slow or unreachable peer holds up "
        "only its own pushes.",
        minimum=1,
        maximum=64,
    )
    peer_failure_threshold: int = _opt(
        3,
        "Consecutive failed pushes (no acknowledgement in time, a broken connection) that open "
        "a destination's circuit: its pushes then fail at once for --peer-cooldown seconds, "
        "after which one probe push decides whether it is back.",
        minimum=1,
    )
    peer_cooldown: float = _opt(
        10.0, "Seconds a destination's open circuit fails pushes at once.", minimum=0.1
    )
    peer_key_file: str | None = _opt(
        None,
        "File holding the key shared by an InferenceService's prefill and decode pods; or set "
        "KETCH_PEER_KEY. Then a peer must prove it holds the key when it connects to the KV "
        "transfer port, and every KV transfer and its acknowledgement must carry its HMAC. The "
        "prefill and decode roles refuse to start without one (see --insecure-no-peer-key).",
    )
    insecure_no_peer_key: bool = _opt(
        False,
        "Let the prefill and decode roles run without a peer key: the KV transfer port then "
        "takes blocks from anyone who reaches it. Trusted networks only (tests, one host).",
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
        for name in ("transfer_timeout", "peer_cooldown"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0.1:
                raise ValueError(f"{name} must be >= 0.1 seconds, got {value!r}")
        for name, top in (
            ("max_queued_pushes_per_peer", None),
            ("push_threads", 64),
            ("peer_failure_threshold", None),
        ):
            value = getattr(self, name)
            bad = isinstance(value, bool) or not isinstance(value, int) or value < 1
            if bad or (top is not None and value > top):
                limit = f"1-{top}" if top else "a positive integer"
                raise ValueError(f"{name} must be {limit}, got {value!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {list(ROLES)}, got {self.role!r}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(
                f"kv_transport must be one of {list(KV_TRANSPORTS)}, got {self.kv_transport!r}"
            )

    @property
    def swap_bytes(self) -> int:
        return parse_swap_space(self.swap_space)

    @property
    def moves_kv(self) -> bool:
        """Whether this instance pushes and receives KV (prefill and decode roles)."""
        return self.role != "mixed"
