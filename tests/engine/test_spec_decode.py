"""Speculative decoding (issue 31): the output with speculation is the output without it.

The n-gram proposer runs for real on the shipped tiny model (which has memorised its corpus, so
a prompt that quotes a passage has its continuation written in it: proposals get kept) and on a
random Qwen2 checkpoint. ``Oracle`` is a proposer for tests: it proposes a known continuation,
corrupted at chosen places, so every path of the verification runs (long runs kept, a rejection
at every offset, stop tokens, max_tokens, a grammar); the model alone decides what is emitted,
and each case compares with decoding without speculation. The sampling test checks the emitted
tokens' distribution against the model's own probabilities (from transformers), not only
against Ketch without speculation.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from hf_models import make_checkpoint
from ketch.engine.core.kv_cache_manager import KVCacheManager
from ketch.engine.core.request import Request
from ketch.engine.core.scheduler import Scheduler, SchedulerConfig
from ketch.engine.llm import LLM
from ketch.engine.models.paths import TINY_MODEL_DIR
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.spec_decode import factory
from ketch.engine.spec_decode.ngram import lookup
from ketch.engine.spec_decode.proposer import DraftRequest, Proposer
from ketch.engine.structured.grammars import json_schema

CORPUS = (TINY_MODEL_DIR / "corpus.txt").read_text()
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


def quoting_prompts() -> list[str]:
    """Passages followed by their own beginning: the memorised continuation is in the prompt."""
    return [
        CORPUS[800:1300] + CORPUS[800:900],
        CORPUS[4000:4400] + CORPUS[4000:4060],
        "Alice was beginning to get very tired",
    ]


def run(llm: LLM, prompts, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def free_and_cached(llm: LLM) -> tuple[int, set]:
    """The pool's free block count and the set of cached prefixes (by their tokens)."""
    pool = llm.engine.kv_cache.pool
    llm.engine.scheduler.check_integrity()
    return pool.num_free_blocks, set(pool._tokens_of.values())


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("spec_qwen2"), "qwen2", seed=3)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("spec_qwen3"), "qwen3", seed=4, head_dim=32)


SETTINGS = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 24},
    "preempting": {"num_kv_blocks": 20, "block_size": 16, "max_num_seqs": 4, "max_model_len": 256},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("model", ["tiny", "qwen2", "qwen3"])
