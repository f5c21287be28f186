"""Embeddings (``LLM.embed``, ``SamplingParams.pooling``): the model's final-normed hidden states
pooled over the prompt equal Hugging Face's ``model.model(...).last_hidden_state`` pooled the
same way (relative error <= 1e-4), for the last token and for the mean.

Run under every mechanism that could lose or repeat a position: prompts chunked by a small
token budget (one prompt spans several chunks), a KV pool small enough to preempt and recompute
(a recomputed prompt is not pooled twice), prefix-cache hits (last pooling may take them, mean
pooling takes none), and embedding requests batched with generation requests (whose outputs do
not change). Then the guards: refused parameter mixes, the runner's step checks, a pooled
vector of the wrong size, and the wire's bounds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_models import hf_model
from ketch.engine import LLM, SamplingParams
from ketch.engine import engine_messages as messages
from ketch.engine.core.scheduler_output import ModelRunnerOutput, NewRequestData
from ketch.engine.models.config import ModelConfig
from ketch.engine.outputs import MAX_EMBEDDING_SIZE, TokenDelta, l2_normalized
from ketch.engine.wire import MessageError
from ketch.engine.worker.messages import decode_result, encode_result
from ketch.engine.worker.pooling import HiddenRows, Pooler
from ketch.engine.worker.step_checks import StepError, check_new

TOLERANCE = 1e-4
POOLINGS = ("last", "mean")


def reference(path: Path, prompts: list[list[int]], pooling: str) -> list[np.ndarray]:
    """HF's final hidden states (after the last RMSNorm), pooled, in float64."""
    model = hf_model(path)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = model.model(torch.tensor([prompt])).last_hidden_state[0].double()
            out.append((hidden[-1] if pooling == "last" else hidden.mean(0)).numpy())
    return out


def assert_close(got: list[float], want: np.ndarray, what: object) -> None:
    actual = np.asarray(got, dtype=np.float64)
    assert actual.shape == want.shape, what
    rel = np.abs(actual - want).max() / np.abs(want).max()
    assert rel <= TOLERANCE, f"{what}: relative error {rel:.2e}"


def prompts_for(vocab: int, seed: int = 0, count: int = 8) -> list[list[int]]:
    """Lengths 1 to ~130: one token, sub-block, several 32-token chunks."""
    rng = np.random.default_rng(seed)
    lengths = [1, 16, 33, *rng.integers(2, 130, count - 3).tolist()]
    return [rng.integers(1, vocab, int(n)).tolist() for n in lengths]


def constrained(path: Path, **overrides) -> LLM:
    """A small token budget (chunked prefill) and a small KV pool (preemption)."""
    settings = dict(
        block_size=16, max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=24,
        max_model_len=256,
    )  # fmt: skip
    return LLM(str(path), **{**settings, **overrides})


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def path(request, checkpoint) -> Path:
    return checkpoint(request.param)


@pytest.mark.parametrize("pooling", POOLINGS)
def test_embeddings_equal_transformers_under_chunking(path, pooling: str) -> None:
    prompts = prompts_for(ModelConfig.from_dir(path).vocab_size)
    llm = constrained(path, num_kv_blocks=None, kv_cache_memory="16MiB")
    outputs = llm.embed(prompts, pooling=pooling, normalize=False)
    llm.engine.scheduler.check_integrity()
    for i, (output, want) in enumerate(
        zip(outputs, reference(path, prompts, pooling), strict=True)
    ):
        assert output.prompt_token_ids == prompts[i]
        assert output.outputs.embedding is output.embedding  # vLLM's spelling
        assert_close(output.embedding, want, (pooling, i, len(prompts[i])))
    # normalize (the default): the same vectors, L2-normalised, to fp32 rounding (the second
    # call batches differently: another row count can take another matmul in the last layer)
    unit = llm.embed(prompts[:3], pooling=pooling)
    for output, raw in zip(unit, outputs, strict=False):
        assert np.linalg.norm(output.embedding) == pytest.approx(1.0, abs=1e-6)
        want = l2_normalized(raw.embedding)
        np.testing.assert_allclose(output.embedding, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pooling", POOLINGS)
def test_preempted_embeddings_are_pooled_once(path, pooling: str) -> None:
    vocab = ModelConfig.from_dir(path).vocab_size
    prompts = prompts_for(vocab, seed=1, count=10)
    llm = constrained(path)
    # Two long generations alongside grow past the pool as they decode: the newest running
    # requests (embeddings part-way through their prompts) are preempted and recomputed.
    engine = llm.engine
    rng = np.random.default_rng(6)
    long_output = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"g{i}", rng.integers(1, vocab, 100).tolist(), long_output)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"e{i}", prompt, SamplingParams(pooling=pooling))
    deltas = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.error is None
            deltas[delta.request_id] = delta
        assert not engine.take_failures()
    engine.scheduler.check_integrity()
    preempted = [d for d in deltas.values() if d.embedding and d.metrics.num_preemptions]
    assert preempted, "some embedding request should have been preempted and recomputed"
    for i, want in enumerate(reference(path, prompts, pooling)):
        delta = deltas[f"e{i}"]
        assert delta.finish_reason == "stop" and delta.new_token_ids == []
        assert delta.metrics.num_generation_tokens == 0 and delta.metrics.first_token_time is None
        assert_close(delta.embedding, want, (pooling, i, delta.metrics.num_preemptions))


