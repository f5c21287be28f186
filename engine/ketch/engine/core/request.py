"""A request as the scheduler sees it: tokens, progress and KV blocks."""

from __future__ import annotations

import enum
import time

from ketch.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence being generated.

    ``num_computed_tokens`` chases ``num_tokens``: each step the scheduler grants some of the
    remaining tokens (a prefill chunk, or the one newest token when decoding).
    """

    __slots__ = (
        "arrival_time",
        "block_hashes",
        "block_ids",
        "cache_parent",
        "eos_token_ids",
        "first_scheduled_time",
        "keep_blocks",
        "max_len",
        "max_tokens",
        "min_len",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_registered_blocks",
        "request_id",
        "sampling_params",
        "seed",
        "status",
        "stop_ids",
        "stop_reason",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        seed: int = 0,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        # Precomputed so the per-token stop check is a set lookup and two comparisons.
        self.stop_ids = frozenset(sampling_params.stop_token_ids) | (
            frozenset() if sampling_params.ignore_eos else eos_token_ids
        )
        self.min_len = self.num_prompt_tokens + sampling_params.min_tokens
        self.max_len = self.num_prompt_tokens + max_tokens
        self.seed = seed
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained (KVCacheManager._block_hashes)
        self.num_registered_blocks = 0
        self.cache_parent: tuple[int, int] = (0, 0)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        # Keep the KV blocks after finishing (a prefill for a peer: they are sent afterwards).
        self.keep_blocks = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def speculates(self) -> bool:
        """Whether its decode steps may take proposed tokens (not an embedding, nor a prefill
        that ends after its first token to hand its KV to a peer)."""
        return self.sampling_params.pooling is None and not self.keep_blocks

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def finish_on(self, token_id: int) -> bool:
        """Finishes the request if ``token_id``, just appended, ends it; returns whether it did.

        The scheduler inlines the cheap pre-check (``stop_ids`` / ``max_len``) and calls this
        only when it may be true.
        """
        length = len(self.token_ids)
        if token_id in self.stop_ids and length >= self.min_len:
            self.status = RequestStatus.FINISHED_STOPPED
            eos = not self.sampling_params.ignore_eos and token_id in self.eos_token_ids
            self.stop_reason = None if eos else token_id
            return True
        if length >= self.max_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
