"""Prometheus metrics of the cache manager, in a registry of its own.

The sample names are fixed (dashboards and the operator read them)::

    ketch:cache_manager_engine_attached                   gauge 0/1
    ketch:cache_manager_swap_total_blocks                 gauge
    ketch:cache_manager_swap_used_blocks                  gauge
    ketch:cache_manager_swap_in_blocks_total              counter
    ketch:cache_manager_swap_out_blocks_total             counter
    ketch:cache_manager_kv_sent_bytes_total               counter
    ketch:cache_manager_kv_received_bytes_total           counter
    ketch:cache_manager_kv_transfers_total{direction}     counter (send|receive)
    ketch:cache_manager_kv_transfer_failures_total{direction}
    ketch:cache_manager_kv_transfer_seconds               histogram (send side)
    ketch:cache_manager_push_queue_depth                  gauge (pushes queued or being sent)
    ketch:cache_manager_push_refusals_total{reason}       counter (queue_full|circuit_open|expired)
    ketch:cache_manager_push_circuits_open                gauge (destinations failing fast)

prometheus_client objects are thread-safe; the sender and receiver threads update them directly.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

PREFIX = "ketch:cache_manager_"
PUSH_REFUSAL_REASONS = ("queue_full", "circuit_open", "expired")
_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class CacheManagerMetrics:
    """The cache manager's gauges, counters and the transfer-time histogram."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.engine_attached = Gauge(
            PREFIX + "engine_attached", "1 while an engine is attached, else 0.", registry=r
        )
        self.swap_total_blocks = Gauge(
            PREFIX + "swap_total_blocks", "Host swap capacity in KV blocks.", registry=r
        )
        self.swap_used_blocks = Gauge(
            PREFIX + "swap_used_blocks", "Swap slots holding a swapped-out block.", registry=r
        )
        # Counter names are given without "_total": prometheus_client appends it when rendering.
        self.swap_in_blocks = Counter(
            PREFIX + "swap_in_blocks", "Blocks copied from swap into the device cache.", registry=r
        )
        self.swap_out_blocks = Counter(
            PREFIX + "swap_out_blocks", "Blocks copied from the device cache to swap.", registry=r
        )
        self.kv_sent_bytes = Counter(
            PREFIX + "kv_sent_bytes", "KV bytes pushed to peers and acknowledged.", registry=r
        )
        self.kv_received_bytes = Counter(
            PREFIX + "kv_received_bytes", "KV bytes received from peers and stored.", registry=r
        )
        self.kv_transfers = Counter(
            PREFIX + "kv_transfers",
            "Successful KV transfers by direction (send, receive).",
            ["direction"],
            registry=r,
        )
        self.kv_transfer_failures = Counter(
            PREFIX + "kv_transfer_failures",
            "Failed KV transfers by direction (send, receive).",
            ["direction"],
            registry=r,
        )
        self.kv_transfer_seconds = Histogram(
            PREFIX + "kv_transfer_seconds",
            "Seconds from the start of a push to the peer's acknowledgement.",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.push_queue_depth = Gauge(
            PREFIX + "push_queue_depth",
            "KV pushes taken from the engine and not yet answered (queued or being sent).",
            registry=r,
        )
        self.push_refusals = Counter(
            PREFIX + "push_refusals",
            "KV pushes answered at once without sending, by reason: queue_full (too many for "
            "one destination), circuit_open (the destination keeps failing), expired (the "
            "request's deadline passed).",
            ["reason"],
            registry=r,
        )
        self.push_circuits_open = Gauge(
            PREFIX + "push_circuits_open",
            "Destinations whose circuit is open or half-open (their pushes fail at once).",
            registry=r,
        )
        for direction in ("send", "receive"):  # both series exist from the start, at 0
            self.kv_transfers.labels(direction=direction)
            self.kv_transfer_failures.labels(direction=direction)
        for reason in PUSH_REFUSAL_REASONS:
            self.push_refusals.labels(reason=reason)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
