"""Plain records of what the engine did, for metrics: per finished request and per step.

The engine fills them; the Prometheus layer (``ketch.engine.metrics``) turns them into the
metric names fixed in DESIGN.md. Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestMetrics:
    """Timeline and sizes of one finished request."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    finish_reason: str
    kv_handover_seconds: float | None = None  # decode role: prefill end -> taken over here
    # time.time_ns() - time.monotonic_ns() in the engine process at the end: adds to these
    # times (as ns) to make them wall-clock epoch ns in another process (the API server's spans).
    epoch_offset_ns: int | None = None

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float:
        return self.finished_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean decode time per token after the first (None with fewer than two tokens)."""
        if self.first_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass
class EngineSnapshot:
    """The engine's state after a step; counters are cumulative since start."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    free_kv_blocks: int
    total_kv_blocks: int
    batch_size: int
    max_batch_size: int
    num_preemptions: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    cache_manager_attached: bool = False
    # Speculative decoding (cumulative; ``speculative`` False: not configured, not exposed).
    speculative: bool = False
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0
    spec_drafted_steps: int = 0
    spec_steps_off: int = 0
