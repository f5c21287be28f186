"""Speculative decoding with a draft model (``method: draft``, ``spec_decode.draft``).

Whatever the draft proposes, the output is the model's own: greedy and seeded outputs equal
decoding without speculation, through chunked prefill, prefix-cache hits, preemptions and
tensor parallelism, and every block is free afterwards. The tiny model drafting for itself
proves the draft's KV bookkeeping (catch-up, positions): it agrees with nearly every draft.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hf_models import make_checkpoint
from ketch.engine.config import EngineConfig
from ketch.engine.cpu_sizing import cpu_memory
from ketch.engine.llm import LLM
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.loader import TINY_MODEL_DIR
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.spec_decode.config import SpeculativeConfig
from ketch.engine.spec_decode.draft import DraftProposer
from ketch.engine.spec_decode.draft_checks import check_draft_model
from ketch.engine.spec_decode.factory import make_proposer
from ketch.engine.spec_decode.proposer import DraftRequest
from ketch.engine.worker.model_runner import configure_paddle
from ketch.engine.worker.runner_config import RunnerConfig

TINY = ModelConfig.from_dir(TINY_MODEL_DIR)
PROMPTS = [
    "Alice was beginning to get very tired of sitting by her sister",
    "The rabbit-hole went straight on like a tunnel for some way",
    "Alice was beginning to get very tired of sitting by her sister",  # a prefix-cache hit
    "Alice was beginning to wonder",
]
COMMON = dict(num_threads=2, block_size=16, max_num_batched_tokens=16, max_model_len=256)


def _copy_tokenizer(source: Path, out: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    return out


@pytest.fixture(scope="module")
def llama_draft(tmp_path_factory) -> Path:
    """A random Llama smaller than the tiny model (2 layers, hidden 64) with its tokenizer."""
    out = tmp_path_factory.mktemp("draft_llama")
    make_checkpoint(out, "llama", seed=3, vocab_size=TINY.vocab_size, num_hidden_layers=2)
    return _copy_tokenizer(TINY_MODEL_DIR, out)


@pytest.fixture(scope="module")
def truncated_tiny(tmp_path_factory) -> Path:
    """The tiny model's first 2 of its 4 layers (its embeddings, final norm and head): a draft
    that agrees with the model often but not always, so steps keep some drafts and reject
    the rest."""
    from safetensors.numpy import load_file, save_file

    out = tmp_path_factory.mktemp("draft_truncated")
    keep = ("model.layers.0.", "model.layers.1.")
    weights = load_file(TINY_MODEL_DIR / "model.safetensors")
    save_file(
        {
            k: v
            for k, v in weights.items()
            if not k.startswith("model.layers.") or k.startswith(keep)
        },
        out / "model.safetensors",
    )
    config = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    return _copy_tokenizer(TINY_MODEL_DIR, out)


@pytest.fixture(scope="module")
def qwen2_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(a random Qwen2 target, a random one-layer Llama draft with its tokenizer)."""
    target = make_checkpoint(tmp_path_factory.mktemp("target_qwen2"), "qwen2", seed=5)
    draft = tmp_path_factory.mktemp("draft_for_qwen2")
    make_checkpoint(draft, "llama", seed=7, hidden_size=32, num_hidden_layers=1)
    return target, _copy_tokenizer(target, draft)


def spec(model: str | Path, k: int = 3) -> dict:
    return {"method": "draft", "num_speculative_tokens": k, "model": str(model)}


def run(model: str | Path, prompts, params, speculative=None, **kwargs):
    """(each prompt's output token ids, the engine) after the run's checks: the scheduler's
    integrity and no block left allocated."""
    llm = LLM(str(model), speculative_config=speculative, **{**COMMON, **kwargs})
    try:
        outputs = llm.generate(prompts, params)
        engine = llm.engine
        engine.scheduler.check_integrity()
        pool = engine.kv_cache.pool
        assert pool.num_free_blocks == pool.num_blocks - 1  # block 0 is reserved
        return [o.outputs[0].token_ids for o in outputs], engine
    finally:
        llm.engine.close()


