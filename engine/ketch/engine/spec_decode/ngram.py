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


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_n = config.prompt_lookup_max
        self.min_n = config.prompt_lookup_min

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        drafts = {}
        for request in requests:
            tokens = np.asarray(request.token_ids, dtype=np.int64)
            found = lookup(tokens, self.max_n, self.min_n, request.max_tokens)
            if found:
                drafts[request.request_id] = found
        return drafts
