"""Builds the proposer a ``--speculative-config`` names (rank 0 of the worker)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ketch.engine.spec_decode.ngram import NgramProposer
from ketch.engine.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from ketch.engine.worker.model_runner import RunnerConfig


def make_proposer(config: RunnerConfig, model: object) -> Proposer:
    """``model``: the target model (MTP drafts with its layers)."""
    spec = config.speculative
    if spec is None:
        raise ValueError("no speculative_config")
    if spec.method == "ngram":
        return NgramProposer(spec)
    if spec.method == "draft":
        from ketch.engine.spec_decode.draft import DraftProposer  # loads a model: paddle

        return DraftProposer(config)
    raise NotImplementedError(f"speculative method {spec.method!r} is not built yet")
