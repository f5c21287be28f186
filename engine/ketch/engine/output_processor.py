"""Text from the engine's token ids, on the API server's side (and ``LLM``'s).

The engine emits ``TokenDelta``s (token ids, logprobs, finish reasons; never text);
``OutputProcessor`` turns each into a ``RequestDelta`` with its text, as vLLM v1's output
processor does: an incremental detokenizer per request, and stop strings matched on the text.
A stop string ends the output: the text is cut before it, the finish reason is "stop" and the
stop reason the string, and the tokens after the one that completed it (a speculative step
emits several) are dropped with their logprobs.

A request the engine still runs when its text reaches a stop string is handed to the caller to
end (``take_aborts``: the engine frees its blocks). Its final delta is held until the engine's
end for it arrives, bringing its metrics (finished "stop", the kept tokens counted); tokens the
engine made meanwhile are dropped. A request that wants its output only at its end
(``final_only``) gets one delta; without stop strings to watch, the engine sends it once and
its text is decoded once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ketch.engine.detokenizer import IncrementalDetokenizer
from ketch.engine.outputs import RequestDelta, TokenDelta
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Output:
    """One request's output on the text side."""

    detokenizer: IncrementalDetokenizer | None  # None: an embedding request, no text
    final_only: bool  # handed out once, at the end (``held`` until then)
    engine_final_only: bool  # the engine sends one delta: decoded once, no stop strings
    num_tokens: int = 0  # output tokens handed out (or held) so far
    held: RequestDelta | None = None


@dataclass
class _Stopping:
    """A request ended at a stop string, its engine request being ended."""

    num_tokens: int  # output tokens kept
    final: RequestDelta | None  # handed out with the engine's end (None: nobody waits)