def acceptance(engine) -> float:
    stats = engine.scheduler.stats
    assert stats.num_draft_tokens > 0
    return stats.num_accepted_tokens / stats.num_draft_tokens


def test_the_model_drafting_for_itself_is_accepted():
    """The tiny model as its own draft proposes the model's own greedy tokens: all accepted
    (but for a near tie the two computations order differently), so the draft's cache holds
    the right keys at the right positions after each catch-up."""
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    want, _ = run("tiny", PROMPTS, params)
    got, engine = run("tiny", PROMPTS, params, spec("tiny", k=4))
    assert got == want
    rate = acceptance(engine)
    print(f"tiny drafting for itself: acceptance {rate:.3f}")
    assert rate >= 0.95
    stats = engine.scheduler.stats
    # each speculating step emitted well over one token
    assert stats.num_emitted_tokens >= 3 * stats.num_drafted_steps


@pytest.mark.parametrize("case", ["greedy", "seeded"])
@pytest.mark.parametrize("draft", ["random", "truncated"])
def test_smaller_draft_for_tiny(llama_draft, truncated_tiny, draft, case):
    """A random draft (which rarely agrees) and the tiny model's first half (which often
    does): greedy and seeded sampling equal decoding without it (chunked prefill of 16 tokens,
    the draft's catch-up in chunks too, and a prefix hit)."""
    path = llama_draft if draft == "random" else truncated_tiny
    params = (
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        if case == "greedy"
        else SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    )
    want, _ = run("tiny", PROMPTS, params)
    got, engine = run("tiny", PROMPTS, params, spec(path))
    assert got == want
    assert engine.scheduler.stats.prefix_hit_tokens > 0
    rate = acceptance(engine)
    print(f"{draft} draft for tiny ({case}): acceptance {rate:.3f}")
    if draft == "truncated" and case == "greedy":
        assert 0 < rate < 1  # steps that keep some drafts and reject others


def test_qwen2_target_llama_draft(qwen2_pair):
    target, draft = qwen2_pair
    prompts = [[5, 9, 17, 33, 2, 8, 40] * 4, [7, 3, 11] * 9, [5, 9, 17, 33, 2, 8, 40] * 4]
    for params in (
        SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=32, temperature=1.0, seed=3, ignore_eos=True),
    ):
        want, _ = run(target, prompts, params)
        got, engine = run(target, prompts, params, spec(draft, k=2))
        assert got == want
        print(
            f"llama draft for qwen2 (t={params.temperature}): acceptance {acceptance(engine):.3f}"
        )


def test_preemption(llama_draft, truncated_tiny):
    """Too few blocks for the batch: requests are preempted and resumed on a new block table
    (the draft forgets them and catches up from 0); output still the model's own."""
    params = SamplingParams(max_tokens=70, temperature=0, ignore_eos=True)
    small = dict(num_kv_blocks=14, max_model_len=128)
    want, _ = run("tiny", PROMPTS, params, **small)
    for draft in ("tiny", llama_draft, truncated_tiny):
        got, engine = run("tiny", PROMPTS, params, spec(draft), **small)
        assert engine.scheduler.stats.num_preemptions > 0
        assert got == want
        print(f"preempted, draft {Path(str(draft)).name}: acceptance {acceptance(engine):.3f}")