def test_ngram_greedy_is_token_identical(model, setting, qwen2, qwen3):
    path = {"tiny": "tiny", "qwen2": str(qwen2), "qwen3": str(qwen3)}[model]
    engine_args = {"num_threads": 2, **SETTINGS[setting]}
    if model == "tiny":
        prompts: list = quoting_prompts()
    else:  # token ids that repeat: a random model's loops give the lookup something to find
        rng = np.random.default_rng(0)
        prompts = [rng.integers(1, 300, 40).tolist() * 2 for _ in range(3)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    base = LLM(path, **engine_args)
    expected = run(base, prompts, params)
    expected_again = run(base, prompts, params)  # prefix hits: the same prompts again
    spec = LLM(path, speculative_config=NGRAM, **engine_args)
    assert run(spec, prompts, params) == expected
    assert run(spec, prompts, params) == expected_again
    stats = spec.engine.scheduler.stats
    assert stats.num_draft_tokens > 0
    if model == "tiny":
        assert stats.num_accepted_tokens > 0  # the quoted passages are found
    if setting == "preempting":
        # Proposals take blocks a few steps early (free ones only), so under this pressure which
        # cached prefixes get evicted may differ; the accounting must still balance.
        assert stats.num_preemptions > 0 and base.engine.scheduler.stats.num_preemptions > 0
        assert free_and_cached(spec)[0] == free_and_cached(base)[0]
    else:
        assert free_and_cached(spec) == free_and_cached(base)


class Oracle(Proposer):
    """Proposes ``continuations[prompt]`` from where the request stands, every ``corrupt``-th
    proposal replaced by a token the model did not pick (``corrupt`` 0: never)."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], corrupt: int) -> None:
        self.continuations = continuations
        self.corrupt = corrupt
        self.calls = 0

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        drafts = {}
        for request in requests:
            for prompt, rest in self.continuations.items():
                if tuple(request.token_ids[: len(prompt)]) == prompt:
                    done = len(request.token_ids) - len(prompt)
                    tokens = list(rest[done : done + request.max_tokens])
                    self.calls += 1
                    if self.corrupt and tokens and self.calls % self.corrupt == 0:
                        at = self.calls % len(tokens)
                        tokens[at] = (tokens[at] + 1) % 300
                    drafts[request.request_id] = tokens
        return drafts


def with_oracle(monkeypatch, continuations, corrupt: int) -> Oracle:
    oracle = Oracle(continuations, corrupt)
    monkeypatch.setattr(factory, "make_proposer", lambda config, model: oracle)
    return oracle


@pytest.mark.parametrize("corrupt", [0, 1, 2, 3])
def test_every_verification_path(monkeypatch, qwen2, corrupt):
    """Oracle proposals (all right, or one wrong at varying offsets each step) through greedy,
    seeded sampling, logprobs, stop tokens and max_tokens: the outputs and logprobs are those
    without speculation, and so is the KV cache's state afterwards."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 300, 30).tolist() for _ in range(4)]
    params = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=33, temperature=0.8, seed=11, top_k=20),
        SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[]),
        SamplingParams(max_tokens=7, temperature=1.0, seed=5, min_tokens=3),
    ]
    base = LLM(str(qwen2), num_threads=2, block_size=16)
    outs = base.generate(prompts, params)
    expected = [o.outputs[0].token_ids for o in outs]
    # a stop token the third request meets midway, chosen from its own output
    params[2] = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[expected[2][9]])
    base = LLM(str(qwen2), num_threads=2, block_size=16)  # a fresh cache, to compare with
    outs = base.generate(prompts, params)
    expected = [o.outputs[0].token_ids for o in outs]
    expected_lp = [o.outputs[0].logprobs for o in outs]
    oracle = with_oracle(
        monkeypatch,
        {tuple(p): e + [7] * 8 for p, e in zip(prompts, expected, strict=True)},
        corrupt,
    )
    spec = LLM(str(qwen2), num_threads=2, block_size=16, speculative_config=NGRAM)
    outs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert len(expected[2]) <= 10  # it did stop at its stop token
    got_lp = outs[0].outputs[0].logprobs
    assert [lp.token_id for lp in got_lp] == [lp.token_id for lp in expected_lp[0]]
    for got, want in zip(got_lp, expected_lp[0], strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
    stats = spec.engine.scheduler.stats
    assert oracle.calls > 0 and stats.num_accepted_tokens > 0
    if corrupt == 0:  # everything proposed is right: k + 1 tokens a step
        assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.9
    assert free_and_cached(spec) == free_and_cached(base)


def test_grammar_checks_proposals(monkeypatch, qwen2):
    """A json_schema grammar forced on: proposals the grammar rejects are never computed, and the
    output (valid JSON, the model's choice) is the one without speculation."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 12}},
        "required": ["a", "b"],
    }
    prompts = ["The quick brown fox", "To be, or not to be"]
    params = SamplingParams(max_tokens=60, temperature=0, grammar=json_schema(schema))
    base = LLM(str(qwen2), num_threads=2)
    expected = run(base, prompts, params)
    ids = [base.engine.tokenizer.encode(p) for p in prompts]
    # proposals: the right output, every second one with a token changed (which the grammar
    # refuses before it is computed, or the model rejects)
    oracle = with_oracle(
        monkeypatch, {tuple(i): e for i, e in zip(ids, expected, strict=True)}, corrupt=2
    )
    spec = LLM(str(qwen2), num_threads=2, speculative_config=NGRAM)
    assert run(spec, prompts, params) == expected
    assert oracle.calls > 0 and spec.engine.scheduler.stats.num_accepted_tokens > 0


def test_tensor_parallel_ngram():
    prompts = quoting_prompts()
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    expected = run(LLM("tiny", num_threads=1), prompts, params)
    spec = LLM("tiny", num_threads=1, tensor_parallel_size=2, speculative_config=NGRAM)
    try:
        assert run(spec, prompts, params) == expected
        assert spec.engine.scheduler.stats.num_accepted_tokens > 0
    finally:
        spec.engine.close()


def _chi_square_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof): the regularised upper incomplete gamma
    Q(dof / 2, statistic / 2) in closed form (integer or half-integer order)."""
    x = statistic / 2
    if dof % 2 == 0:
        terms = sum(x**i / math.factorial(i) for i in range(dof // 2))
        return math.exp(-x) * terms
    terms = sum(x ** (i - 0.5) / math.gamma(i + 0.5) for i in range(1, (dof + 1) // 2))
    return math.erfc(math.sqrt(x)) + math.exp(-x) * terms


def test_chi_square_sf():
    # the 95th percentiles of chi-square with 1, 2 and 7 degrees of freedom
    for dof, q95 in ((1, 3.841459), (2, 5.991465), (7, 14.06714)):
        assert _chi_square_sf(q95, dof) == pytest.approx(0.05, abs=1e-6)


def test_sampling_distribution_is_the_models(monkeypatch, qwen2):
    """Sampled with speculation (top_k=8, temperature 1.3, one proposal a step), the token
    after a first token ``a`` and the token after an accepted proposal follow the model's own
    probabilities, computed by transformers in float64: chi-square goodness of fit over the 8
    tokens top_k leaves (7 degrees of freedom), each at false-failure rate 1e-4 (2e-4 for the
    test). And every seeded output equals the output without speculation (one draw per emitted
    token), so the two empirical distributions are the same."""
    import torch

    from hf_models import hf_model

    prompt = [5, 17, 42, 99, 7, 3, 250, 61]
    model = hf_model(qwen2)
    temperature, top_k = 1.3, 8

    def top(tokens: list[int]) -> tuple[list[int], np.ndarray]:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].double()
        best = torch.topk(logits, top_k)
        return best.indices.tolist(), torch.softmax(best.values / temperature, -1).numpy()

    a = top(prompt)[0][0]  # the likeliest first token (from the prefill: no proposal)
    ids2, p2 = top([*prompt, a])
    draft = ids2[0]  # proposed for the second token: the likeliest after a
    ids3, p3 = top([*prompt, a, draft])

    class Fixed(Proposer):
        def propose(self, requests):
            return {r.request_id: [draft] for r in requests}

    monkeypatch.setattr(factory, "make_proposer", lambda config, model: Fixed())
    n = 3000
    params = [
        SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, seed=s, ignore_eos=True)
        for s in range(n)
    ]
    config = {**NGRAM, "disable_by_batch_size": 0}
    spec = LLM(str(qwen2), num_threads=2, max_num_seqs=256, speculative_config=config)
    got = run(spec, [prompt] * n, params)
    assert spec.engine.scheduler.stats.num_accepted_tokens > 0
    seconds = [o[1] for o in got if o[0] == a]
    thirds = [o[2] for o in got if o[0] == a and o[1] == draft]
    assert len(thirds) > 200
    for tokens, ids, probs in ((seconds, ids2, p2), (thirds, ids3, p3)):
        counts = np.array([tokens.count(t) for t in ids], dtype=np.float64)
        assert counts.sum() == len(tokens)  # nothing outside the top 8
        expected = probs * len(tokens)
        statistic = float(((counts - expected) ** 2 / expected).sum())
        assert _chi_square_sf(statistic, top_k - 1) > 1e-4, (counts, expected)
    base = LLM(str(qwen2), num_threads=2, max_num_seqs=256)
    assert run(base, [prompt] * 300, params[:300]) == got[:300]
    assert run(spec, [prompt] * 300, params[:300]) == got[:300]  # reproducible


def test_lookup():
    t = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert lookup(t, 4, 2, 3) == [4, 5, 9]
    assert lookup(np.array([1, 2, 3, 1, 2]), 4, 1, 5) == [3, 1, 2]
    assert lookup(np.array([1, 2, 3, 4]), 3, 1, 2) == []
    assert lookup(np.array([5]), 4, 1, 3) == []
    # the latest occurrence wins; the longest n-gram first
    assert lookup(np.array([7, 1, 8, 7, 1, 9, 6, 7, 1]), 2, 1, 1) == [9]
    assert lookup(np.array([3, 1, 4, 2, 1, 5, 3, 1]), 2, 1, 1) == [4]


def _scheduler(k: int, max_batch: int, blocks: int = 64) -> Scheduler:
    kv = KVCacheManager(blocks, 16)
    return Scheduler(SchedulerConfig(8, 256, 512, k, max_batch), kv)


def _decoding(scheduler: Scheduler, n: int, prompt_len: int = 20) -> list[Request]:
    requests = [
        Request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(), 100) for i in range(n)
    ]
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()  # the prompts
    for request in requests:
        request.num_computed_tokens = request.num_tokens
        request.token_ids.append(1)
    assert not out.num_lookahead_tokens
    return requests


def test_scheduler_room_for_proposals():
    scheduler = _scheduler(k=4, max_batch=2)
    _decoding(scheduler, 2)
    out = scheduler.schedule()
    assert out.num_lookahead_tokens == {"r0": 4, "r1": 4}
    assert out.total_num_scheduled_tokens == 2  # the budget counts the room, the total not
    # more running requests than max_batch: no room this step, and the step is counted
    scheduler = _scheduler(k=4, max_batch=2)
    _decoding(scheduler, 3)
    assert scheduler.schedule().num_lookahead_tokens == {}
    assert scheduler.stats.num_steps_speculation_off == 1


def test_scheduler_never_preempts_for_proposals():
    """Blocks for the room are taken only if free: a full pool decodes without speculation."""
    scheduler = _scheduler(k=8, max_batch=0, blocks=5)  # 4 usable blocks of 16 tokens
    requests = _decoding(scheduler, 1, prompt_len=31)  # 32 tokens: 2 blocks, 2 free
    out = scheduler.schedule()
    assert out.num_lookahead_tokens == {"r0": 8} and len(requests[0].block_ids) == 3
    # 1 free block: kept for the running request's own growth, no room past position 31
    scheduler = _scheduler(k=8, max_batch=0, blocks=4)
    _decoding(scheduler, 1, prompt_len=31)
    out = scheduler.schedule()
    assert out.num_lookahead_tokens == {} and not out.preempted_request_ids


def test_scheduler_room_stops_at_max_tokens():
    scheduler = _scheduler(k=6, max_batch=0)
    request = Request("r", [1, 2, 3], SamplingParams(), 3)  # max_len 6
    scheduler.add_request(request)
    scheduler.schedule()
    request.num_computed_tokens = 3
    request.token_ids.append(4)  # 4 tokens: 2 more may come, so 1 proposal at most
    assert scheduler.schedule().num_lookahead_tokens == {"r": 1}


@pytest.mark.parametrize("backend", ["eager", "predictor"])
def test_other_backends(backend):
    prompts = quoting_prompts()[:2]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = run(LLM("tiny", backend=backend, num_threads=2), prompts, params)
    spec = LLM("tiny", backend=backend, num_threads=2, speculative_config=NGRAM)
    assert run(spec, prompts, params) == expected
    assert spec.engine.scheduler.stats.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_json_schema_with_real_proposals(method):
    """A json_schema grammar forced on, the proposals real (prompt lookup over a prompt full of
    such objects; or the tiny model drafting for itself): output equal to that without."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    prompts = ['{"name": "Alice", "age": 7} {"name": "Alice", "age": 7} {"name": "', "The Rabbit"]
    params = SamplingParams(max_tokens=48, temperature=0, grammar=json_schema(schema))
    expected = run(LLM("tiny", num_threads=2), prompts, params)
    config = NGRAM if method == "ngram" else {**NGRAM, "method": "draft", "model": "tiny"}
    if method == "draft":
        del config["prompt_lookup_min"]
    spec = LLM("tiny", num_threads=2, speculative_config=config)
    assert run(spec, prompts, params) == expected
    assert spec.engine.scheduler.stats.num_accepted_tokens > 0
    free_and_cached(spec)


def test_runner_bounds_the_room_it_is_given():
    """A step whose ``num_lookahead_tokens`` is hostile (room past k, past the blocks held, for
    unknown or prefilling requests, huge): the runner proposes within its own bounds, computes
    nothing outside the request's blocks, and the output is still the model's."""
    from ketch.engine.core.scheduler_output import SchedulerOutput

    prompts = quoting_prompts()[:1]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected = run(LLM("tiny", num_threads=2, block_size=16), prompts, params)
    spec = LLM("tiny", num_threads=2, block_size=16, speculative_config=NGRAM)
    engine = spec.engine
    real_schedule = engine.scheduler.schedule

    def hostile() -> SchedulerOutput:
        out = real_schedule()
        room = {rid: (1 << 62) for rid in out.num_scheduled_tokens}
        room.update({"no-such-request": 3, "": 1 << 20})
        out.num_lookahead_tokens = room
        return out

    engine.scheduler.schedule = hostile
    drafted = []
    real_execute = engine.runner.execute

    def execute(sched):
        output = real_execute(sched)
        drafted.extend(output.num_draft_tokens.values())
        return output

    engine.runner.execute = execute
    got = run(spec, prompts, params)
    assert drafted and max(drafted) <= NGRAM["num_speculative_tokens"]
    # drafts stayed within k and within the blocks each request holds (the runner's bounds,
    # whatever the room said); the tokens kept are the model's own, so the output is too
    assert got == expected
    engine.scheduler.check_integrity()


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 99999999999999999999999}', "num_spec"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 4.0}', "num_speculative_tokens"),
        ('{"method": ["ngram"], "num_speculative_tokens": 4}', "method"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 0}', "min"),
        (
            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, '
            '"prompt_lookup_min": 3}',
            "prompt_lookup_min",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": -1}', "disab"),
        ('{"method": "draft", "num_speculative_tokens": 4, "model": 7}', "model"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "model": "tiny"}', "model"),
        ("[" * 100000 + "]" * 100000, "at most"),  # huge and deep: refused before decoding
        ("[" * 2000 + "]" * 2000, "nested too deep"),
        ("{" + ", ".join(f'"k{i}": {i}' for i in range(300)) + "}", "unknown key"),
        ("not json", "not valid JSON"),
        ("42", "JSON object"),
    ],
)
def test_bad_speculative_config_is_named(value, named):
    """Wrong types, extreme values, huge and deep inputs: one ValueError naming what is wrong,
    on every path (flag text, config-file mapping, LLM kwargs all go through ``parse``)."""
    from ketch.engine.config import EngineConfig
    from ketch.engine.spec_decode.config import SpeculativeConfig

    with pytest.raises(ValueError, match=named):
        SpeculativeConfig.parse(value)
    with pytest.raises(ValueError, match=named):
        EngineConfig(speculative_config=value)


def test_scheduler_output_refuses_negative_room():
    from ketch.engine.core.scheduler_output import CachedRequestData, SchedulerOutput

    with pytest.raises(ValueError, match="num_lookahead_tokens"):
        SchedulerOutput([], CachedRequestData(), {}, 0, set(), num_lookahead_tokens={"r": -1})


def test_scheduler_keeps_no_more_extra_tokens_than_the_room_it_gave():
    """A runner output claiming more extra tokens than the step's room (or for a request given
    none) adds only what the room allowed."""
    from ketch.engine.core.scheduler_output import ModelRunnerOutput

    scheduler = _scheduler(k=2, max_batch=0)
    requests = _decoding(scheduler, 2)
    out = scheduler.schedule()
    assert out.num_lookahead_tokens == {"r0": 2, "r1": 2}
    out.num_lookahead_tokens = {"r0": 2}  # r1 was given no room
    lengths = [r.num_tokens for r in requests]
    result = ModelRunnerOutput(
        ["r0", "r1"],
        [5, 5],
        num_draft_tokens={"r0": 2, "r1": 2},
        extra_token_ids={"r0": [6, 7, 8, 9] * 1000, "r1": [6, 7]},
    )
    scheduler.update_from_output(out, result)
    assert [r.num_tokens - n for r, n in zip(requests, lengths, strict=True)] == [3, 1]
    assert requests[0].num_computed_tokens == requests[0].num_tokens - 1
    assert scheduler.stats.num_draft_tokens == 2 and scheduler.stats.num_accepted_tokens == 2
    scheduler.check_integrity()