def test_last_pooling_takes_prefix_hits_and_mean_pooling_none(checkpoint) -> None:
    path = checkpoint("llama")
    rng = np.random.default_rng(2)
    prompt = rng.integers(1, 320, 64).tolist()  # exactly 4 blocks: the last one is recomputed
    longer = prompt + rng.integers(1, 320, 20).tolist()
    llm = LLM(str(path), block_size=16, kv_cache_memory="16MiB")
    llm.embed([prompt], pooling="last")  # fills the prefix cache
    for pooling, cached in (("last", True), ("mean", False)):
        outputs = llm.embed([prompt, longer], pooling=pooling, normalize=False)
        wants = reference(path, [prompt, longer], pooling)
        for output, want in zip(outputs, wants, strict=True):
            assert (output.num_cached_tokens > 0) == cached, (pooling, output.num_cached_tokens)
            assert_close(output.embedding, want, pooling)
    assert llm.embed([prompt], pooling="last")[0].num_cached_tokens == 48  # not the last block
    llm.engine.scheduler.check_integrity()


def test_generation_batched_with_embeddings_is_unchanged(checkpoint) -> None:
    path = checkpoint("qwen2")
    prompts = prompts_for(ModelConfig.from_dir(path).vocab_size, seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in constrained(path).generate(prompts, greedy)]
    engine = constrained(path).engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, greedy, final_only=True)
        engine.add_request(f"e{i}", prompt, SamplingParams(pooling=("last", "mean")[i % 2]))
    deltas = {}
    while engine.has_unfinished_requests():
        deltas |= {d.request_id: d for d in engine.step()}
    assert [deltas[f"g{i}"].new_token_ids for i in range(len(prompts))] == alone
    for i, prompt in enumerate(prompts):
        (want,) = reference(path, [prompt], ("last", "mean")[i % 2])
        assert_close(deltas[f"e{i}"].embedding, want, i)


def test_a_prompt_may_fill_max_model_len(checkpoint) -> None:
    path = checkpoint("llama")
    prompt = np.random.default_rng(4).integers(1, 320, 64).tolist()
    llm = LLM(str(path), block_size=16, kv_cache_memory="16MiB", max_model_len=64)
    (output,) = llm.embed(prompt, pooling="mean", normalize=False)
    assert_close(output.embedding, reference(path, [prompt], "mean")[0], "full length")
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.embed([*prompt, 1])
    with pytest.raises(ValueError, match="room for output"):  # generation still needs room
        llm.generate(prompt)


def test_tensor_parallel_embeddings_equal_one_rank(checkpoint) -> None:
    path = checkpoint("llama")
    prompts = prompts_for(ModelConfig.from_dir(path).vocab_size, seed=5, count=5)
    one = LLM(str(path), block_size=16, max_num_batched_tokens=32, kv_cache_memory="16MiB")
    two = LLM(
        str(path), block_size=16, max_num_batched_tokens=32, kv_cache_memory="16MiB",
        tensor_parallel_size=2,
    )  # fmt: skip
    try:
        for pooling in POOLINGS:
            got = two.embed(prompts, pooling=pooling, normalize=False)
            want = one.embed(prompts, pooling=pooling, normalize=False)
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                assert_close(a.embedding, np.asarray(b.embedding, np.float64), (pooling, i))
    finally:
        two.engine.close()


# ---- the guards ----


