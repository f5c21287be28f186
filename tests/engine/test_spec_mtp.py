"""Speculative ``method: mtp``: ERNIE 4.5 MoE's multi-token-prediction layer drafts, checked
against transformers' ``MtpModel`` draft for draft, and never changes what the engine emits.

transformers' ``save_pretrained`` writes no MTP weights (its ``Ernie4_5_MoeForCausalLM`` has none),
so the test checkpoints get random ones under the Hub's names (``model.mtp_*``), which
transformers' ``MtpModel.from_pretrained`` reads back from the same file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from test_engine_exactness import make_prompts
from test_ernie4_5_moe import make_ernie_moe_checkpoint

from hf_models import hf_model, shape_cache
from ketch.engine import LLM, SamplingParams
from ketch.engine.config import EngineConfig
from ketch.engine.models.config import ModelConfig

SPEC = {"method": "mtp", "num_speculative_tokens": 2}
MAX_TOKENS = 16
# dense: the MTP block has a dense MLP (the Hub's moe_layer_start_index 1, as ERNIE-4.5-21B-A3B);
# moe: routed and shared experts (start index 0: transformers' layer-0 rule makes it MoE).
SHAPES = {
    "dense": {"num_hidden_layers": 2, "moe_layer_start_index": 1},
    "moe": {"num_hidden_layers": 2, "moe_layer_start_index": 0, "tie_word_embeddings": False},
}


def _add_mtp_weights(path: Path, seed: int) -> None:
    """The MTP layer's weights under the Hub's names: a block shaped as the model's layer 0
    (dense or expert alike, as the rule gives the MTP block), its two norms and projection."""
    import torch
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    generator = torch.Generator().manual_seed(seed)

    def like(t: torch.Tensor) -> torch.Tensor:
        if t.dim() > 1:
            return torch.randn(t.shape, generator=generator) * 0.15
        return t.clone() + torch.randn(t.shape, generator=generator) * 0.1

    hidden = tensors["model.embed_tokens.weight"].shape[1]
    extra = {
        name.replace("model.layers.0.", "model.mtp_block.0."): like(t)
        for name, t in tensors.items()
        if name.startswith("model.layers.0.")
    }
    ones = torch.ones(hidden)
    extra["model.mtp_emb_norm.0.weight"] = like(ones)
    extra["model.mtp_hidden_norm.0.weight"] = like(ones)
    extra["model.mtp_linear_proj.0.weight"] = like(torch.zeros(hidden, 2 * hidden))
    save_file({**tensors, **extra}, file, metadata={"format": "pt"})


def _make(out: Path, shape: str) -> Path:
    path = make_ernie_moe_checkpoint(out, num_mtp_layers=1, **SHAPES[shape])
    _add_mtp_weights(path, seed=1)
    return path


@pytest.fixture(scope="module")
def ernie_mtp(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    return shape_cache(tmp_path_factory, "ernie_mtp", _make)


def _llm(path: Path, spec: dict | None = SPEC, **overrides) -> LLM:
    settings = dict(
        block_size=16,
        max_num_batched_tokens=48,
        max_num_seqs=16,
        num_kv_blocks=26,
        max_model_len=256,
        enable_prefix_caching=True,
    )
    settings.update(overrides)
    return LLM(str(path), speculative_config=spec, **settings)


def _recorded(llm: LLM, oracle: list[list[int]] | None = None) -> list[tuple[list[int], list[int]]]:
    """Every (token_ids, drafts) the proposer returns from here on. With ``oracle`` (the full
    greedy sequences), the engine is handed those sequences' next tokens instead, so every draft
    is kept and the MTP layer's rows after verified drafts get checked too."""
    proposer = llm.engine.runner.spec.proposer
    seen: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose

    def record(requests):
        drafts = propose(requests)
        for r in requests:
            if r.request_id in drafts:
                seen.append((list(r.token_ids), list(drafts[r.request_id])))
        if oracle is None:
            return drafts
        out = {}
        for r in requests:
            n = len(r.token_ids)
            full = next(f for f in oracle if f[:n] == r.token_ids)
            out[r.request_id] = full[n : n + r.max_tokens]
        return {k: v for k, v in out.items() if v}

    proposer.propose = record
    return seen


