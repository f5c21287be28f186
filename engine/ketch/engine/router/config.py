"""What ``ketch router`` is asked to do: where it listens, which instances it spreads over, how.

Every field carries its help text; the flags and the config-file keys come from these fields
(``ketch router --config router.yaml``, flags override the file). Instance lists are strings of
comma-separated entries: ``host:port`` / ``http://host:port`` is one static instance; a bare
DNS name without a port (a headless Service such as ``isvc-prefill-peers.default.svc``) is
resolved every ``dns_interval`` seconds to all its addresses, each an instance on
``engine_port``.
"""

from __future__ import annotations

import ipaddress
import string
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

POLICIES = ("least-requests", "round-robin", "prefix-hash")
ROLES = ("mixed", "prefill", "decode")
_HOST_CHARS = frozenset(string.ascii_letters + string.digits + ".-_")


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class Entry:
    """One parsed list entry: a static URL, or a DNS name to resolve (``url`` is None)."""

    role: str
    url: str | None = None
    dns_name: str | None = None


@dataclass(frozen=True)
class RouterConfig:
    """The router's settings. Instances come from the lists and/or from registration."""

    host: str = _opt("0.0.0.0", "Address the router's HTTP API listens on.")
    port: int = _opt(9000, "HTTP port of the router's OpenAI API, /health, /ready and /metrics.")
    policy: str = _opt(
        "least-requests",
        "How a request picks an instance: least-requests (fewest running+waiting requests), "
        "round-robin, or prefix-hash (requests sharing a prompt prefix go to the instance that "
        "already holds it in its prefix cache).",
        choices=POLICIES,
    )
    mixed: str | None = _opt(
        None,
        "Mixed (prefill+decode) instances: comma-separated host:port, http://host:port, or a "
        "DNS name without port (a headless Service, resolved to all its addresses).",
    )
    prefill: str | None = _opt(
        None, "Prefill instances (same entry forms as --mixed); needs --decode too."
    )
    decode: str | None = _opt(
        None, "Decode instances (same entry forms as --mixed); needs --prefill too."
    )
    engine_port: int = _opt(8000, "HTTP port of instances found through a DNS name.")
    pd_comm_port: int = _opt(
        8004,
        "Prefill/decode control port of a prefill instance, used when its /ready does not say.",
    )
    registration: bool = _opt(
        False,
        "Accept instances that register themselves (POST/DELETE /v1/ketch/register with the "
        "token of --registration-token-file). Off by default: a registered backend receives "
        "clients' requests, their Authorization headers included.",
    )
    registration_only: bool = _opt(
        False,
        "Start with no instance list: instances come only from POST /v1/ketch/register (the "
        "router is not ready until one registers). Implies --registration.",
    )
    registration_token_file: str | None = _opt(
        None,
        "File holding the token registration requires ('Authorization: Bearer <token>'); or "
        "set KETCH_ROUTER_REGISTRATION_TOKEN. Required with --registration(-only).",
    )
    health_interval: float = _opt(
        1.0, "Seconds between /ready and /metrics polls of each instance.", minimum=0.05
    )
    health_timeout: float = _opt(
        2.0, "Seconds one /ready or /metrics poll may take before the instance counts as down.",
        minimum=0.05,
    )  # fmt: skip
    dns_interval: float = _opt(5.0, "Seconds between DNS resolutions of DNS entries.", minimum=0.1)
    registration_ttl: float = _opt(
        15.0, "Seconds a registered instance stays without a heartbeat (re-POST).", minimum=0.1
    )
    request_timeout: float = _opt(
        600.0,
        "Seconds a forwarded request may take in all before it is cut (504; the instance "
        "stays in rotation: only health checks and refused connections take it out).",
        minimum=1,
    )
    max_request_bytes: int = _opt(
        1 << 20,
        "Largest accepted request body in bytes (413 above), as ketch serve's own limit.",
        minimum=1,
    )
    body_timeout: float = _opt(
        30.0, "Seconds a client may take to send its request body (408 after).", minimum=0.1
    )
    connect_timeout: float = _opt(
        5.0, "Seconds to connect to an instance before trying another.", minimum=0.1
    )
    prefix_chunk_chars: int = _opt(
        128, "prefix-hash: characters per prompt chunk (token-id prompts: a quarter of this).",
        minimum=1,
    )  # fmt: skip
    prefix_cache_entries: int = _opt(
        65536, "prefix-hash: chunk hashes remembered (least recently used dropped).", minimum=1
    )
    prefix_slack: int = _opt(
        8,
        "prefix-hash: when the prefix's instance has this many more requests than the least "
        "loaded one, the request goes to the least loaded instead.",
        minimum=0,
    )
    drain_timeout: float = _opt(
        10.0, "Seconds SIGTERM waits for in-flight requests before exiting.", minimum=0
    )
    epp_port: int | None = _opt(
        None,
        "gRPC port of the Gateway API Inference Extension endpoint picker (Envoy ext_proc, "
        "gRPC health; conventionally 9002), beside the HTTP API. Unset: no endpoint picker.",
    )
    epp_max_streams: int = _opt(
        4096, "Endpoint picker: ext_proc streams open at once (more are refused).", minimum=1
    )
    epp_shed_load: int = _opt(
        0,
        "Endpoint picker: answer 429 when every candidate instance has at least this many "
        "requests (running + waiting + picked since its last scrape). 0: never shed.",
        minimum=0,
    )

    def __post_init__(self) -> None:
        for name in ("port", "engine_port", "pd_comm_port"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
                raise ValueError(f"{name} must be a port number 1-65535, got {value!r}")
        if self.epp_port is not None:
            port = self.epp_port
            if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
                raise ValueError(f"epp_port must be a port number 1-65535, got {port!r}")
            if port == self.port:
                raise ValueError(f"epp_port must differ from the HTTP port ({self.port})")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {list(POLICIES)}, got {self.policy!r}")
        for f in self.__dataclass_fields__.values():
            least = f.metadata.get("minimum")
            value = getattr(self, f.name)
            if least is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or value < least:
                raise ValueError(f"{f.name} must be a number >= {least}, got {value!r}")
        for name in ("prefix_chunk_chars", "prefix_cache_entries", "prefix_slack",
                     "max_request_bytes", "epp_max_streams", "epp_shed_load"):  # fmt: skip
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if bool(self.prefill) != bool(self.decode):
            given, missing = ("prefill", "decode") if self.prefill else ("decode", "prefill")
            raise ValueError(
                f"--{given} instances need --{missing} instances too (a request needs both)"
            )
        entries = self.entries()
        if not entries and not self.registration_only:
            raise ValueError(
                "no instances: give --mixed, or --prefill and --decode (host:port, "
                "http://host:port or a DNS name), or --registration-only to wait for instances "
                "to POST /v1/ketch/register"
            )

    def entries(self) -> list[Entry]:
        """Every list entry, parsed; a malformed one is a ValueError naming it."""
        out = []
        for role in ROLES:
            text = getattr(self, role)
            if text is None:
                continue
            if not isinstance(text, str):
                raise ValueError(f"{role} must be a comma-separated string, got {text!r}")
            for raw in (part.strip() for part in text.split(",")):
                if raw:
                    out.append(parse_entry(raw, role, f"--{role}"))
        return out


def parse_entry(raw: str, role: str, where: str) -> Entry:
    """``host:port`` / ``http://host:port`` -> a static URL; a bare name -> a DNS entry."""
    if "://" not in raw and ":" not in raw.strip("[]"):
        if not (raw.isascii() and raw.replace("-", "").replace(".", "").replace("_", "").isalnum()):
            raise ValueError(f"{where}: {raw!r} is neither host:port, http://host:port nor a name")
        return Entry(role=role, dns_name=raw)
    return Entry(role=role, url=normalise_url(raw, where))


def normalise_url(raw: str, where: str = "url") -> str:
    """``host:port`` or ``http(s)://host:port[/]`` -> ``scheme://host:port``; anything more
    (userinfo, a path, a query or fragment, odd characters) is a ValueError, so neither a list
    entry nor a registration can steer requests to some other URL."""
    if not isinstance(raw, str) or not (raw.isascii() and raw.isprintable()) or " " in raw:
        raise ValueError(f"{where}: {raw!r} must be printable ASCII without spaces")
    text = raw if "://" in raw else f"http://{raw}"
    try:
        parts = urlsplit(text)
    except ValueError as exc:
        raise ValueError(f"{where}: {raw!r} has a bad host ({exc})") from exc
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{where}: {raw!r} has a bad port ({exc})") from exc
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{where}: {raw!r} must use http:// or https://")
    if "@" in parts.netloc:
        raise ValueError(f"{where}: {raw!r} must not carry a user or password")
    if parts.path not in ("", "/") or "?" in text or "#" in text:
        raise ValueError(f"{where}: {raw!r} must not carry a path, query or fragment")
    if not parts.hostname or not port:
        raise ValueError(f"{where}: {raw!r} needs a host and a port, e.g. 10.0.0.5:8000")
    return f"{parts.scheme}://{_checked_host(parts.hostname, raw, where)}:{port}"


def _checked_host(host: str, raw: str, where: str) -> str:
    """A DNS name or IPv4 address as is, an IPv6 address in brackets; else ValueError."""
    if ":" in host and "%" not in host:  # no zone ids: no percent signs in our URLs
        try:
            return f"[{ipaddress.IPv6Address(host)}]"
        except ValueError as exc:
            raise ValueError(f"{where}: {raw!r} has a bad IPv6 address ({exc})") from exc
    if not set(host) <= _HOST_CHARS:
        raise ValueError(f"{where}: {raw!r} has a bad host name {host!r}")
    return host