@pytest.mark.parametrize(
    "fields, word",
    [
        ({"pooling": "max"}, "pooling must be one of"),
        ({"pooling": "last", "logprobs": 1}, "logprobs"),
        ({"pooling": "mean", "prompt_logprobs": 0}, "prompt_logprobs"),
        ({"pooling": "last", "grammar": "x"}, "grammar"),
        ({"pooling": "last", "stop": ["x"]}, "stop"),
        ({"pooling": "last", "logit_bias": {3: 1.0}}, "logit_bias"),
        ({"pooling": "last", "n": 2}, "n"),
    ],
)
def test_pooling_refuses_what_samples(fields: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word) as info:
        SamplingParams(**fields)
    assert str(info.value).startswith("pooling")  # the API server names the field from it


def test_embed_refuses_an_unknown_pooling_before_queueing_anything() -> None:
    llm = LLM("tiny", block_size=16, kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="pooling must be one of"):
        llm.embed(["hello"], pooling="max")
    with pytest.raises(ValueError, match="empty"):
        llm.embed(["hello", ""])
    assert not llm.engine.has_unfinished_requests()


def _new(params: SamplingParams, tokens: list[int], prompt: int, computed: int) -> NewRequestData:
    return NewRequestData("r", tokens, prompt, [1, 2], computed, params, 0)


def test_the_runner_refuses_pooling_it_cannot_honour() -> None:
    mean, last = SamplingParams(pooling="mean"), SamplingParams(pooling="last")
    check_new(_new(last, [1, 2, 3], 3, 2), 10, 4, 32)  # last pooling: a prefix hit is fine
    with pytest.raises(StepError, match="mean pooling needs the prompt computed here"):
        check_new(_new(mean, [1, 2, 3], 3, 2), 10, 4, 32)
    with pytest.raises(StepError, match="no output tokens"):
        check_new(_new(last, [1, 2, 3], 2, 0), 10, 4, 32)


def test_pooler_takes_each_position_once_across_a_recompute() -> None:
    rows = np.arange(10, dtype=np.float32).reshape(5, 2)  # positions 0..4, hidden 2
    pooler, step = Pooler("mean", 5), HiddenRows()
    step.add("r", pooler, 0, 3, 0)  # positions 0-2 at rows 0-2
    assert step.pool(rows[:3], {"r": pooler}) == {}
    again = HiddenRows()  # preempted: recomputed from position 0, in chunks of 4 and 1
    again.add("r", pooler, 0, 4, 0)
    assert again.rows == [3] and again.spans == [("r", 1, False)]
    assert again.pool(rows[3:4], {"r": pooler}) == {}
    last = HiddenRows()
    last.add("r", pooler, 4, 1, 7)
    assert last.rows == [7]
    assert last.pool(rows[4:5], {"r": pooler}) == {"r": rows.mean(axis=0).tolist()}
    first = HiddenRows()
    first.add("r", Pooler("last", 5), 0, 3, 0)  # not the prompt's end: nothing to pool
    assert first.rows == [] and first.spans == []


def test_a_pooled_vector_of_the_wrong_size_fails_its_request() -> None:
    llm = LLM("tiny", block_size=16, kv_cache_memory="16MiB", runner="null")
    hidden = llm.engine.model_config.hidden_size
    assert llm.embed("hello")[0].embedding == [1.0] + [0.0] * (hidden - 1)
    llm.engine.runner.embedding = [1.0, 2.0]
    with pytest.raises(RuntimeError, match=f"the model's hidden size is {hidden}"):
        llm.embed("hello")
    llm.engine.runner.embedding = [float("nan")] * hidden
    with pytest.raises(RuntimeError, match="not finite"):
        llm.embed("hello")
    assert not llm.engine.has_unfinished_requests()
    llm.engine.scheduler.check_integrity()


def test_embeddings_on_the_wire() -> None:
    output = ModelRunnerOutput([], [], pooled={"r": [0.5, -1.25]})
    assert decode_result(encode_result(output)).pooled == {"r": [0.5, -1.25]}
    delta = TokenDelta("r", finish_reason="stop", embedding=[0.1, 0.2])
    back = messages.decode(messages.encode(messages.StepOutputs([delta])))
    assert back.deltas[0].embedding == [0.1, 0.2]
    for bad, word in (
        ([float("nan")], "finite"),
        ([], "1 to"),
        ([0.0] * (MAX_EMBEDDING_SIZE + 1), "1 to"),
        (["x"], "expected a number"),
        ({"a": 1}, "expected a list"),
    ):
        delta = {"request_id": "r", "finish_reason": "stop", "embedding": bad}
        frame = json.dumps({"type": "StepOutputs", "body": {"deltas": [delta]}}).encode()
        with pytest.raises(MessageError, match=word):
            messages.decode(frame)
