"""Embedding requests in the runner: which hidden rows each step pools, and the running pool.

An embedding request (``SamplingParams.pooling``) samples nothing; the model's forward returns
the final-normed hidden states of the rows asked for (``hidden_rows``), and the request's
``Pooler`` keeps what it needs across the chunks of its prompt: nothing for ``last`` (the last
prompt token is computed in the final chunk whatever the prefix cache held), a float64 sum for
``mean``. Each prompt position is pooled once, even when a preemption recomputes the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Pooler:
    """One embedding request's pooling state in the runner."""

    how: str  # "last" or "mean"
    num_prompt_tokens: int
    next_position: int = 0  # mean: the first prompt position not pooled yet
    total: np.ndarray | None = None  # mean: the sum of the rows pooled so far (float64)

    def positions(self, begin: int, n: int) -> tuple[int, int]:
        """(first position, count) of this chunk (positions begin..begin+n-1) to pool."""
        end = begin + n
        if self.how == "last":
            return (end - 1, 1) if end == self.num_prompt_tokens else (end, 0)
        first = max(self.next_position, begin)
        self.next_position = max(self.next_position, end)
        return first, max(0, end - first)

    def add(self, rows: np.ndarray, final: bool) -> list[float] | None:
        """Takes this chunk's hidden ``rows``; the pooled vector once the prompt is done."""
        if self.how == "mean" and len(rows):
            total = rows.sum(axis=0, dtype=np.float64)
            self.total = total if self.total is None else self.total + total
        if not final:
            return None
        if self.how == "last":
            return rows[-1].astype(np.float32).tolist()
        if self.total is None:  # cannot happen: a prompt has at least one position
            raise ValueError("mean pooling saw no hidden rows")
        return (self.total / self.num_prompt_tokens).astype(np.float32).tolist()


@dataclass
class HiddenRows:
    """One step's rows whose final hidden states embedding requests pool, in row order, and
    per request (request id, how many of those rows, whether its prompt ends this step)."""

    rows: list[int] = field(default_factory=list)
    spans: list[tuple[str, int, bool]] = field(default_factory=list)

    def add(self, request_id: str, pooler: Pooler, begin: int, n: int, start: int) -> None:
        """The rows of a chunk (positions begin..begin+n-1, from batch row ``start``)."""
        first, count = pooler.positions(begin, n)
        final = begin + n == pooler.num_prompt_tokens
        if count or final:
            row = start + first - begin
            self.rows.extend(range(row, row + count))
            self.spans.append((request_id, count, final))

    def pool(self, hidden: np.ndarray, poolers: dict[str, Pooler]) -> dict[str, list[float]]:
        """Each request's rows of ``hidden`` to its pooler; the vectors of those done."""
        pooled = {}
        start = 0
        for request_id, count, final in self.spans:
            vector = poolers[request_id].add(hidden[start : start + count], final)
            start += count
            if vector is not None:
                pooled[request_id] = vector
        return pooled
