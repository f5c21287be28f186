"""The checks of a request's token ids against the model, in one place with one wording each.

``check_prompt`` is what every sender of a request passes: the API server (before any work,
a 400 naming ``RequestCheckError.param``), ``LLM`` (a ValueError, before anything of the call
is queued) and the engine itself (``LLMEngine.add_request``: the request's own error, a 400,
in the engine process). The worker's ``worker/step_checks.py`` stays the guard against hostile
frames; this module is about requests.

``{field}`` is what the request calls the prompt (``prompt``, ``prompt 2``, ``input 0``):

- no tokens: ``{field} is empty (no tokens)``
- an id outside the vocabulary: ``{field} has token ids [...] outside the vocabulary [0, V)``
- too long to generate: ``{field} is N tokens, but max_model_len is M: it must be shorter to
  leave room for output``
- too long to embed: ``{field} is N tokens, but max_model_len is M``
- ``stop_token_ids``, ``logit_bias`` (and ``/detokenize``'s ``tokens``): ``stop_token_ids has
  token ids [...] outside the vocabulary [0, V)``

(At most five ids are listed.) A prompt that generates must leave room for one output token
(``len < max_model_len``); an embedding's (``SamplingParams.pooling``) may fill the context.
"""

from __future__ import annotations

from dataclasses import dataclass

from ketch.engine.sampling_params import SamplingParams

_SHOWN = 5  # ids listed in a message


@dataclass(frozen=True)
class PromptLimits:
    """What the model takes: token ids in ``[0, vocab_size)``, at most ``max_model_len`` of them
    (prompt and output together)."""

    vocab_size: int
    max_model_len: int


class RequestCheckError(ValueError):
    """A request the model cannot take; ``param`` names the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_prompt(
    limits: PromptLimits,
    ids: list[int],
    params: SamplingParams,
    field: str = "prompt",
    index: int | None = None,
) -> None:
    """Raises ``RequestCheckError`` unless the model can take prompt ``ids`` with ``params``.
    ``field`` (with ``index``, one of a request's several) is what the message calls it."""
    name = field if index is None else f"{field} {index}"
    if not ids:
        raise RequestCheckError(f"{name} is empty (no tokens)", field)
    check_token_ids(limits.vocab_size, ids, field, name)
    longest = limits.max_model_len - (params.pooling is None)  # room for one output token
    if len(ids) > longest:
        message = f"{name} is {len(ids)} tokens, but max_model_len is {limits.max_model_len}"
        if params.pooling is None:
            message += ": it must be shorter to leave room for output"
        raise RequestCheckError(message, field)
    check_token_ids(limits.vocab_size, params.stop_token_ids, "stop_token_ids")
    check_token_ids(limits.vocab_size, [t for t, _ in params.logit_bias], "logit_bias")


def check_token_ids(vocab_size: int, ids: list[int], field: str, name: str | None = None) -> None:
    """Raises ``RequestCheckError`` unless every id lies in ``[0, vocab_size)``."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):  # C speed: a long list costs little
        return
    bad = [t for t in ids if not 0 <= t < vocab_size][:_SHOWN]
    raise RequestCheckError(
        f"{name or field} has token ids {bad} outside the vocabulary [0, {vocab_size})", field
    )