def test_tensor_parallel(truncated_tiny):
    """Rank 0 drafts; rank 1 takes its drafts."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want, _ = run("tiny", PROMPTS[:2], params, tensor_parallel_size=2)
    for draft in ("tiny", truncated_tiny):
        got, engine = run("tiny", PROMPTS[:2], params, spec(draft), tensor_parallel_size=2)
        assert got == want
        print(f"TP 2, draft {Path(str(draft)).name}: acceptance {acceptance(engine):.3f}")


def test_catch_up_after_a_partial_acceptance(truncated_tiny):
    """After the model kept some drafts and replaced the next, the proposer recomputes from
    the request's old length (never trusting a rejected draft's position): its next drafts
    equal those of a request it has never seen with the same tokens."""
    configure_paddle(2)
    config = RunnerConfig(
        model_path=TINY_MODEL_DIR,
        model_config=TINY,
        max_model_len=256,
        num_blocks=16,
        block_size=16,
        num_threads=2,
        speculative=SpeculativeConfig("draft", 4, model=str(truncated_tiny)),
    )
    proposer = make_proposer(config, None)
    assert isinstance(proposer, DraftProposer)
    tokens = [(7 * i + 3) % TINY.vocab_size for i in range(37)]  # 3 chunks of 16: chunked
    first = proposer.propose([DraftRequest("a", tokens, [1, 2, 3, 4], 4)])["a"]
    assert len(first) == 4
    assert proposer.computed["a"] == len(tokens)
    # the model kept one draft and chose another token than the second; then two steps
    # decoded without speculation (a batch too large for it), over the drafts' positions
    other = [(t + 1) % TINY.vocab_size for t in first[1:]]
    tokens = [*tokens, first[0], *other]
    again = proposer.propose([DraftRequest("a", tokens, [1, 2, 3, 4], 3)])["a"]
    fresh = proposer.propose([DraftRequest("b", tokens, [5, 6, 7, 8], 3)])["b"]
    assert again == fresh
    # batched: requests asking for different numbers of drafts, one of them new
    proposer.forget("a")
    assert "a" not in proposer.computed
    both = proposer.propose(
        [DraftRequest("a", tokens, [1, 2, 3, 4], 1), DraftRequest("c", tokens, [9, 10, 11, 12], 3)]
    )
    assert both == {"a": fresh[:1], "c": fresh}


# ---- refusals, at start-up and before any worker ----


def test_refuses_a_missing_path(tmp_path):
    with pytest.raises(ValueError, match=r"speculative_config\.model .*not found"):
        LLM("tiny", speculative_config=spec(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"speculative_config\.model .*no config\.json"):
        LLM("tiny", speculative_config=spec(tmp_path))


def test_refuses_no_weights(tmp_path):
    shutil.copy(TINY_MODEL_DIR / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"speculative_config\.model .*no \*\.safetensors"):
        LLM("tiny", speculative_config=spec(tmp_path))


def test_refuses_another_vocabulary(qwen2_pair):
    _, draft = qwen2_pair  # vocab 320
    with pytest.raises(ValueError, match=r"speculative_config\.model .*vocab_size 320.* 1024"):
        LLM("tiny", speculative_config=spec(draft))


def test_refuses_another_tokenizer(tmp_path):
    # the same vocabulary size, another tokenizer (hf_models' own BPE)
    make_checkpoint(tmp_path, "llama", vocab_size=TINY.vocab_size, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"speculative_config\.model .*tokenizer"):
        LLM("tiny", speculative_config=spec(tmp_path))


def test_refuses_a_shorter_context(tmp_path):
    make_checkpoint(
        tmp_path, "llama", vocab_size=TINY.vocab_size, num_hidden_layers=1,
        max_position_embeddings=128,
    )  # fmt: skip
    _copy_tokenizer(TINY_MODEL_DIR, tmp_path)
    with pytest.raises(ValueError, match=r"speculative_config\.model .*max_model_len=512"):
        check_draft_model(str(tmp_path), TINY_MODEL_DIR, TINY, 512)
    _, config = check_draft_model(str(tmp_path), TINY_MODEL_DIR, TINY, 128)  # served shorter
    assert config.max_position_embeddings == 128


def test_refuses_a_gpu():
    with pytest.raises(ValueError, match=r"speculative_config\.model.*CPU only"):
        check_draft_model("tiny", TINY_MODEL_DIR, TINY, 512, gpu=True)


def test_memory_estimate_counts_the_draft():
    config = EngineConfig(
        model="tiny",
        kv_cache_memory="64MiB",
        speculative_config=SpeculativeConfig("draft", 3, model="tiny"),
    )
    alone = cpu_memory(config, TINY)
    both = cpu_memory(config, TINY, draft=TINY)
    assert both.draft_kv_cache == alone.kv_cache  # the same blocks at the same shape
    assert both.draft_weights == alone.weights
    assert both.total > alone.total + alone.kv_cache + alone.weights
    assert "draft KV cache" in str(both)
