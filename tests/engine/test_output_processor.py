"""Text is made outside the engine: the engine's deltas carry token ids, the output processor
(the API server's, ``LLM``'s) makes the text and ends an engine request at a stop string."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from ketch.engine import LLM, EngineConfig, SamplingParams
from ketch.engine.engine_client import EngineClient
from ketch.engine.engine_messages import AbortRequests, decode, encode
from ketch.engine.engine_process import EngineLinks, _apply
from ketch.engine.output_processor import OutputProcessor
from ketch.engine.outputs import RequestDelta, TokenDelta, TokenLogprob
from ketch.engine.stats import EngineSnapshot, RequestMetrics

CONFIG = dict(block_size=16, kv_cache_memory="16MiB", max_num_seqs=8)
TEXT = "Alice was beginning to get very tired of sitting by her sister on the bank"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", **CONFIG)


def test_the_engine_deltas_carry_no_text(llm: LLM) -> None:
    assert "new_text" not in {f.name for f in dataclasses.fields(TokenDelta)}
    engine = llm.engine
    engine.add_request("plain", "Alice was", SamplingParams(max_tokens=4, stop=["x"]))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert deltas and all(type(d) is TokenDelta for d in deltas)
    assert sum(len(d.new_token_ids) for d in deltas) == 4  # stop strings are not its job


def test_the_engine_process_imports_no_detokenizer() -> None:
    code = (
        "import sys, ketch.engine.engine_process, ketch.engine.llm_engine; "
        "print(sorted(m for m in sys.modules if m.endswith(('detokenizer', 'output_processor'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _tokens(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False)


def _metrics(num_tokens: int, reason: str) -> RequestMetrics:
    return RequestMetrics(1.0, 1.5, 2.0, 3.0, 4, num_tokens, 0, 0, reason)


def test_a_stop_string_in_a_step_cuts_text_tokens_and_logprobs(llm: LLM) -> None:
    """A speculative step brings several tokens: those after the stop string's are dropped
    with their logprobs, and the engine request is to be ended (it runs on)."""
    processor = OutputProcessor(llm.tokenizer)
    tokens = _tokens(llm, TEXT)
    at = next(i for i in range(len(tokens)) if "tired" in llm.tokenizer.decode(tokens[: i + 1]))
    params = SamplingParams(stop=["tired"], logprobs=0)
    assert processor.add_request("r", [1, 2], params, final_only=False) is False
    logprobs = [TokenLogprob(t, -0.5) for t in tokens]
    first = processor.process(TokenDelta("r", tokens[:2], logprobs=logprobs[:2]))
    assert first is not None and first.new_token_ids == tokens[:2] and not first.finished
    rest = TokenDelta("r", tokens[2:], logprobs=logprobs[2:])
    assert processor.process(rest) is None  # held: the engine's end brings the metrics
    assert processor.take_aborts() == ([], {"r": at + 1})
    assert processor.is_stopping("r")
    assert processor.process(TokenDelta("r", [5], logprobs=logprobs[:1])) is None  # late
    end = TokenDelta("r", finish_reason="stop", metrics=_metrics(at + 1, "stop"))
    final = processor.process(end)
    assert final is not None and final.finish_reason == "stop" and final.stop_reason == "tired"
    assert final.new_token_ids == tokens[2 : at + 1]
    assert final.logprobs == logprobs[2 : at + 1]
    text = first.new_text + final.new_text
    assert text == llm.tokenizer.decode(tokens[: at + 1]).split("tired")[0]
    assert final.metrics is end.metrics and not processor.is_stopping("r")


def test_an_engine_that_finished_first_has_its_metrics_corrected(llm: LLM) -> None:
    """The engine ended the request on its own before the abort reached it: its end says
    "length" with every token; the stop string's end counts what was kept."""
    processor = OutputProcessor(llm.tokenizer)
    tokens = _tokens(llm, TEXT)
    processor.add_request("r", [1], SamplingParams(stop=["sister"]), final_only=True)
    assert processor.process(TokenDelta("r", tokens)) is None
    _, stopped = processor.take_aborts()
    end = TokenDelta("r", [9, 9], "length", metrics=_metrics(len(tokens) + 2, "length"))
    final = processor.process(end)
    assert final is not None and final.new_token_ids == tokens[: stopped["r"]]
    assert final.new_text == llm.tokenizer.decode(tokens).split("sister")[0]  # final_only: whole
    assert (final.metrics.finish_reason, final.metrics.num_generation_tokens) == (
        "stop",
        stopped["r"],
    )


def test_a_final_only_request_without_stop_strings_is_decoded_once_at_its_end(llm) -> None:
    processor = OutputProcessor(llm.tokenizer)
    tokens = _tokens(llm, TEXT)
    assert processor.add_request("r", [1], SamplingParams(), final_only=True) is True
    final = processor.process(TokenDelta("r", tokens, "length"))
    assert final is not None and final.new_text == llm.tokenizer.decode(tokens)


