"""A runner without a model: every sampling request gets one fixed token, instantly (and
every embedding request one fixed unit vector).

For measuring the serving path alone (HTTP, ZMQ, scheduler, detokenisation) with the model's
cost removed; selected with ``--runner null``. It keeps only what it needs to know which
requests sample in a step: each request's token count.
"""

from __future__ import annotations

from collections.abc import Collection

from ketch.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from ketch.engine.tokenizer import Tokenizer


class NullRunner:
    """Drop-in for ``ModelRunner`` that always samples ``token_id``."""

    def __init__(self, token_id: int, hidden_size: int = 1) -> None:
        self.token_id = token_id
        self.embedding = [1.0] + [0.0] * (hidden_size - 1)
        self._num_tokens: dict[str, int] = {}
        self._computed: dict[str, int] = {}
        self._pooling: set[str] = set()

    @classmethod
    def for_model(
        cls,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Collection[int],
        hidden_size: int = 1,
    ) -> NullRunner:
        """Samples a token that is neither EOS nor special, so requests run to max_tokens."""
        for candidate in range(vocab_size):
            if candidate not in eos_token_ids and tokenizer.decode([candidate]).strip():
                return cls(candidate, hidden_size)
        raise ValueError("the tokenizer has no printable token for the null runner")

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in sched.finished_request_ids:
            self._num_tokens.pop(request_id, None)
            self._computed.pop(request_id, None)
            self._pooling.discard(request_id)
        for new in sched.new_requests:
            self._num_tokens[new.request_id] = len(new.token_ids)
            self._computed[new.request_id] = new.num_computed_tokens
            if new.sampling_params.pooling is not None:
                self._pooling.add(new.request_id)
        cached = sched.cached_requests
        for request_id, computed in zip(
            cached.request_ids, cached.num_computed_tokens, strict=True
        ):
            self._computed[request_id] = computed
        sampled = []
        pooled = {}
        for request_id, n in sched.num_scheduled_tokens.items():
            self._computed[request_id] += n
            if self._computed[request_id] < self._num_tokens[request_id]:
                continue
            if request_id in self._pooling:
                pooled[request_id] = self.embedding
            else:
                sampled.append(request_id)
                self._num_tokens[request_id] += 1
        return ModelRunnerOutput(sampled, [self.token_id] * len(sampled), pooled=pooled)
