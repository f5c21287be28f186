"""Prompt lookup (``method: ngram``): the tokens that followed the latest earlier occurrence of
the sequence's last n tokens, for n from ``prompt_lookup_max`` down to ``prompt_lookup_min``.

Output that repeats its input (quoting a source, editing a passage, extracting fields, code)
finds its next tokens already written; anything else finds no match and costs nothing.
"""

from __future__ import annotations

import numpy as np

from ketch.engine.spec_decode.config import SpeculativeConfig
from ketch.engine.spec_decode.proposer import DraftRequest, Proposer


def lookup(tokens: np.ndarray, max_n: int, min_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens following the latest earlier match of the longest suffix n-gram
    (``max_n`` >= n >= ``min_n``) of ``tokens``; [] when none matches."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Starts of earlier windows (ending before the last token), filtered token by token.
        starts = np.flatnonzero(tokens[: length - n] == tokens[length - n])
        for j in range(1, n):
            if not starts.size:
                break
            starts = starts[tokens[starts + j] == tokens[length - n + j]]
        if starts.size:
            follow = int(starts[-1]) + n
            return tokens[follow : follow + k].tolist()
    return []


MAX_BACKOFF = 16
"""Most decode steps a request goes without proposals after proposals it rejected outright."""


class _Track:
    """What the proposer remembers of one request: its last proposal and its backoff."""

    __slots__ = ("backoff", "drafts", "length", "skip")

    def __init__(self) -> None:
        self.length = 0  # the request's length when ``drafts`` were proposed
        self.drafts: list[int] = []
        self.backoff = 0  # steps skipped after the next outright rejection
        self.skip = 0  # steps still to skip


class NgramProposer(Proposer):
    """Prompt lookup with a per-request backoff: where output does not repeat its input, short
    n-grams still match by chance and their proposals are wrong; each is a row the model
    computes for nothing. A request whose proposals were all rejected proposes nothing for the
    next 1, 2, 4 ... ``MAX_BACKOFF`` steps (doubling with each outright rejection); one kept
    proposal ends the backoff. Whether proposals were kept is read off the request's tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_n = config.prompt_lookup_max
        self.min_n = config.prompt_lookup_min
        self._tracks: dict[str, _Track] = {}

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        drafts = {}
        for request in requests:
            track = self._tracks.get(request.request_id)
            if track is None:
                track = self._tracks[request.request_id] = _Track()
            elif track.drafts:
                self._learn(track, request.token_ids)
            track.drafts = []
            if track.skip:
                track.skip -= 1
                continue
            tokens = np.asarray(request.token_ids, dtype=np.int64)
            found = lookup(tokens, self.max_n, self.min_n, request.max_tokens)
            if found:
                drafts[request.request_id] = found
                track.drafts, track.length = found, len(request.token_ids)
        return drafts

    @staticmethod
    def _learn(track: _Track, token_ids: list[int]) -> None:
        """Whether the first of the last proposals was kept: the token after the request's
        length then is the first draft."""
        if len(token_ids) > track.length and token_ids[track.length] == track.drafts[0]:
            track.backoff = 0
        else:
            track.skip = track.backoff = min(MAX_BACKOFF, max(1, 2 * track.backoff))

    def forget(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)