def _hf_drafts(main, mtp, tokens: list[int], k: int) -> list[int]:
    """transformers' drafts for ``tokens`` (the last one being computed this step): the target's
    last hidden states of the positions before, the MTP layer over all of them with the tokens
    shifted by one (one pass: its rows are causal), then the layer chained on its own output."""
    import torch
    from transformers.cache_utils import MtpCache

    n = len(tokens)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = main(ids[:, : n - 1], output_hidden_states=True)
        hidden = out.hidden_states[-1]
        cache = MtpCache(config=main.config.get_mtp_config())
        positions = torch.arange(1, n)[None]
        # MtpModel.forward: the draft of transformers' own loop (one layer: one draft)
        first, _, _ = mtp(
            input_ids=ids[:, 1:],
            last_hidden_states=hidden,
            attention_mask=None,
            position_ids=positions,
            mtp_cache=MtpCache(config=main.config.get_mtp_config()),
        )
        y = mtp.forward_layer(0, hidden, positions, cache, input_ids=ids[:, 1:])
        drafts = [int(mtp._project_to_logits(y[:, -1:]).argmax(-1))]
        assert drafts[0] == int(first[0, 0])
        for j in range(1, k):
            y = mtp.forward_layer(
                0,
                y[:, -1:],
                torch.tensor([[n - 1 + j]]),
                cache,
                input_ids=torch.tensor([[drafts[-1]]]),
            )
            drafts.append(int(mtp._project_to_logits(y[:, -1:]).argmax(-1)))
    return drafts


