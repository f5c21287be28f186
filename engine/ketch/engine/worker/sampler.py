"""Turns logits into next tokens: logit bias, penalties, temperature, top-k/top-p/min-p, seeded
draws; and the log-probabilities a request asks for (of sampled and of prompt tokens).

Each request owns a random generator seeded from its seed and draws exactly one number per
sampled token, so what it samples does not depend on which other requests share the batch.
Rows that need no processing (greedy, no penalties, no bias, no grammar) are decided by one
batched argmax. A request with a grammar draws only among the tokens its grammar allows next,
greedy included, and its matcher advances with every token appended (``SamplingState.accept``).
Greedy rows whose only processing is a grammar are decided together too: the batch's argmax,
kept where its bit in the grammar's mask is set (then it is the masked argmax as well), the
masked argmax of the other rows otherwise.
Log-probabilities are the model's own (log-softmax of the raw logits), before bias or penalties,
as the ``TokenLogprob`` that goes on to the HTTP body; one that is not a finite number (a token
the logits rule out entirely, or broken logits) is reported as ``LOGPROB_FLOOR``, since JSON
cannot carry it (``ketch.engine.wire`` refuses NaN and infinities).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from ketch.engine.outputs import TokenLogprob
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.structured.compiler import RequestGrammar, next_bitmasks

_MASK64 = (1 << 64) - 1

LOGPROB_FLOOR = -9999.0
"""Reported for a log-probability below it or not a number (-inf, NaN)."""


def _finite(logprob: float) -> float:
    return logprob if LOGPROB_FLOOR <= logprob < math.inf else LOGPROB_FLOOR  # NaN: false


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

    @functools.cached_property
    def stop_set(self) -> frozenset[int]:
        """``stop_ids`` as a set (speculative decoding checks each kept token against it)."""
        return frozenset(self.stop_ids.tolist())

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
        """Greedy with nothing to apply to the logits: the batched argmax decides."""
        return self.grammar is None and self.greedy_unprocessed

    @property
    def greedy_unprocessed(self) -> bool:
        """Greedy with nothing but (maybe) a grammar to apply to the logits."""
        return (
            self._greedy_as_is
            and len(self.token_ids) - self.num_prompt_tokens >= self.params.min_tokens
        )

    @functools.cached_property
    def _greedy_as_is(self) -> bool:
        """Greedy with no penalties and no bias: what of ``greedy_unprocessed`` never changes."""
        p = self.params
        return (
            p.greedy
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
            and not self.bias_ids.size
        )


def sample(
    logits: np.ndarray, states: list[SamplingState]
) -> tuple[list[int], list[TokenLogprob | None] | None]:
    """logits: [len(states), vocab] float32. Returns token ids and, if asked, logprobs."""
    tokens = np.empty(len(states), dtype=np.int64)
    plain, masked, other = [], [], []
    for i, state in enumerate(states):
        if not state.greedy_unprocessed:
            other.append(i)
        else:
            (plain if state.grammar is None else masked).append(i)
    if plain:
        tokens[plain] = logits[plain].argmax(axis=-1)
    constrained = [i for i, s in enumerate(states) if s.grammar is not None]
    row_of = {i: row for row, i in enumerate(constrained)}  # in the batch's bitmasks
    bitmasks = next_bitmasks([states[i].grammar for i in constrained]) if constrained else None
    if masked:
        own = bitmasks if masked == constrained else bitmasks[[row_of[i] for i in masked]]
        rows = logits if len(masked) == len(states) else logits[masked]
        tokens[masked] = _masked_argmax(rows, own)
    for i in other:
        own = bitmasks[row_of[i]] if i in row_of else None
        tokens[i] = _sample_row(logits[i], states[i], own)
    chosen = tokens.tolist()
    if all(s.params.logprobs is None for s in states):
        return chosen, None
    return chosen, [
        None if s.params.logprobs is None else _logprobs(logits[i], chosen[i], s.params.logprobs)
        for i, s in enumerate(states)
    ]


def _masked_argmax(rows: np.ndarray, bitmasks: np.ndarray) -> list[int]:
    """Per row, the best token its bitmask (llguidance's layout) allows. Where the row's argmax
    is allowed it is the answer (masking only lowers the others), so only the other rows are
    unpacked and masked. (Each numpy call costs microseconds here, more after a forward pass
    has evicted the caches, so a few rows are checked one by one.)"""
    best = rows.argmax(axis=-1).tolist()
    limit = 32 * bitmasks.shape[1]
    denied = [
        i
        for i, t in enumerate(best)
        if t >= limit or not (int(bitmasks[i, t >> 5]) >> (t & 31)) & 1
    ]
    if len(denied) == len(best):
        return _masked(rows, bitmasks).argmax(axis=-1).tolist()
    if denied:
        masked = _masked(rows[denied], bitmasks[denied]).argmax(axis=-1).tolist()
        for i, token in zip(denied, masked, strict=True):
            best[i] = token
    return best


def _masked(rows: np.ndarray, bitmasks: np.ndarray) -> np.ndarray:
    """``rows`` with -inf for every token ``bitmasks`` does not allow (a new array)."""
    return np.where(_unpack(bitmasks, rows.shape[-1]), rows, -np.inf)


def _unpack(bitmasks: np.ndarray, vocab: int) -> np.ndarray:
    """Bitmasks [..., words] as bools [..., vocab] (tokens past the bitmask: not allowed)."""
    bits = np.unpackbits(bitmasks.view(np.uint8), axis=-1, count=vocab, bitorder="little")
    return bits.view(bool)


def _sample_row(raw: np.ndarray, state: SamplingState, bitmask: np.ndarray | None) -> int:
    p = state.params
    row = raw.astype(np.float64)  # a copy: what one request does to it stays its own
    if state.bias_ids.size:
        inside = state.bias_ids < row.size
        row[state.bias_ids[inside]] += state.bias_values[inside]
    _apply_penalties(row, state)
    if bitmask is not None:
        row[~_unpack(bitmask, row.size)] = -np.inf
    if len(state.token_ids) - state.num_prompt_tokens < p.min_tokens and state.stop_ids.size:
        stops = state.stop_ids[state.stop_ids < row.size]
        kept = row[stops].copy()
        row[stops] = -np.inf
        if bitmask is not None and not np.isfinite(row).any():
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


def _logprobs(raw: np.ndarray, chosen: int, top_n: int) -> TokenLogprob:
    row = raw.astype(np.float64)
    shifted = row - row.max()
    logp = shifted - np.log(np.exp(shifted).sum())
    return TokenLogprob(chosen, _finite(float(logp[chosen])), _top(logp, top_n))


def _top(logp: np.ndarray, top_n: int) -> list[tuple[int, float]]:
    """The ``top_n`` most likely (token id, logprob) of one row, most likely first."""
    top_n = min(top_n, logp.size)
    if not top_n:
        return []
    ids = np.argpartition(-logp, top_n - 1)[:top_n]
    ids = ids[np.argsort(-logp[ids], kind="stable")]
    return [(int(t), _finite(float(logp[t]))) for t in ids]


def prompt_logprobs(logits: np.ndarray, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """Per row of ``logits`` [rows, vocab]: the log-probability of ``token_ids[row]`` (the token
    that followed that position) and the ``top_n`` most likely tokens there."""
    rows = logits.astype(np.float64)
    rows -= rows.max(axis=-1, keepdims=True)
    rows -= np.log(np.exp(rows).sum(axis=-1, keepdims=True))
    chosen = rows[np.arange(len(token_ids)), np.asarray(token_ids, dtype=np.int64)]
    return [
        TokenLogprob(token, _finite(float(lp)), _top(row, top_n))
        for token, lp, row in zip(token_ids, chosen, rows, strict=True)
    ]
