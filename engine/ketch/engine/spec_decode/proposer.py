"""What proposes draft tokens to the model runner (rank 0 of a worker; one per engine).

Each decode step the runner asks for up to ``DraftRequest.max_tokens`` tokens per request the
scheduler left room for; the runner then computes the request's last token and every draft in
one span, and keeps the drafts the model agrees with (``ketch.engine.spec_decode.verify``).
Whatever a proposer proposes, the output is the model's own: a bad proposal only costs rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class DraftRequest:
    """One request that may speculate this step."""

    request_id: str
    # Its tokens (prompt and output so far); the last one is the one this step computes.
    token_ids: list[int]
    # Its KV block table (a draft model writes its own cache at the same block ids).
    block_ids: list[int]
    # The most drafts it may get (the scheduler's room: k, its max_tokens and its blocks).
    max_tokens: int


@dataclass
class StepHidden:
    """The final hidden state (after the model's last norm) of the positions one step computed,
    for proposers that draft from it (``Proposer.wants_hidden``): per request, its first
    position and its rows, in position order."""

    rows: np.ndarray  # [rows, hidden] float32
    spans: dict[str, tuple[int, int, int]]  # request id -> (first position, first row, count)
    # Per request: its tokens after the step (those it sampled appended), and its block table.
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    block_ids: dict[str, list[int]] = field(default_factory=dict)


class Proposer:
    """Drafts tokens; every method is called on rank 0 only."""

    wants_hidden = False  # MTP: the runner hands it each step's hidden states (``observe``)

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """Drafts per request (fewer than asked, or none, is fine)."""
        raise NotImplementedError

    def observe(self, hidden: StepHidden, accepted: dict[str, int]) -> None:
        """After a step: the hidden states it computed, and per request the number of its
        positions that hold the request's real tokens (computed ones, drafts kept)."""

    def forget(self, request_id: str) -> None:
        """The request is gone, or its block table was replaced (resumed after a preemption):
        whatever the proposer keeps for it is dropped."""
