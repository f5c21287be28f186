"""The runner's guard on each step: values that would index past the model or the KV cache.

The engine never sends such values (the API server checks token ids against the vocabulary, the
scheduler hands out only its own blocks), but the runner must not index past an embedding table
or a KV tensor whatever arrives: a step that would is refused for the requests it names, never
executed. Each check raises ``StepError`` with the field and the bound it broke.
"""

from __future__ import annotations

from collections.abc import Iterable

from ketch.engine.core.scheduler_output import NewRequestData


class StepError(ValueError):
    """One request's part of a step is out of range; that request fails, the step goes on."""


def check_new(new: NewRequestData, vocab_size: int, num_blocks: int, max_model_len: int) -> None:
    tokens = new.token_ids
    if not 0 < len(tokens) <= max_model_len:
        raise StepError(f"{len(tokens)} tokens; the model takes 1 to {max_model_len}")
    if min(tokens) < 0 or max(tokens) >= vocab_size:
        raise StepError(f"token ids must be in [0, {vocab_size})")
    if not 0 < new.num_prompt_tokens <= len(tokens):
        raise StepError(f"num_prompt_tokens {new.num_prompt_tokens} of {len(tokens)} tokens")
    if not 0 <= new.num_computed_tokens <= len(tokens):
        raise StepError(f"num_computed_tokens {new.num_computed_tokens} of {len(tokens)} tokens")
    params = new.sampling_params
    if any(not 0 <= t < vocab_size for t, _ in params.logit_bias):
        raise StepError(f"logit_bias token ids must be in [0, {vocab_size})")
    if params.prompt_logprobs is not None and new.num_computed_tokens > 0:
        # Positions computed elsewhere (a prefix-cache hit, a prefill peer) have no logits here.
        raise StepError("prompt_logprobs need the prompt computed here, from its start")
    if params.pooling is not None and new.num_prompt_tokens != len(tokens):
        raise StepError("an embedding request (pooling) has no output tokens")
    if params.pooling == "mean" and new.num_computed_tokens > 0:
        raise StepError("mean pooling needs the prompt computed here, from its start")
    check_blocks(new.block_ids, num_blocks)


def check_blocks(block_ids: Iterable[int], num_blocks: int) -> None:
    for block in block_ids:
        if not 0 <= block < num_blocks:
            raise StepError(f"block id {block} outside the KV cache's [0, {num_blocks})")


def check_scheduled(
    num_tokens: int, num_computed: int, num_blocks_held: int, block_size: int, length: int
) -> None:
    """``num_tokens`` scheduled from ``num_computed`` of ``length`` tokens, in the blocks held."""
    if num_tokens < 1 or num_computed + num_tokens > length:
        raise StepError(
            f"{num_tokens} tokens scheduled from position {num_computed} of {length} tokens"
        )
    needed = -(-(num_computed + num_tokens) // block_size)
    if needed > num_blocks_held:
        raise StepError(f"{needed} KV blocks needed, {num_blocks_held} held")