def test_a_stop_string_ends_the_engine_request_and_frees_its_blocks(llm: LLM) -> None:
    """What the engine process does with ``AbortRequests.stopped``: the request ends, its
    blocks go back, and its end counts the tokens the API server kept."""
    engine = llm.engine
    pool = engine.kv_cache.pool
    free = pool.num_free_blocks
    engine.add_request("s", "Alice was", SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert pool.num_free_blocks < free and "s" in engine.scheduler.requests
    replies: list[TokenDelta] = []
    _apply(engine, EngineLinks.create(engine, None), AbortRequests([], {"s": 3}), replies)
    [end] = replies
    assert end.request_id == "s" and end.finish_reason == "stop"
    assert end.metrics.finish_reason == "stop" and end.metrics.num_generation_tokens == 3
    assert "s" not in engine.scheduler.requests and not engine.has_unfinished_requests()
    assert pool.num_free_blocks == free
    engine.scheduler.check_integrity()
    replies.clear()  # a request that is gone already: nothing to answer
    _apply(engine, EngineLinks.create(engine, None), AbortRequests([], {"s": 3}), replies)
    assert replies == []


def test_llm_ends_a_request_at_its_stop_string(llm: LLM) -> None:
    """Offline: the engine request ends at the step whose token completed the stop string."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    whole = llm.generate("Alice was", params)[0].outputs[0]
    stop = whole.text[len(whole.text) // 2 :][:3]
    assert stop.strip()
    steps = llm.engine.scheduler.stats.num_steps
    out = llm.generate("Alice was", dataclasses.replace(params, stop=[stop]))[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == whole.text.split(stop)[0]
    assert out.token_ids == whole.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(whole.token_ids)
    assert llm.engine.scheduler.stats.num_steps - steps == len(out.token_ids)  # then it ended
    assert not llm.engine.has_unfinished_requests()
    llm.engine.scheduler.check_integrity()


def test_a_served_stop_string_ends_the_engine_request(llm: LLM, tmp_path: Path) -> None:
    """Through the engine process: the text stops as offline, the engine request is ended (its
    blocks are free when the final delta comes) and its metrics count the kept tokens."""
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    prompt = _tokens(llm, "Alice was")
    whole = llm.generate(prompt, dataclasses.replace(params, max_tokens=40))[0].outputs[0]
    stop = whole.text[len(whole.text) // 2 :][:3]
    want = llm.generate(prompt, dataclasses.replace(params, stop=[stop]))[0].outputs[0]

    async def main() -> tuple[list[RequestDelta], list[RequestMetrics], EngineSnapshot]:
        client = EngineClient(EngineConfig(model="tiny", **CONFIG), port=6, run_dir=tmp_path)
        await client.start()
        finished: list[RequestMetrics] = []
        client.on_finished = finished.append
        try:
            stopped = dataclasses.replace(params, stop=[stop])
            deltas = [d async for d in client.generate("r", prompt, stopped)]
            return deltas, finished, client.last_snapshot
        finally:
            await client.shutdown()

    deltas, finished, snapshot = asyncio.run(main())
    last = deltas[-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    assert "".join(d.new_text for d in deltas) == want.text
    assert [t for d in deltas for t in d.new_token_ids] == want.token_ids
    assert snapshot.free_kv_blocks == snapshot.total_kv_blocks
    assert snapshot.num_requests_running == 0
    [metrics] = finished
    assert last.metrics is metrics and metrics.finish_reason == "stop"
    assert metrics.num_generation_tokens == len(want.token_ids)


@pytest.mark.parametrize("count", [-(1 << 63), -1, 0, 1 << 40, (1 << 63) - 1])
def test_extreme_kept_counts_and_unknown_ids_in_stopped(llm: LLM, count: int) -> None:
    """``stopped`` from the API server with any 64-bit count, and ids the engine never had or
    finished already: live requests end with 0..their generated tokens counted, unknown ids are
    ignored, the blocks all go back and the accounting holds."""
    engine = llm.engine
    free = engine.kv_cache.pool.num_free_blocks
    engine.add_request("x", "Alice was", SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    generated = len(engine.scheduler.requests["x"].output_token_ids)
    stopped = {"x": count, "never-added": count, "": count}
    replies: list[TokenDelta] = []
    _apply(engine, EngineLinks.create(engine, None), AbortRequests([], stopped), replies)
    [end] = replies
    assert end.request_id == "x" and end.metrics.num_generation_tokens == max(
        0, min(count, generated)
    )
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.pool.num_free_blocks == free
    engine.scheduler.check_integrity()


@pytest.mark.parametrize(
    "stopped",
    [
        '{"x": 18446744073709551616}',
        '{"x": "3"}',
        '{"x": 1.5}',
        '{"x": true}',
        '{"x": null}',
        "[1]",
    ],
)
def test_a_bad_stopped_field_is_refused_on_the_wire(stopped: str) -> None:
    """Out of the 64-bit range, wrong types: refused by the decoder naming the field, never
    handed to the engine."""
    frame = f'{{"type": "AbortRequests", "body": {{"request_ids": [], "stopped": {stopped}}}}}'
    assert decode(encode(AbortRequests([], {"x": 3}))) == AbortRequests([], {"x": 3})
    with pytest.raises(ValueError, match="stopped"):
        decode(frame.encode())


def test_a_huge_stopped_map_ends_only_live_requests(llm: LLM) -> None:
    engine = llm.engine
    stopped = {f"r{i}": i for i in range(50_000)}
    replies: list[TokenDelta] = []
    _apply(engine, EngineLinks.create(engine, None), AbortRequests([], stopped), replies)
    assert replies == [] and not engine.has_unfinished_requests()
    engine.scheduler.check_integrity()
