"""Turns logits into next tokens: logit bias, penalties, temperature, top-k/top-p/min-p, seeded
draws; and the log-probabilities a request asks for (of sampled and of prompt tokens).

Each request owns a random generator seeded from its seed and draws exactly one number per
sampled token, so what it samples does not depend on which other requests share the batch.
Rows that need no processing (greedy, no penalties, no bias, no grammar) are decided by one
batched argmax. A request with a grammar draws only among the tokens its grammar allows next,
greedy included, and its matcher advances with every token appended (``SamplingState.accept``).
Log-probabilities are the model's own (log-softmax of the raw logits), before bias or penalties.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ketch.engine.sampling_params import SamplingParams
from ketch.engine.structured.compiler import RequestGrammar

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingState:
    """What the sampler keeps per request between steps."""

    params: SamplingParams
    token_ids: list[int]  # prompt + output, appended to as tokens are sampled
    num_prompt_tokens: int
    generator: np.random.Generator
    stop_ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    bias_ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    bias_values: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.float64))
    grammar: RequestGrammar | None = None

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        token_ids: list[int],
        num_prompt_tokens: int,
        seed: int,
        eos_token_ids: tuple[int, ...],
    ) -> SamplingState:
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(eos_token_ids)
        return cls(
            params=params,
            token_ids=token_ids,
            num_prompt_tokens=num_prompt_tokens,
            generator=np.random.Generator(np.random.PCG64(seed & _MASK64)),
            stop_ids=np.fromiter(sorted(stop), dtype=np.int64),
            bias_ids=np.array([t for t, _ in params.logit_bias], dtype=np.int64),
            bias_values=np.array([b for _, b in params.logit_bias], dtype=np.float64),
        )

    def accept(self, token: int) -> None:
        """Appends a sampled token (and moves the grammar's matcher past it)."""
        self.token_ids.append(token)
        if self.grammar is not None:
            self.grammar.accept(token)

    def skip_draws(self, num_tokens: int) -> None:
        """Advances the generator as sampling ``num_tokens`` tokens would have."""
        if not self.params.greedy:
            for _ in range(num_tokens):
                self.generator.random()

    @property
    def plain_greedy(self) -> bool:
        p = self.params
        return (
            p.greedy
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
            and not self.bias_ids.size
            and self.grammar is None
            and len(self.token_ids) - self.num_prompt_tokens >= p.min_tokens
        )


Logprobs = tuple[float, list[tuple[int, float]]]


def sample(
    logits: np.ndarray, states: list[SamplingState]
) -> tuple[list[int], list[Logprobs | None] | None]:
    """logits: [len(states), vocab] float32. Returns token ids and, if asked, logprobs."""
    tokens = np.empty(len(states), dtype=np.int64)
    plain = [i for i, s in enumerate(states) if s.plain_greedy]
    if plain:
        tokens[plain] = logits[plain].argmax(axis=-1)
    for i, state in enumerate(states):
        if not state.plain_greedy:
            tokens[i] = _sample_row(logits[i], state)
    chosen = tokens.tolist()
    if all(s.params.logprobs is None for s in states):
        return chosen, None
    return chosen, [
        None if s.params.logprobs is None else _logprobs(logits[i], chosen[i], s.params.logprobs)
        for i, s in enumerate(states)
    ]


def _sample_row(raw: np.ndarray, state: SamplingState) -> int:
    p = state.params
    row = raw.astype(np.float64)  # a copy: what one request does to it stays its own
    if state.bias_ids.size:
        inside = state.bias_ids < row.size
        row[state.bias_ids[inside]] += state.bias_values[inside]
    _apply_penalties(row, state)
    if state.grammar is not None:
        _apply_grammar(row, state.grammar)
    if len(state.token_ids) - state.num_prompt_tokens < p.min_tokens and state.stop_ids.size:
        stops = state.stop_ids[state.stop_ids < row.size]
        kept = row[stops].copy()
        row[stops] = -np.inf
        if state.grammar is not None and not np.isfinite(row).any():
            row[stops] = kept  # the grammar is complete: it ends before min_tokens
    if p.greedy:
        return int(row.argmax())
    row /= p.temperature
    if 0 < p.top_k < row.size:
        kth = np.partition(row, -p.top_k)[-p.top_k]
        row[row < kth] = -np.inf
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        cut = int(np.searchsorted(cumulative, p.top_p)) + 1  # keep the token crossing top_p
        probs[order[cut:]] = 0.0
    if p.min_p > 0.0:
        probs[probs < p.min_p * probs.max()] = 0.0
    cumulative = np.cumsum(probs)
    draw = state.generator.random() * cumulative[-1]
    return int(min(np.searchsorted(cumulative, draw, side="right"), row.size - 1))


def _apply_grammar(row: np.ndarray, grammar: RequestGrammar) -> None:
    """Rules out every token the grammar does not allow next (padding rows past the vocabulary
    included)."""
    allowed = grammar.allowed()
    size = min(allowed.size, row.size)
    row[:size][~allowed[:size]] = -np.inf
    row[size:] = -np.inf


def _apply_penalties(row: np.ndarray, state: SamplingState) -> None:
    p = state.params
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(state.token_ids, dtype=np.int64))
        seen = seen[seen < row.size]
        values = row[seen]
        row[seen] = np.where(
            values > 0, values / p.repetition_penalty, values * p.repetition_penalty
        )
    if p.presence_penalty or p.frequency_penalty:
        output = np.asarray(state.token_ids[state.num_prompt_tokens :], dtype=np.int64)
        counts = np.bincount(output[output < row.size], minlength=row.size)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _logprobs(raw: np.ndarray, chosen: int, top_n: int) -> Logprobs:
    row = raw.astype(np.float64)
    shifted = row - row.max()
    logp = shifted - np.log(np.exp(shifted).sum())
    return float(logp[chosen]), _top(logp, top_n)


def _top(logp: np.ndarray, top_n: int) -> list[tuple[int, float]]:
    """The ``top_n`` most likely (token id, logprob) of one row, most likely first."""
    top_n = min(top_n, logp.size)
    if not top_n:
        return []
    ids = np.argpartition(-logp, top_n - 1)[:top_n]
    ids = ids[np.argsort(-logp[ids], kind="stable")]
    return [(int(t), float(logp[t])) for t in ids]


def prompt_logprobs(logits: np.ndarray, token_ids: list[int], top_n: int) -> list[Logprobs]:
    """Per row of ``logits`` [rows, vocab]: the log-probability of ``token_ids[row]`` (the token
    that followed that position) and the ``top_n`` most likely tokens there."""
    rows = logits.astype(np.float64)
    rows -= rows.max(axis=-1, keepdims=True)
    rows -= np.log(np.exp(rows).sum(axis=-1, keepdims=True))
    chosen = rows[np.arange(len(token_ids)), np.asarray(token_ids, dtype=np.int64)]
    return [(float(lp), _top(row, top_n)) for lp, row in zip(chosen, rows, strict=True)]
