"""What the scheduler tells the model runner each step: only what changed."""

from __future__ import annotations

from dataclasses import dataclass, field

from ketch.engine.outputs import TokenLogprob
from ketch.engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen yet: everything it needs to keep its own copy."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    seed: int


@dataclass
class CachedRequestData:
    """Requests the runner already holds whose blocks changed, as parallel lists.

    Only requests that got new blocks or were resumed after preemption appear; every other
    scheduled request just advances by its ``num_scheduled_tokens``. For a resumed request
    ``new_block_ids[i]`` is the complete new block table and ``num_computed_tokens[i]`` restarts
    from its prefix-cache hits.
    """

    request_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    resumed: list[bool] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        if not len(self.new_block_ids) == len(self.resumed) == len(self.num_computed_tokens) == n:
            raise ValueError("cached_requests: the four lists must be of one length")


@dataclass
class SchedulerOutput:
    """One step's work: which requests run and how many of their tokens."""

    new_requests: list[NewRequestData]
    cached_requests: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_request_ids: set[str]
    preempted_request_ids: list[str] = field(default_factory=list)
    # Speculative decoding: decode requests that may compute up to this many proposed tokens
    # after their scheduled one (their blocks have room for them; the budget counts them).
    num_lookahead_tokens: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.total_num_scheduled_tokens != sum(self.num_scheduled_tokens.values()):
            raise ValueError("total_num_scheduled_tokens is not the sum of num_scheduled_tokens")
        if any(n < 0 for n in self.num_lookahead_tokens.values()):
            raise ValueError("num_lookahead_tokens must not be negative")

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Tokens sampled in one step, for the requests whose scheduled tokens reached the end."""

    request_ids: list[str]
    sampled_token_ids: list[int]
    # Per sampled request: its sampled token's logprob and top ones, when asked for.
    logprobs: list[TokenLogprob | None] | None = None
    # Requests that asked for prompt_logprobs: the same per prompt token this step computed the
    # logits for, continuing from where the last step left off (the first prompt token has none).
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # Embedding requests (SamplingParams.pooling) whose prompt this step finished: the pooled
    # final-normed hidden state, one float per hidden unit (rank 0's; the engine checks the size).
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # Requests the runner could not take (request id -> why); nothing of theirs was computed.
    failed: dict[str, str] = field(default_factory=dict)
    # Requests whose scheduled tokens reached the end but that sampled nothing (their grammar
    # was still compiling): their last token counts as not computed, to be computed again and
    # sampled from next step.
    deferred: list[str] = field(default_factory=list)
    # The whole step was refused (a frame the worker could not decode): why. Nothing was applied.
    refused: str | None = None
    # Speculative decoding, per request that was given drafts this step: how many, and the
    # tokens it emitted after its first (one per draft the model agreed with: the drafts kept
    # and the model's token after the last of them), with their logprobs when asked for.
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    extra_token_ids: dict[str, list[int]] = field(default_factory=dict)
    extra_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
