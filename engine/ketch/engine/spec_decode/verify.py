"""Checking drafts against the model (rank 0 of the worker, after the step's forward pass).

A request with drafts d0..dm-1 computed its last token and every draft in one span, so the step
has the model's logits at each of those positions. Its first token was sampled as always, from
the last token's row; ``verify`` then walks the drafts: while the token just chosen equals the
next draft (and does not end the request), that draft is kept and the token after it is chosen
from the draft's own row, by the same sampler, from the request's state with every kept token
appended (its penalties, grammar and min_tokens see exactly what they would see one token at a
time). The first disagreement ends the walk: the model's token there is emitted instead of the
draft, so a step emits the drafts kept plus one token of the model's own.

Greedy requests so keep the longest prefix the model agrees with, plus one. Sampled requests
keep a draft exactly when the token the sampler draws at its position is that draft. For a
proposal that is one token with certainty (every proposer here drafts deterministically), this
is rejection sampling: the draft d is accepted with probability p(d) = min(1, p(d) / q(d)) with
q(d) = 1, and a rejected position draws from the residual max(p - q, 0), normalised, which is p
without d: exactly what one uniform draw through p's cumulative distribution gives, conditioned
on not landing on d. Each emitted token takes one draw from the request's generator, as without
speculation, so a seeded request emits the same tokens with or without it, whatever the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ketch.engine.spec_decode.config import SpeculativeConfig
from ketch.engine.spec_decode.proposer import DraftRequest
from ketch.engine.worker.sampler import SamplingState, sample

if TYPE_CHECKING:
    from ketch.engine.core.scheduler_output import SchedulerOutput
    from ketch.engine.outputs import TokenLogprob
    from ketch.engine.structured.compiler import RequestGrammar


def drafts_wanted(
    sched: SchedulerOutput,
    requests: dict,
    failed: dict[str, str],
    config: SpeculativeConfig,
    block_size: int,
    max_model_len: int,
) -> dict[str, DraftRequest]:
    """The requests that may get drafts this step, and how many each: the scheduler's room,
    never more than k, the blocks it holds or the model's context (the runner's own bound on
    what it indexes, whatever the message says). Only a request computing its last token."""
    wants = {}
    for request_id, room in sched.num_lookahead_tokens.items():
        state = requests.get(request_id)
        if state is None or request_id in failed or state.pooler is not None:
            continue
        tokens = state.sampling.token_ids
        length = len(tokens)
        if state.num_computed_tokens + sched.num_scheduled_tokens.get(request_id, 0) != length:
            continue
        most = min(
            room,
            config.num_speculative_tokens,
            len(state.block_ids) * block_size - length,
            max_model_len - length,
        )
        if most > 0:
            wants[request_id] = DraftRequest(request_id, tokens, state.block_ids, most)
    return wants


def grammar_prefix(grammar: RequestGrammar, drafts: list[int]) -> list[int]:
    """The drafts the request's grammar accepts in a row from where it stands (none while it
    compiles: the request may be deferred this step)."""
    if grammar.matcher is None and not grammar.compiled:
        return []
    if grammar.ready() is not None or grammar.matcher is None:
        return []
    return drafts[: grammar.matcher.validate_tokens(drafts)]


def verify(
    state: SamplingState, first: int, drafts: list[int], rows: np.ndarray
) -> tuple[list[int], list[TokenLogprob]]:
    """The tokens emitted after ``first`` (already chosen and appended to ``state``), each
    appended to ``state``, and their logprobs when the request asks for them. ``rows``: the
    logits at the drafts' positions, [len(drafts), vocab]."""
    extra: list[int] = []
    logprobs: list[TokenLogprob] = []
    token = first
    for j, draft in enumerate(drafts):
        if token != draft or _ends(state, token):
            break
        chosen, scored = sample(rows[j : j + 1], [state])
        token = chosen[0]
        state.accept(token)
        extra.append(token)
        if scored is not None and scored[0] is not None:
            logprobs.append(scored[0])
    return extra, logprobs


def _ends(state: SamplingState, token: int) -> bool:
    """Whether ``token``, just appended, ends the request (a stop token past min_tokens): nothing
    after it is checked."""
    if token not in state.stop_set:
        return False
    return len(state.token_ids) - state.num_prompt_tokens >= state.params.min_tokens
