"""A request's choices: each prompt times ``n``, one engine request each.

``expand`` writes the n-expansion (choice i of a prompt samples with ``params.for_choice(i)``:
a seeded request gets seed + i, so the choices differ and stay reproducible) and ``group`` puts
finished choices back together per prompt; ``LLM.generate`` and the API server both use them.
A ``Choice`` takes its engine request's deltas (``add``): it always counts what they brought,
and adds their tokens, text and logprobs up only when it ``accumulate``s (a stream that sends
each delta on keeps nothing of them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ketch.engine.outputs import CompletionOutput, RequestDelta, RequestOutput, TokenLogprob
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.stats import RequestMetrics


@dataclass
class Choice:
    """One sequence to generate: a tokenised prompt, this choice's params, and its progress."""

    index: int  # among all the choices of the request, prompt by prompt
    prompt_index: int
    index_in_prompt: int
    prompt_token_ids: list[int]
    params: SamplingParams
    accumulate: bool = True
    request_id: str = ""  # its engine request's, once the caller has given it one
    prefill_peer: str | None = None  # decode role: the paired prefill peer's pd-comm host:port
    num_deltas: int = 0
    num_tokens: int = 0  # output tokens so far
    num_chars: int = 0  # characters of output text so far
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    metrics: RequestMetrics | None = None
    _token_ids: list[int] = field(default_factory=list)
    _text: list[str] = field(default_factory=list)
    _logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def first(self) -> bool:
        """Whether the delta added last was the choice's first."""
        return self.num_deltas == 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: RequestDelta) -> None:
        """Takes the next delta of this choice's engine request (not an error delta)."""
        self.num_deltas += 1
        self.num_tokens += len(delta.new_token_ids)
        self.num_chars += len(delta.new_text)
        self.num_cached_tokens = delta.num_cached_tokens
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.metrics is not None:
            self.metrics = delta.metrics
        if self.accumulate:  # in place: a long output costs linear time, not quadratic
            self._token_ids += delta.new_token_ids
            self._text.append(delta.new_text)
            if delta.logprobs:
                self._logprobs += delta.logprobs

    def output(self) -> CompletionOutput:
        """The sequence so far, whole (an ``accumulate``-ing choice's)."""
        if len(self._text) > 1:
            self._text[:] = ["".join(self._text)]
        return CompletionOutput(
            index=self.index_in_prompt,
            text=self._text[0] if self._text else "",
            token_ids=self._token_ids,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=None if self.params.logprobs is None else self._logprobs,
        )


def expand(
    prompts: Sequence[list[int]], params: Sequence[SamplingParams], accumulate: bool = True
) -> list[Choice]:
    """``params[p].n`` choices of each prompt ``p``, in order."""
    choices: list[Choice] = []
    for p, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True)):
        for i in range(prompt_params.n):
            choice_params = prompt_params.for_choice(i)
            choices.append(Choice(len(choices), p, i, prompt, choice_params, accumulate))
    return choices


def group(choices: Sequence[Choice], num_prompts: int) -> list[RequestOutput]:
    """Finished (accumulated) choices as one ``RequestOutput`` per prompt, in prompt order."""
    by_prompt: list[list[Choice]] = [[] for _ in range(num_prompts)]
    for choice in choices:
        by_prompt[choice.prompt_index].append(choice)
    return [
        RequestOutput(
            request_id=mine[0].request_id,
            prompt=None,
            prompt_token_ids=mine[0].prompt_token_ids,
            outputs=[c.output() for c in mine],
            finished=all(c.finished for c in mine),
            num_cached_tokens=mine[0].num_cached_tokens,
            metrics=mine[0].metrics,
            prompt_logprobs=mine[0].prompt_logprobs,
        )
        for mine in by_prompt
    ]


def usage_counts(choices: Sequence[Choice]) -> tuple[int, int, int]:
    """(prompt, output, cached) tokens of a request's choices: each prompt counts once, as its
    first choice saw it."""
    firsts = [c for c in choices if c.index_in_prompt == 0]
    return (
        sum(len(c.prompt_token_ids) for c in firsts),
        sum(c.num_tokens for c in choices),
        sum(c.num_cached_tokens for c in firsts),
    )
