"""Per-request sampling parameters, validated when they are made."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
"""The most alternatives ``logprobs`` and ``prompt_logprobs`` may ask for per position."""
LOGIT_BIAS_LIMIT = 100.0
"""``logit_bias`` values lie in [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT], as in OpenAI's API."""
POOLINGS = ("last", "mean")
"""How an embedding request pools its prompt's final hidden states (``SamplingParams.pooling``)."""


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``seed`` makes sampling reproducible whatever else is in
    the batch. ``stop`` strings are matched on the detokenised text and are not included in it.
    ``logprobs`` asks for that many most likely tokens per position (0 returns only the chosen
    token's log-probability); ``prompt_logprobs`` the same for every prompt token after the
    first. Both are the model's own log-softmax, before any penalty or bias.
    ``logit_bias`` adds a number in [-100, 100] to a token's logit before each draw (greedy
    included); given as ``{token id: bias}`` or ``[(token id, bias), ...]``, it is kept as a
    list of pairs sorted by token id (so it travels between processes as it is).
    ``grammar`` constrains the output to a grammar (structured outputs), as the builders of
    ``ketch.engine.structured.grammars`` write it (a JSON schema, a regex, choices, Lark):
    every token is drawn from those the grammar allows next, end of sequence only where it
    accepts the output so far.
    ``pooling`` makes the request an embedding request: no token is sampled; it finishes when
    its prompt is computed, with the model's final-normed hidden state of the last prompt token
    (``"last"``) or their mean over the prompt (``"mean"``). Settings that shape sampled output
    (logprobs, prompt_logprobs, grammar, logit_bias, stop, n > 1) are refused beside it; the
    others change nothing.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    skip_special_tokens: bool = True
    grammar: str | None = None
    pooling: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = _bias_pairs(self.logit_bias)
        self._validate()

    def for_choice(self, i: int) -> SamplingParams:
        """The params of the i-th of ``n`` sequences: n=1, and a seeded request gets seed + i
        (wrapped to 64 bits, as the sampler does) so the choices differ but stay reproducible."""
        seed = None if self.seed is None else (self.seed + i) % (1 << 64)
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _validate(self) -> None:
        _check_int(self, "n", low=1, high=128)
        _check_number(self, "temperature", low=0.0, high=100.0)
        _check_number(self, "top_p", low=0.0, high=1.0, low_open=True)
        _check_int(self, "top_k", low=-1)
        _check_number(self, "min_p", low=0.0, high=1.0)
        _check_number(self, "repetition_penalty", low=0.0, high=100.0, low_open=True)
        _check_number(self, "presence_penalty", low=-2.0, high=2.0)
        _check_number(self, "frequency_penalty", low=-2.0, high=2.0)
        if self.seed is not None:
            _check_int(self, "seed", low=-(2**63), high=2**64 - 1)
        if self.max_tokens is not None:
            _check_int(self, "max_tokens", low=1)
        _check_int(self, "min_tokens", low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(self, name, low=0, high=MAX_LOGPROBS)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative token ids")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar):
            raise ValueError("grammar must be a non-empty string")
        if self.pooling is not None:
            self._validate_pooling()

    def _validate_pooling(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {self.pooling!r}")
        sampled = [
            name
            for name in ("logprobs", "prompt_logprobs", "grammar")
            if getattr(self, name) is not None
        ]
        sampled += ["logit_bias"] if self.logit_bias else []
        sampled += ["stop"] if self.stop else []
        sampled += ["n"] if self.n != 1 else []
        if sampled:
            raise ValueError(
                f"pooling (an embedding request samples no token) does not combine with "
                f"{', '.join(sampled)}"
            )


def _bias_pairs(value: object) -> list[tuple[int, float]]:
    """``logit_bias`` as sorted (token id, bias) pairs; ValueError naming what is wrong."""
    if isinstance(value, dict):
        value = list(value.items())
    if not isinstance(value, list | tuple):
        raise ValueError("logit_bias must map token ids to numbers")
    pairs: dict[int, float] = {}
    for item in value:
        if not isinstance(item, list | tuple) or len(item) != 2:
            raise ValueError("logit_bias must map token ids to numbers")
        token, bias = item
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
        number = isinstance(bias, int | float) and not isinstance(bias, bool)
        if not number or not math.isfinite(bias) or abs(bias) > LOGIT_BIAS_LIMIT:
            raise ValueError(
                f"logit_bias values must be numbers in [-{LOGIT_BIAS_LIMIT:g}, "
                f"{LOGIT_BIAS_LIMIT:g}], got {bias!r} for token {token}"
            )
        pairs[token] = float(bias)
    return sorted(pairs.items())


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(params: SamplingParams, name: str, low: int, high: int | None = None) -> None:
    value = getattr(params, name)
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_number(
    params: SamplingParams, name: str, low: float, high: float, low_open: bool = False
) -> None:
    value = getattr(params, name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        left = "(" if low_open else "["
        raise ValueError(f"{name} must be in {left}{low}, {high}], got {value}")
    setattr(params, name, float(value))
