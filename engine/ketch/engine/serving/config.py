"""What ``ketch serve`` is asked to do beyond the engine: ports, role, limits, access.

Like ``EngineConfig``, every field carries its help text; flags and config-file keys are
generated from these fields. ``crd`` metadata gives a field's path under an InferenceService's
``spec`` (``False``: the operator sets it from elsewhere in the spec, e.g. ``role`` from ``roles``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ketch.engine.sampling_params import POOLINGS
from ketch.engine.serving.reasoning import CHOICES as REASONING_PARSERS
from ketch.engine.tracing import ENDPOINT_HELP, check_endpoint

if TYPE_CHECKING:
    from ketch.engine.structured.grammars import Limits

ROLES = ("mixed", "prefill", "decode")


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


_CEILINGS = (
    ("grammar_workers", 64, "each is a process"),
    ("max_grammar_queue", 65_536, "each waiting job holds its request's input"),
    ("max_schema_depth", 256, "schemas are walked recursively, within Python's recursion limit"),
)
"""Upper bounds of settings whose large values cost the server itself, not one request."""


@dataclass(frozen=True)
class ServerConfig:
    """The serving process's settings. Internal ports bind to loopback unless a role needs them."""

    host: str = _opt("0.0.0.0", "Address the HTTP API listens on.", crd=False)
    port: int = _opt(
        8000, "HTTP port of the OpenAI API, /health, /ready and /metrics.", crd="ports.http"
    )
    metrics_port: int | None = _opt(
        None,
        "Separate port for /metrics only; by default /metrics is on --port.",
        crd="ports.metrics",
    )
    engine_worker_queue_port: int = _opt(
        8002,
        "Names the engine <-> worker socket (worker-N.sock in the private run directory, "
        "$KETCH_RUN_DIR else <tmp>/ketch-<uid>; no TCP port) and the KV shared-memory segment.",
        crd="ports.engineWorkerQueue",
    )
    cache_queue_port: int = _opt(
        8003,
        "Names the engine <-> cache-manager socket (cache-N.sock in the private run "
        "directory; no TCP port). Must equal the sidecar's --cache-queue-port.",
        crd="ports.cacheQueue",
    )
    pd_comm_port: int = _opt(
        8004,
        "Prefill/decode control port; reachable from peers only in prefill/decode roles.",
        crd="ports.pdComm",
    )
    kv_transfer_port: int = _opt(
        8005,
        "Port the cache manager receives KV blocks on from prefill peers (prefill/decode roles).",
        crd="ports.kvTransfer",
    )
    cache_manager_port: int = _opt(
        8006,
        "HTTP port of the cache-manager sidecar's /health and /metrics.",
        crd="ports.cacheManager",
    )
    pd_block_timeout: float = _opt(
        30.0,
        "Decode role: seconds a request waits for free KV blocks before it fails with 503.",
        minimum=0,
    )
    pd_peer_timeout: float = _opt(
        10.0,
        "Prefill/decode roles: seconds a peer may stay silent before its requests fail.",
        minimum=1,
    )
    pd_request_timeout: float = _opt(
        60.0,
        "Decode role: one deadline, in seconds from its arrival, for a request's prompt KV to "
        "be here (waiting for blocks, the prefill peer's queue and compute, the transfer); then "
        "it fails with 504 and its blocks are freed. The prefill peer gets the same deadline.",
        minimum=1,
    )
    kv_transfer_host: str | None = _opt(
        None,
        "Decode role: the address prefill peers push KV to (this pod's cache manager). Default: "
        "$KETCH_KV_TRANSFER_HOST (the operator sets it to the pod IP), else --host unless it is "
        "a wildcard, else 127.0.0.1. Never taken from a request.",
        crd=False,
    )
    pd_prefill_peers: str | None = _opt(
        None,
        "Decode role: the prefill instances this one may be paired with (a DNS name, e.g. the "
        "prefill pods' headless Service, or comma-separated hosts). Unset: any, so only the "
        "router may reach this instance.",
        crd=False,
    )
    role: str = _opt("mixed", "Instance role: mixed, prefill or decode.", choices=ROLES, crd=False)
    served_model_name: str | None = _opt(
        None, "Model name clients use in 'model'; defaults to the --model value.", crd="model.name"
    )
    max_concurrency: int = _opt(
        256, "Most requests in flight; more get 429 with Retry-After.", minimum=1
    )
    max_request_bytes: int = _opt(
        1 << 20, "Largest accepted request body in bytes (413 above).", minimum=1
    )
    request_read_timeout: float = _opt(
        30.0, "Seconds a client may take to send its request body (408 after).", minimum=0
    )
    max_choices: int = _opt(
        128,
        "Most sequences one request may ask for (prompts x n); each counts against "
        "--max-concurrency.",
        minimum=1,
    )
    max_stop_strings: int = _opt(16, "Most stop strings one request may give.", minimum=1)
    max_stop_length: int = _opt(256, "Longest stop string, in characters.", minimum=1)
    max_stop_token_ids: int = _opt(256, "Most stop token ids one request may give.", minimum=1)
    max_logit_bias: int = _opt(1024, "Most logit_bias entries one request may give.", minimum=1)
    max_output_entries: int = _opt(
        2_000_000,
        "Most output one request may ask for, counted before it runs: sequences x max_tokens "
        "x (1 + logprobs), plus sequences x prompt tokens x (1 + prompt_logprobs); max_tokens "
        "unset counts as the room left in max_model_len. More is refused with 400.",
        minimum=1,
    )
    max_grammar_bytes: int = _opt(
        64 * 1024,
        "Largest structured-output input, in bytes: a grammar (guided_grammar, "
        "structured_outputs.grammar), a regex, the choices, or a JSON schema's text (tools' "
        "included). Checked before any work; more is refused with 400.",
        minimum=1,
    )
    max_schema_depth: int = _opt(
        64,
        "How deep a JSON schema's objects and arrays may nest (the document's depth); deeper is "
        "refused with 400 before any work.",
        minimum=1,
    )
    max_schema_nodes: int = _opt(
        20_000,
        "Most values (objects, arrays, strings, numbers) a JSON schema may hold; more is "
        "refused with 400 before any work.",
        minimum=1,
    )
    grammar_timeout: float = _opt(
        5.0,
        "Seconds a structured-output input may take to be converted, checked and compiled, in "
        "a worker process off the event loop. Past it the request is refused with 400 (and so "
        "is a resend of the same input), and the worker is killed and replaced.",
        minimum=0,
    )
    grammar_workers: int = _opt(
        2,
        "Worker processes that build and check structured-output grammars (started when first "
        "needed).",
        minimum=1,
    )
    max_grammar_queue: int = _opt(
        16,
        "Requests whose grammar may wait for a busy grammar worker; more get 503 with Retry-After.",
        minimum=0,
    )
    enable_prompt_tokens_details: bool = _opt(
        False,
        "Report usage.prompt_tokens_details.cached_tokens (prompt tokens found in the prefix "
        "cache). Off by default: with a cache shared between clients it tells one client what "
        "others' prompts began with.",
    )
    embedding_pooling: str = _opt(
        "last",
        "How /v1/embeddings pools a prompt's final-normed hidden states: 'last' (the last "
        "token's, the usual choice for a decoder) or 'mean' (averaged over the prompt; it "
        "takes no prefix-cache hits). A request's 'pooling' field overrides it.",
        choices=POOLINGS,
    )
    reasoning_parser: str = _opt(
        "auto",
        "How chat completions split a thinking model's <think>...</think> text from its answer "
        "into message.reasoning_content (delta.reasoning_content when streamed): 'auto' does "
        "when the chat template writes <think> (Qwen3, DeepSeek-R1); 'think' (or vLLM's names "
        "'qwen3', 'deepseek_r1') always; 'none' never (the text stays in content).",
        choices=REASONING_PARSERS,
    )
    otlp_traces_endpoint: str | None = _opt(None, ENDPOINT_HELP)
    drain_timeout: float = _opt(
        30.0, "Seconds SIGTERM waits for in-flight requests before exiting.", minimum=0
    )
    api_key_file: str | None = _opt(
        None,
        "File holding the API key; or set KETCH_API_KEY. Then every endpoint but /health, "
        "/ready and /metrics needs 'Bearer <key>'.",
        crd=False,
    )
    admin_key_file: str | None = _opt(
        None,
        "File holding the admin key for /pause and /resume; or set KETCH_ADMIN_KEY. Without "
        "one, ketch serve writes a random key to admin-key-<port> in its private run directory "
        "($KETCH_RUN_DIR, else <tmp>/ketch-<uid>; read it with kubectl exec). The client's "
        "address is never enough: a same-pod proxy or mesh sidecar makes everyone loopback.",
        crd=False,
    )
    peer_key_file: str | None = _opt(
        None,
        "File holding the key shared by an InferenceService's prefill and decode pods; or set "
        "KETCH_PEER_KEY. Then a pd-comm peer must prove it holds the key when it connects, and "
        "every message must carry its HMAC. The prefill and decode roles refuse to start "
        "without one (see --insecure-no-peer-key).",
        crd=False,
    )
    insecure_no_peer_key: bool = _opt(
        False,
        "Let the prefill and decode roles run without a peer key: pd-comm then takes messages "
        "from anyone who reaches --pd-comm-port. Trusted networks only (tests, one host).",
        crd=False,
    )

    def kv_transfer_address_host(self) -> str:
        """Where this instance's cache manager takes KV pushes, as peers reach it."""
        configured = self.kv_transfer_host or os.environ.get("KETCH_KV_TRANSFER_HOST")
        if configured:
            return configured
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    def __post_init__(self) -> None:
        ports = {
            "port": self.port,
            "engine_worker_queue_port": self.engine_worker_queue_port,
            "cache_queue_port": self.cache_queue_port,
            "pd_comm_port": self.pd_comm_port,
            "kv_transfer_port": self.kv_transfer_port,
            "cache_manager_port": self.cache_manager_port,
        }
        if self.metrics_port is not None:
            ports["metrics_port"] = self.metrics_port
        for name, value in ports.items():
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
                raise ValueError(f"{name} must be a port number 1-65535, got {value!r}")
        clashes = sorted({v for v in ports.values() if list(ports.values()).count(v) > 1})
        if clashes:
            raise ValueError(f"ports must be distinct; {clashes} used more than once")
        check_endpoint(self.otlp_traces_endpoint)
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {list(ROLES)}, got {self.role!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {list(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )
        if self.embedding_pooling not in POOLINGS:
            raise ValueError(
                f"embedding_pooling must be one of {list(POOLINGS)}, got {self.embedding_pooling!r}"
            )
        for name in (
            "max_concurrency",
            "max_request_bytes",
            "max_choices",
            "max_stop_strings",
            "max_stop_length",
            "max_stop_token_ids",
            "max_logit_bias",
            "max_output_entries",
            "max_grammar_bytes",
            "max_schema_depth",
            "max_schema_nodes",
            "grammar_workers",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, least in (
            ("drain_timeout", 0),
            ("pd_block_timeout", 0),
            ("pd_peer_timeout", 1),
            ("pd_request_timeout", 1),
            ("request_read_timeout", 0.001),
            ("grammar_timeout", 0.001),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < least:
                raise ValueError(f"{name} must be >= {least} seconds, got {value!r}")
            if not math.isfinite(value):  # nan passes every comparison; inf never times out
                raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
        queue = self.max_grammar_queue
        if isinstance(queue, bool) or not isinstance(queue, int) or queue < 0:
            raise ValueError(f"max_grammar_queue must be a non-negative integer, got {queue!r}")
        for name, most, why in _CEILINGS:
            if getattr(self, name) > most:
                raise ValueError(
                    f"{name} must be at most {most} ({why}), got {getattr(self, name)}"
                )

    def grammar_limits(self) -> Limits:
        """What one structured-output input may be (``--max-grammar-bytes`` and the schema's
        ``--max-schema-depth`` and ``--max-schema-nodes``)."""
        from ketch.engine.structured.grammars import Limits  # not for the operator's imports

        return Limits(self.max_grammar_bytes, self.max_schema_depth, self.max_schema_nodes)
