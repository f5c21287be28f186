"""``--speculative-config``: which proposer drafts tokens and how many (no paddle here).

Given as JSON on the command line, a mapping in a config file or ``LLM(...)``, or the CRD's
``engine.speculativeConfig`` object; the same checks run on every path, each naming the key.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

METHODS = ("ngram", "draft", "mtp")
MAX_SPECULATIVE_TOKENS = 16
"""Most tokens proposed per step: past that even a perfect proposer's rows cost more than the
weight pass they share (and a bad one's are pure waste)."""
MAX_LOOKUP = 64
MAX_JSON_BYTES = 4096
MAX_JSON_DEPTH = 8  # the object is flat; anything deeper is wrong whatever it holds


def _nesting(text: str) -> int:
    """The deepest ``[``/``{`` nesting in JSON text, brackets inside strings not counted."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


"""Longest ``--speculative-config`` text: its six keys fit in a few hundred bytes."""
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
"""Default ``disable_by_batch_size`` (docs/speculative.md, "Where speculation stops paying"):
with k=4 a batch of 8 computes 40 rows, about 4x a plain step's time on a large model's layers
on a CPU, so past 8 running requests the proposals cost more than the tokens they win back."""
MAX_DISABLE_BY_BATCH_SIZE = 1 << 20


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class SpeculativeConfig:
    """One engine's speculative decoding: ``method`` proposes up to ``num_speculative_tokens``
    tokens per request per decode step; the model verifies them all in that step."""

    method: str = field(
        metadata={
            "help": "What proposes the tokens: 'ngram' (prompt lookup), 'draft' (a smaller "
            "checkpoint) or 'mtp' (the checkpoint's multi-token-prediction layer).",
            "choices": METHODS,
        }
    )
    num_speculative_tokens: int = field(
        metadata={
            "help": "Most tokens proposed per request per decode step (k); the model verifies "
            "them all in that step.",
            "minimum": 1,
            "maximum": MAX_SPECULATIVE_TOKENS,
        }
    )
    prompt_lookup_max: int = _opt(
        4,
        "ngram: the longest suffix n-gram looked up in the request's earlier tokens.",
        minimum=1,
        maximum=MAX_LOOKUP,
    )
    prompt_lookup_min: int = _opt(
        2,
        "ngram: the shortest suffix n-gram looked up; at most prompt_lookup_max.",
        minimum=1,
        maximum=MAX_LOOKUP,
    )
    model: str | None = _opt(
        None,
        "draft only (required there, refused otherwise): a smaller checkpoint with the target's "
        "tokenizer, as a local directory or 'tiny'.",
    )
    disable_by_batch_size: int = _opt(
        DEFAULT_DISABLE_BY_BATCH_SIZE,
        "A step with more running requests than this does not speculate (0: never turn it off).",
        minimum=0,
        maximum=MAX_DISABLE_BY_BATCH_SIZE,
    )

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {list(METHODS)}, got {self.method!r}"
            )
        for f in dataclasses.fields(self):  # the bounds the CRD's schema also carries
            if "minimum" in f.metadata:
                high = f.metadata["maximum"]
                if f.name == "prompt_lookup_min" and isinstance(self.prompt_lookup_max, int):
                    high = min(high, self.prompt_lookup_max)  # and a CEL rule in the CRD
                _int_in(self, f.name, f.metadata["minimum"], high)
        if self.method == "draft":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    "speculative_config.model is required for method 'draft': the path of a "
                    "smaller checkpoint with the same tokenizer"
                )
        elif self.model is not None:
            raise ValueError(
                f"speculative_config.model is for method 'draft' only (method is {self.method!r})"
            )

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """A ``SpeculativeConfig`` from itself, a mapping or JSON text (``None``, ``""`` and
        ``"null"``: no speculation). Unknown keys and wrong types are errors naming the key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip() or value.strip() == "null":
                return None
            if len(value) > MAX_JSON_BYTES:
                raise ValueError(
                    f"speculative_config is {len(value)} characters; at most {MAX_JSON_BYTES}"
                )
            if _nesting(value) > MAX_JSON_DEPTH:
                # refused before decoding: whether the decoder's recursion limit is reached
                # depends on the process (a library may raise sys.setrecursionlimit)
                raise ValueError(
                    f"speculative_config is nested too deep (more than {MAX_JSON_DEPTH} levels)"
                )
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from exc
            if value is None:
                return None
        if not isinstance(value, dict):
            raise ValueError(
                'speculative_config must be a JSON object such as {"method": "ngram", '
                '"num_speculative_tokens": 4}'
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {unknown[:5]}; known: {sorted(known)}"
            )
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ValueError(f"speculative_config.{required} is required")
        return cls(**value)

    def to_json(self) -> str:
        """The compact JSON ``parse`` reads back (what the operator renders as the flag)."""
        body = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return json.dumps(body, separators=(",", ":"), sort_keys=True)

    def describe(self) -> str:
        """For the start-up log: the method, k and the method's own settings."""
        extra = {
            "ngram": f", n-grams {self.prompt_lookup_max}..{self.prompt_lookup_min}",
            "draft": f", draft model {self.model}",
            "mtp": ", the checkpoint's multi-token-prediction layer",
        }[self.method]
        off = (
            f"; off in steps with more than {self.disable_by_batch_size} running requests"
            if self.disable_by_batch_size
            else ""
        )
        return f"{self.method}, k={self.num_speculative_tokens}{extra}{off}"


def _int_in(config: SpeculativeConfig, name: str, low: int, high: int) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(
            f"speculative_config.{name} must be an integer in [{low}, {high}], got {value!r}"
        )
