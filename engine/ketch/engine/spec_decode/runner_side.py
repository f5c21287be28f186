"""The model runner's side of speculative decoding: asking the proposer (rank 0), sharing its
drafts with the other tensor-parallel ranks, checking the drafts after the forward pass
(``verify``) and handing hidden states to a proposer that drafts from them (MTP).

``ModelRunner`` owns one ``Speculation`` when ``--speculative-config`` is set; the runner itself
only lays the drafts out in the step's inputs (``StepInputs.drafts`` / ``spec_rows``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ketch.engine.spec_decode import factory
from ketch.engine.spec_decode.proposer import Proposer, StepHidden
from ketch.engine.spec_decode.verify import drafts_wanted, grammar_prefix, verify

if TYPE_CHECKING:
    from ketch.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from ketch.engine.models.protocol import DecoderModel
    from ketch.engine.worker.runner_config import RunnerConfig
    from ketch.engine.worker.step_inputs import RequestState, StepInputs
    from ketch.engine.worker.tensor_parallel import StepSync


class Speculation:
    """One runner's speculative decoding: the proposer on rank 0, the checks, the hand-offs."""

    def __init__(
        self, config: RunnerConfig, model: DecoderModel, first_rank: bool, sync: StepSync | None
    ):
        self.config = config
        self.sync = sync
        # Known from the method alone, so every rank computes the same hidden rows.
        self.wants_hidden = factory.wants_hidden(config.speculative)
        self.proposer: Proposer | None = None
        if first_rank:
            self.proposer = factory.make_proposer(config, model)  # (tests replace it)
            if self.proposer.wants_hidden != self.wants_hidden:
                raise RuntimeError("the proposer's wants_hidden disagrees with its method's")

    def propose(
        self, sched: SchedulerOutput, requests: dict[str, RequestState], failed: dict[str, str]
    ) -> dict[str, list[int]]:
        """Drafts for the decode requests the scheduler left room for (rank 0 proposes; with
        tensor parallelism every rank takes rank 0's, so their batches agree). Each is cut to
        the room, to the vocabulary, and to what the request's grammar accepts."""
        drafts: dict[str, list[int]] = {}
        if self.proposer is not None:
            cfg = self.config
            wants = drafts_wanted(
                sched, requests, failed, cfg.speculative, cfg.block_size, cfg.max_model_len
            )
            if wants:
                vocab = cfg.model_config.vocab_size
                for request_id, tokens in self.proposer.propose(list(wants.values())).items():
                    state = requests[request_id].sampling
                    tokens = [t for t in tokens[: wants[request_id].max_tokens] if 0 <= t < vocab]
                    if state.grammar is not None:
                        tokens = grammar_prefix(state.grammar, tokens)
                    if tokens:
                        drafts[request_id] = tokens
        if self.sync is not None:
            drafts = self.sync.share_drafts(drafts)
        return drafts

    def verify(
        self,
        drafts: dict[str, tuple[list[int], int]],
        spec_logits: np.ndarray,
        output: ModelRunnerOutput,
        requests: dict[str, RequestState],
    ) -> None:
        """Each sampled request's drafts against the model's own tokens (``verify``); the
        positions of drafts kept count as computed. ``drafts``: per request its drafts and the
        row of ``spec_logits`` scoring the first."""
        for i, request_id in enumerate(output.request_ids):
            entry = drafts.get(request_id)
            if entry is None:
                continue
            proposed, first_row = entry
            state = requests[request_id]
            rows = spec_logits[first_row : first_row + len(proposed)]
            extra, logprobs = verify(state.sampling, output.sampled_token_ids[i], proposed, rows)
            state.num_computed_tokens += len(extra)
            output.num_draft_tokens[request_id] = len(proposed)
            if extra:
                output.extra_token_ids[request_id] = extra
                if logprobs:
                    output.extra_logprobs[request_id] = logprobs

    def observe(
        self,
        batch: StepInputs,
        hidden: np.ndarray,
        output: ModelRunnerOutput,
        requests: dict[str, RequestState],
    ) -> None:
        """Hands the step's hidden states to the proposer, with per request the number of its
        computed positions that hold its real tokens: the scheduled ones (less a deferred last
        one) and the drafts kept. Failed and embedding requests are left out."""
        if self.proposer is None:
            return
        step = StepHidden(hidden, {})
        accepted = {}
        deferred = set(output.deferred)
        for request_id, span in zip(batch.span_ids, batch.spans, strict=True):
            state = requests.get(request_id)
            if state is None or request_id in output.failed or state.pooler is not None:
                continue
            proposed = batch.drafts.get(request_id)
            scheduled = span.query_len - (len(proposed[0]) if proposed else 0)
            real = scheduled - (request_id in deferred)
            real += len(output.extra_token_ids.get(request_id, ()))
            step.spans[request_id] = (span.context_len - span.query_len, span.start, span.query_len)
            step.token_ids[request_id] = state.sampling.token_ids
            step.block_ids[request_id] = state.block_ids
            accepted[request_id] = real
        if step.spans:
            self.proposer.observe(step, accepted)

    def forget(self, request_id: str) -> None:
        """The request is gone, or resumed with a new block table."""
        if self.proposer is not None:
            self.proposer.forget(request_id)
