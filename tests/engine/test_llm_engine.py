"""The engine's streaming path (per-step deltas) agrees with the offline, final-only path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ketch.engine import LLM, SamplingParams

PROMPTS = ["Once upon a time", "The quick brown fox", "To be, or not"]


@pytest.fixture(scope="module")
def llm(checkpoint: Callable[..., Path]) -> LLM:
    return LLM(str(checkpoint("llama")), block_size=16, num_kv_blocks=64, max_model_len=256)


def stream(llm: LLM, prompt: str, params: SamplingParams) -> tuple[str, list[int], str | None]:
    """A delta per step, its text made as the API server makes it (``LLM``'s processor)."""
    llm._add("streamed", llm.engine.tokenize_prompt(prompt)[1], params, final_only=False)
    text, tokens, reason = "", [], None
    for delta in llm._run():
        text += delta.new_text
        tokens += delta.new_token_ids
        reason = delta.finish_reason
    return text, tokens, reason


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("stop", [[], ["e"], ["th", "an"]])
def test_streamed_deltas_add_up_to_the_offline_output(llm: LLM, prompt: str, stop: list[str]):
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=40, stop=stop)
    offline = llm.generate(prompt, params)[0].outputs[0]
    text, tokens, reason = stream(llm, prompt, params)
    assert tokens == offline.token_ids
    assert text == offline.text
    assert reason == offline.finish_reason
    assert not any(s in text for s in stop)


def test_null_runner_returns_its_token_through_the_whole_engine() -> None:
    llm = LLM("tiny", runner="null", block_size=16, kv_cache_memory="16MiB")
    outputs = llm.generate(["Alice", "The Mouse said"], SamplingParams(max_tokens=7))
    for output in outputs:
        tokens = output.outputs[0].token_ids
        assert len(tokens) == 7 and len(set(tokens)) == 1
        assert tokens[0] not in llm.engine.eos_token_ids