class OutputProcessor:
    """Each watched request's detokenizer and stop strings, by request id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._outputs: dict[str, _Output] = {}
        self._stopping: dict[str, _Stopping] = {}
        self._to_stop: dict[str, int] = {}  # request id -> output tokens kept
        self._to_abort: list[str] = []  # failed here: the engine must end them

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        final_only: bool = False,
    ) -> bool:
        """Watches a request's output. Returns whether the engine may send it once, at its end
        (``final_only`` and no stop strings to watch for)."""
        if request_id in self._outputs or request_id in self._stopping:
            raise ValueError(f"request id {request_id!r} is already in use")
        detokenizer = None
        if params.pooling is None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens
            )
        engine_final_only = final_only and not params.stop
        self._outputs[request_id] = _Output(detokenizer, final_only, engine_final_only)
        return engine_final_only

    def is_stopping(self, request_id: str) -> bool:
        """Whether the request ended at a stop string and its engine request is being ended
        (``take_aborts`` asks for it: no other abort is needed)."""
        return request_id in self._stopping

    def drop(self, request_id: str) -> None:
        """Forgets a request nobody waits for; one ended at a stop string is kept until the
        engine's end for it (whose metrics are corrected then)."""
        self._outputs.pop(request_id, None)
        stopping = self._stopping.get(request_id)
        if stopping is not None:
            stopping.final = None

    def forget(self, request_id: str) -> None:
        """Forgets a request entirely (its engine output is lost)."""
        self._outputs.pop(request_id, None)
        self._stopping.pop(request_id, None)
        self._to_stop.pop(request_id, None)

    def clear(self) -> None:
        self._outputs.clear()
        self._stopping.clear()
        self._to_stop.clear()
        self._to_abort.clear()

    def take_aborts(self) -> tuple[list[str], dict[str, int]]:
        """The engine requests to end since the last call: (failed here, to abort; ended at a
        stop string, with the output tokens kept)."""
        aborts, self._to_abort = self._to_abort, []
        stops, self._to_stop = self._to_stop, {}
        return aborts, stops

    def process(self, delta: TokenDelta) -> RequestDelta | None:
        """The delta with its text; None when nothing is to be handed out (a request not
        watched here, a ``final_only`` one before its end, tokens after a stop string)."""
        request_id = delta.request_id
        output = self._outputs.get(request_id)
        if output is None:  # not watched, or ended at a stop string (its engine end awaited)
            stopping = self._stopping.get(request_id)
            if stopping is None or not delta.finished:
                return None
            return self._stopped_end(delta, stopping)
        if delta.error is not None or output.detokenizer is None:
            del self._outputs[request_id]
            return _without_text(delta)
        try:
            return self._text(delta, output)
        except Exception as exc:  # one request's fault (a tokenizer bug): it fails alone
            logger.exception("making the text of request %s failed", request_id)
            del self._outputs[request_id]
            if not delta.finished:
                self._to_abort.append(request_id)
            error = f"internal error: {type(exc).__name__}: {exc}"
            return RequestDelta(request_id, error=error, error_code=500)

    def _text(self, delta: TokenDelta, output: _Output) -> RequestDelta | None:
        detokenizer = output.detokenizer
        assert detokenizer is not None
        tokens, logprobs = delta.new_token_ids, delta.logprobs
        stopped = False
        if output.engine_final_only:
            detokenizer.add_tokens_unchecked(tokens)
        else:
            for i, token_id in enumerate(tokens):
                if detokenizer.add_token(token_id):
                    stopped, dropped = True, len(tokens) - i - 1
                    if dropped:
                        tokens = tokens[: i + 1]
                        if logprobs:
                            logprobs = logprobs[: len(logprobs) - dropped]
                    break
        output.num_tokens += len(tokens)
        finished = delta.finished or stopped
        if finished:
            detokenizer.finish()
            del self._outputs[delta.request_id]
        text = detokenizer.take_delta(finished) if finished or not output.final_only else ""
        out = RequestDelta(  # by position: half the cost of keywords, once a token
            delta.request_id,
            tokens,
            text,
            "stop" if stopped else delta.finish_reason,
            detokenizer.stop_string if stopped else delta.stop_reason,
            delta.num_prompt_tokens,
            delta.num_cached_tokens,
            logprobs,
            delta.prompt_logprobs,
            metrics=delta.metrics,
        )
        if output.final_only:
            out = _fold(output, out)
            if not finished:
                return None
        if stopped and not delta.finished:  # the engine runs it on: end it there first
            self._to_stop[delta.request_id] = output.num_tokens
            self._stopping[delta.request_id] = _Stopping(output.num_tokens, out)
            return None
        if stopped:
            _count_kept(out, output.num_tokens)
        return out

    def _stopped_end(self, delta: TokenDelta, stopping: _Stopping) -> RequestDelta | None:
        """The engine's end of a request ended at a stop string: its metrics (corrected if the
        engine finished it on its own meanwhile) go on the held final delta."""
        del self._stopping[delta.request_id]
        self._to_stop.pop(delta.request_id, None)
        final = stopping.final
        if delta.metrics is not None:
            if final is not None:
                final.metrics = delta.metrics
            _count_kept(delta, stopping.num_tokens)
        return final


def _fold(output: _Output, out: RequestDelta) -> RequestDelta:
    """``out`` added to what a ``final_only`` request holds (in place: linear in its length)."""
    held = output.held
    if held is None:
        output.held = out
        return out
    held.new_token_ids += out.new_token_ids
    held.new_text += out.new_text
    if out.logprobs:
        held.logprobs = (held.logprobs or []) + out.logprobs
    if held.prompt_logprobs is None:
        held.prompt_logprobs = out.prompt_logprobs
    held.finish_reason, held.stop_reason = out.finish_reason, out.stop_reason
    held.num_cached_tokens, held.metrics = out.num_cached_tokens, out.metrics
    return held


def _count_kept(delta: TokenDelta | RequestDelta, num_tokens: int) -> None:
    """A request ended at a stop string: its metrics say so, counting the tokens kept."""
    metrics = delta.metrics
    if metrics is not None:
        metrics.finish_reason = "stop"
        metrics.num_generation_tokens = min(num_tokens, metrics.num_generation_tokens)


def _without_text(delta: TokenDelta) -> RequestDelta:
    """An error or an embedding request's delta, as it came."""
    return RequestDelta(
        request_id=delta.request_id,
        new_token_ids=delta.new_token_ids,
        finish_reason=delta.finish_reason,
        stop_reason=delta.stop_reason,
        num_prompt_tokens=delta.num_prompt_tokens,
        num_cached_tokens=delta.num_cached_tokens,
        logprobs=delta.logprobs,
        prompt_logprobs=delta.prompt_logprobs,
        error=delta.error,
        error_code=delta.error_code,
        metrics=delta.metrics,
        embedding=delta.embedding,
    )