@pytest.mark.parametrize("kept", [False, True], ids=["own-drafts", "drafts-kept"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("backend", ["native", "eager"])
def test_drafts_are_transformers_mtp_drafts(ernie_mtp, shape: str, backend: str, kept) -> None:
    """Every proposal of a run (after prefills, after verified steps) equals transformers'
    MtpModel on the same tokens; the greedy output is transformers' too. ``kept``: the engine
    verifies the true continuation instead of the layer's drafts (random weights accept almost
    none), so the layer's rows after kept drafts are checked as well."""
    from transformers.modeling_layers import MtpModel

    path = ernie_mtp(shape)
    config = ModelConfig.from_dir(path)
    assert config.num_mtp_layers == 1 and config.mtp_moe == (shape == "moe")
    prompts = make_prompts(config.vocab_size, count=4, seed=3)
    main = hf_model(path)
    reference = _hf_greedy(main, prompts, 10)
    llm = _llm(path, backend=backend, enable_prefix_caching=False)
    oracle = [p + r for p, r in zip(prompts, reference, strict=True)] if kept else None
    seen = _recorded(llm, oracle)
    stats = llm.engine.scheduler.stats
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.engine.close()
    assert outputs == reference
    if kept:
        assert stats.num_accepted_tokens > 0
    mtp = MtpModel.from_pretrained(main).float().eval()
    assert len(seen) >= len(prompts), "every request should have drafted"
    for tokens, drafts in seen:
        assert drafts == _hf_drafts(main, mtp, tokens, len(drafts)), tokens


def _hf_greedy(main, prompts: list[list[int]], n: int) -> list[list[int]]:
    from hf_models import greedy_of

    return greedy_of(main, prompts, n)


def _run(llm: LLM, prompts, params) -> list[list[int]]:
    try:
        outputs = llm.generate(prompts, params)
        llm.engine.scheduler.check_integrity()
        pool = llm.engine.kv_cache.pool
        assert pool.num_free_blocks == pool.num_usable_blocks
        proposer = getattr(llm.engine.runner, "proposer", None)
        if proposer is not None:  # what it keeps is for requests the runner still holds
            assert set(proposer._chains) <= set(llm.engine.runner.requests)
        return [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_and_seeded_outputs_equal_no_speculation(ernie_mtp, shape: str) -> None:
    """Chunked prefills, prefix hits and preemptions; greedy and seeded sampling alike."""
    path = ernie_mtp(shape)
    prompts = make_prompts(ModelConfig.from_dir(path).vocab_size, count=24)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seeded = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i in range(len(prompts))
    ]
    for params in (greedy, seeded):
        plain = _run(_llm(path, spec=None), prompts, params)
        llm = _llm(path)
        stats = llm.engine.scheduler.stats
        ours = _run(llm, prompts, params)
        assert ours == plain
        assert stats.num_preemptions > 0, "the pool should have been small enough to preempt"
        assert stats.prefix_hit_tokens > 0, "shared prefixes should have hit the prefix cache"
        assert stats.num_draft_tokens > 0


def test_a_checkpoint_without_mtp_layers_is_refused(checkpoint) -> None:
    path = checkpoint("llama")
    expected = (
        "speculative_config.method 'mtp' needs a checkpoint with multi-token-prediction layers "
        f"(config num_nextn_predict_layers > 0); {path} has none"
    )
    with pytest.raises(ValueError) as raised:
        LLM(str(path), speculative_config=SPEC, num_kv_blocks=8)
    assert expected in str(raised.value)


def test_the_refusal_is_a_start_up_check(checkpoint) -> None:
    from ketch.engine.capabilities import refusals

    path = checkpoint("llama")
    config = EngineConfig.from_kwargs(model=str(path), speculative_config=SPEC)
    found = refusals(config, model=ModelConfig.from_dir(path))
    assert [r.setting for r in found] == ["speculative_config"]
    ngram = EngineConfig.from_kwargs(
        model=str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 2}
    )
    assert refusals(ngram, model=ModelConfig.from_dir(path)) == []


def test_mtp_weights_are_read_only_for_method_mtp(ernie_mtp, caplog) -> None:
    """Without speculation the MTP weights load nowhere and warn of nothing."""
    import logging

    path = ernie_mtp("dense")
    with caplog.at_level(logging.WARNING):
        llm = _llm(path, spec=None)
    try:
        assert llm.engine.runner.spec is None
    finally:
        llm.engine.close()
    assert "unused weights" not in caplog.text


def test_acceptance_is_reported(ernie_mtp) -> None:
    """Random weights accept few drafts; the engine counts them (the docs quote the rate)."""
    path = ernie_mtp("dense")
    prompts = make_prompts(ModelConfig.from_dir(path).vocab_size, count=8, seed=5)
    llm = _llm(path, enable_prefix_caching=False, num_kv_blocks=64)
    stats = llm.engine.scheduler.stats
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    _run(llm, prompts, params)
    assert stats.num_draft_tokens > 0
    rate = stats.num_accepted_tokens / stats.num_draft_tokens
    print(f"mtp acceptance on random weights: {rate:.3f} of {stats.num_draft_tokens} drafts")
    assert 0.0 <= rate <= 1.0
    assert np.isfinite(rate)


def test_two_ranks_equal_no_speculation(ernie_mtp) -> None:
    """Tensor parallelism: every rank computes the hidden rows (their last layers must agree on
    the rows), rank 0 drafts, the others take its drafts."""
    path = ernie_mtp("moe")
    prompts = make_prompts(ModelConfig.from_dir(path).vocab_size, count=6)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    settings = dict(tensor_parallel_size=2, num_kv_blocks=64, enable_prefix_caching=False)
    plain = _run(_llm(path, spec=None, **settings), prompts, params)
    llm = _llm(path, **settings)
    stats = llm.engine.scheduler.stats
    assert _run(llm, prompts, params) == plain
    assert stats.num_draft_tokens > 0


def test_served_with_the_openai_client(ernie_mtp) -> None:
    """``ketch serve --speculative-config`` with method mtp: completions, streamed and not, are
    the offline engine's without speculation; the startup log names the method."""
    import json
    import sys

    import openai

    sys.path.insert(0, str(Path(__file__).parent / "serving"))
    from serve_harness import running_server

    path = ernie_mtp("dense")
    prompts = make_prompts(ModelConfig.from_dir(path).vocab_size, count=3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = LLM(str(path), block_size=16, kv_cache_memory="64MiB")
    expected = [o.outputs[0].text for o in plain.generate(prompts, params)]
    with running_server("--model", str(path), "--speculative-config", json.dumps(SPEC)) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        for prompt, want in zip(prompts, expected, strict=True):
            args = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                        temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
            assert client.completions.create(**args).choices[0].text == want
            stream = client.completions.create(**args, stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices) == want
        assert "speculative decoding: mtp, k=2" in srv.log()


def test_json_schema_grammar(ernie_mtp) -> None:
    """A json_schema grammar forced on: greedy output equal to that without speculation (the
    MTP drafts are cut where the grammar refuses them before they are computed)."""
    from ketch.engine.structured.grammars import json_schema

    path = ernie_mtp("dense")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    prompts = make_prompts(ModelConfig.from_dir(path).vocab_size, count=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, grammar=json_schema(schema))
    plain = _run(_llm(path, spec=None), prompts, params)
    llm = _llm(path)
    assert _run(llm, prompts, params) == plain
    llm.engine.scheduler.check_integrity()
