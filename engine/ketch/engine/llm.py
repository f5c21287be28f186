"""Offline inference: ``LLM(model="tiny").generate(prompts, params)``.

The engine runs in this process and emits token ids; ``LLM`` makes their text as the API server
does (``OutputProcessor``), ending a request in the engine when its text reaches a stop string.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from ketch.engine.choices import Choice, expand, group
from ketch.engine.config import EngineConfig
from ketch.engine.llm_engine import LLMEngine
from ketch.engine.output_processor import OutputProcessor
from ketch.engine.outputs import EmbeddingOutput, RequestDelta, RequestOutput, l2_normalized
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.tokenizer import Message

Prompt = str | list[int]


class LLM:
    """Runs a batch of prompts to completion through the continuous-batching engine."""

    def __init__(self, model: str = "tiny", **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))
        self._processor = OutputProcessor(self.engine.tokenizer)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; outputs come back in the order of the prompts."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(prompt_list))
        # Validate everything before queueing anything, so a bad prompt loses nothing.
        tokenized = [
            self.engine.tokenize_prompt(prompt, prompt_params)
            for prompt, prompt_params in zip(prompt_list, params_list, strict=True)
        ]
        choices = expand([ids for _, ids in tokenized], params_list)
        by_id: dict[str, Choice] = {}
        for choice in choices:
            choice.request_id = str(next(self._ids))
            self._add(choice.request_id, choice.prompt_token_ids, choice.params, final_only=True)
            by_id[choice.request_id] = choice
        for delta in self._run():
            by_id[delta.request_id].add(delta)
        outputs = group(choices, len(prompt_list))
        for output, (text, _) in zip(outputs, tokenized, strict=True):
            output.prompt = text
        return outputs

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling: str = "last", normalize: bool = True
    ) -> list[EmbeddingOutput]:
        """Each prompt's embedding, in order: the model's final-normed hidden state of the last
        prompt token (``pooling="last"``) or their mean over the prompt (``"mean"``),
        L2-normalised unless ``normalize`` is false. A prompt may fill ``max_model_len``."""
        prompt_list = _as_prompt_list(prompts)
        params = SamplingParams(pooling=pooling)
        tokenized = [self.engine.tokenize_prompt(prompt, params) for prompt in prompt_list]
        ids = [str(next(self._ids)) for _ in tokenized]
        for request_id, (_, token_ids) in zip(ids, tokenized, strict=True):
            self._add(request_id, token_ids, params, final_only=True)
        done = {delta.request_id: delta for delta in self._run()}
        outputs = []
        for request_id, (text, token_ids) in zip(ids, tokenized, strict=True):
            delta = done[request_id]
            vector = delta.embedding or []
            outputs.append(
                EmbeddingOutput(
                    request_id,
                    text,
                    token_ids,
                    l2_normalized(vector) if normalize else vector,
                    delta.num_cached_tokens,
                    delta.metrics,
                )
            )
        return outputs

    def _add(
        self, request_id: str, token_ids: list[int], params: SamplingParams, final_only: bool
    ) -> None:
        """Queues a tokenised request, its text made here (``final_only``: one delta)."""
        engine_final_only = self._processor.add_request(request_id, token_ids, params, final_only)
        try:
            self.engine.add_request(request_id, token_ids, params, final_only=engine_final_only)
        except ValueError:
            self._processor.forget(request_id)
            raise

    def _run(self) -> Iterator[RequestDelta]:
        """Steps the engine until every request is done, yielding the deltas with their text;
        the first request that fails raises (the others of this call are not left running
        behind the error)."""
        engine, processor = self.engine, self._processor
        while engine.has_unfinished_requests():
            deltas = engine.step()
            failures = engine.take_failures()
            for delta in deltas:
                out = processor.process(delta)
                if out is not None and out.error is not None:
                    failures.append((out.request_id, out.error))
                elif out is not None:
                    yield out
            failed, stopped = processor.take_aborts()
            engine.abort_request(failed)
            for delta in engine.end_at_stop_strings(stopped):  # their text is complete
                out = processor.process(delta)
                if out is not None:
                    yield out
            if failures:
                engine.abort_request(list(engine.scheduler.requests))
                processor.clear()
                request_id, error = failures[0]
                raise RuntimeError(f"request {request_id} failed: {error}")

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Renders each conversation with the model's chat template, then generates."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts: list[Prompt] = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt)
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, params)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list")
    return list(prompts)


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    if not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError("params must be a SamplingParams or a list of one per prompt")
    return params
