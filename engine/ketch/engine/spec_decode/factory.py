"""Builds the proposer a ``--speculative-config`` names (rank 0 of the worker)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ketch.engine.spec_decode.config import SpeculativeConfig
from ketch.engine.spec_decode.ngram import NgramProposer
from ketch.engine.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from ketch.engine.models.protocol import DecoderModel
    from ketch.engine.worker.runner_config import RunnerConfig

HIDDEN_METHODS = ("mtp",)
"""Methods whose proposer drafts from the target's hidden states (``Proposer.wants_hidden``)."""


def wants_hidden(spec: SpeculativeConfig | None) -> bool:
    """Whether the runner computes every position's final hidden state for the proposer: known
    from the configuration alone, so every tensor-parallel rank computes the same rows (only rank
    0 has the proposer)."""
    return spec is not None and spec.method in HIDDEN_METHODS


def make_proposer(config: RunnerConfig, model: DecoderModel) -> Proposer:
    """``model``: the target model (MTP drafts with its layers)."""
    spec = config.speculative
    if spec is None:
        raise ValueError("no speculative_config")
    if spec.method == "ngram":
        return NgramProposer(spec)
    if spec.method == "draft":
        from ketch.engine.spec_decode.draft import DraftProposer  # loads a model: paddle

        return DraftProposer(config)
    if spec.method == "mtp":
        from ketch.engine.spec_decode.mtp import MtpProposer

        return MtpProposer(config, model)
    raise ValueError(f"unknown speculative method {spec.method!r}")
