"""Structured outputs in the engine: the grammar builders, the token mask in the sampler, and
the matcher through the runner (chunked prefill, preemption and recompute, a request resumed
past tokens sampled elsewhere).

The engine-level property is exactness: a constrained greedy request gives the same tokens
alone, in a batch, chunked and preempted; the matcher advances once per sampled token, so a
recomputed request (whose matcher would break if advanced twice) still finishes its grammar.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from ketch.engine import LLM, SamplingParams
from ketch.engine.models.loader import TINY_MODEL_DIR
from ketch.engine.structured import grammars
from ketch.engine.structured.compiler import (
    GrammarCompiler,
    GrammarError,
    next_bitmasks,
    precompute_masks,
)
from ketch.engine.worker.sampler import SamplingState, _masked_argmax, sample

TOKENIZER = TINY_MODEL_DIR / "tokenizer.json"
VOCAB = 1024
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TOKENIZER, VOCAB, [0])


def _state(compiler: GrammarCompiler, grammar: str, **params) -> SamplingState:
    state = SamplingState.create(SamplingParams(grammar=grammar, **params), [5, 6], 2, 0, (0,))
    state.grammar = compiler.matcher(grammar)
    return state


# ---- builders ----


def test_strict_closes_every_object():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {}}, "b": {"type": "array",
                       "items": {"type": "object"}}},
        "$defs": {"d": {"properties": {"x": {}}}},
        "additionalProperties": True,
    }  # fmt: skip
    grammar = json.loads(grammars.json_schema(schema, strict=True))
    closed = grammar["grammars"][0]["json_schema"]
    assert closed["additionalProperties"] is True  # what the schema says stays
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False


@pytest.mark.parametrize(
    ("build", "value", "words"),
    [
        (grammars.json_schema, {"type": "strin"}, "invalid JSON schema"),
        (grammars.json_schema, {"properties": {"a": {"minimum": "x"}}}, "at properties/a/minimum"),
        (grammars.json_schema, "[1", "not valid JSON"),
        (grammars.json_schema, 5, "must be an object"),
        (grammars.regex, "", "non-empty"),
        (grammars.choice, ["a", 1], "non-empty string"),
        (grammars.choice, ["x"] * 1025, "at most 1024"),
        (grammars.grammar, 'root ::= "a" undefined', "GBNF grammar does not parse"),
        (grammars.grammar, "  ", "non-empty"),
    ],
)
def test_builders_refuse_naming_the_problem(build, value, words: str):
    with pytest.raises(ValueError, match=words):
        build(value)


def test_schema_grammars_are_cached_by_the_schema_text():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}}
    first = grammars.json_schema(schema, strict=True)
    assert grammars.json_schema(json.dumps(schema), strict=True) == first
    assert grammars.json_schema(schema) != first  # strict is part of the key
    reordered = {**schema, "properties": dict(reversed(schema["properties"].items()))}
    assert grammars.json_schema(reordered, strict=True) != first  # the order orders the output
    for _ in range(2):  # a refusal is never cached as an answer
        with pytest.raises(ValueError, match="invalid JSON schema"):
            grammars.json_schema({"type": "strin"})


@pytest.mark.parametrize(
    ("grammar", "words"),
    [
        (grammars.regex("(ab"), "unclosed group"),
        (grammars.grammar("start: foo"), "unknown name"),
        (grammars.json_schema({"type": "object", "required": ["a"], "properties": {},
                               "additionalProperties": False}), "a"),
    ],
)  # fmt: skip
def test_the_compiler_refuses_what_does_not_compile(compiler, grammar: str, words: str):
    with pytest.raises(GrammarError, match=words):
        compiler.check(grammar)


def test_compiled_grammars_are_cached_by_text(compiler):
    grammar = grammars.json_schema({**SCHEMA, "title": "cached"})
    start = time.perf_counter()
    compiler.check(grammar)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(20):
        compiler.matcher(grammar).ready()
    assert (time.perf_counter() - start) / 20 < max(first, 1e-3)


# ---- the mask in the sampler ----


def test_greedy_picks_the_best_allowed_token_and_leaves_the_batch_alone(compiler):
    tok = compiler.tokenizer
    state = _state(compiler, grammars.choice(["yes", "no"]), temperature=0)
    plain = SamplingState.create(SamplingParams(temperature=0), [5, 6], 2, 0, (0,))
    assert not state.plain_greedy and plain.plain_greedy
    logits = np.zeros((2, VOCAB), dtype=np.float32)
    logits[:, 7] = 50.0  # the unconstrained argmax, allowed by neither choice
    no, yes = tok.tokenize_str("n")[0], tok.tokenize_str("y")[0]
    logits[0, no], logits[0, yes] = 2.0, 1.0
    before = logits.copy()
    tokens, _ = sample(logits, [state, plain])
    assert tokens == [no, 7]
    np.testing.assert_array_equal(logits, before)  # each row is masked in a copy


@pytest.mark.parametrize("vocab", [37, 64, 1024, 1030])
def test_the_batched_greedy_mask_equals_masking_every_row(vocab: int):
    rng = np.random.default_rng(vocab)
    for case in range(60):
        rows = rng.normal(size=(int(rng.integers(1, 9)), vocab)).astype(np.float32)
        words = rng.integers(-(2**31), 2**31, size=(len(rows), (vocab + 31) // 32))
        bitmasks = words.astype(np.int32) & [-1, 0x10001, 0x7FFFFFFF][case % 3]
        allowed = np.unpackbits(bitmasks.view(np.uint8), axis=-1, bitorder="little")
        allowed = allowed[:, :vocab].astype(bool)
        if case % 4 == 0:  # some rows' own argmax allowed, the others' not
            allowed[::2, rows[::2].argmax(axis=-1)] = True
            bitmasks = np.packbits(allowed, axis=-1, bitorder="little")
            bitmasks = np.pad(bitmasks, [(0, 0), (0, (-bitmasks.shape[1]) % 4)])
            bitmasks = np.ascontiguousarray(bitmasks).view(np.int32)
        want = np.where(allowed, rows.astype(np.float64), -np.inf).argmax(axis=-1)
        assert _masked_argmax(rows, bitmasks) == want.tolist(), case
    padded = np.zeros((2, 96), dtype=np.float32)  # logits past the bitmask's 64 tokens
    padded[:, 70], padded[:, 3] = 9.0, 1.0
    assert _masked_argmax(padded, np.full((2, 2), -1, dtype=np.int32)) == [3, 3]


def test_masks_are_kept_until_the_matcher_advances(compiler):
    grammar = grammars.json_schema(SCHEMA)
    batch = [compiler.matcher(grammar) for _ in range(3)]
    for g in batch:
        g.ready()
    masks = next_bitmasks(batch)
    assert next_bitmasks(batch) is masks  # what the sampler finds after precompute_masks
    np.testing.assert_array_equal(next_bitmasks(batch[::-1]), masks[::-1])
    token = int(np.flatnonzero(batch[1].allowed())[0])
    batch[1].accept(token)
    fresh = compiler.matcher(grammar)
    fresh.accept(token)
    np.testing.assert_array_equal(next_bitmasks(batch)[1], next_bitmasks([fresh])[0])


def test_masks_computed_ahead_sample_what_masks_computed_late_do(compiler):
    grammar = grammars.json_schema(SCHEMA)
    runs = []
    for ahead in (False, True):
        rng = np.random.default_rng(5)
        states = [
            _state(compiler, grammar, temperature=0),
            _state(compiler, grammar, temperature=0.8, seed=2),
            SamplingState.create(SamplingParams(temperature=0), [5, 6], 2, 0, (0,)),
            _state(compiler, grammar, temperature=0, repetition_penalty=1.3),
        ]
        for g in states:
            if g.grammar is not None:
                g.grammar.ready()
        for step in range(40):
            batch = states if step % 5 else states[::-1]  # the batch's order changes too
            logits = rng.normal(size=(len(batch), VOCAB)).astype(np.float32) * 4
            for state, token in zip(batch, sample(logits, batch)[0], strict=True):
                state.accept(token)
            if ahead:
                precompute_masks([s.grammar for s in batch if s.grammar is not None])
        runs.append([s.token_ids for s in states])
    assert runs[0] == runs[1]
    for tokens in runs[1][:2] + runs[1][3:]:
        text = compiler.tokenizer.decode_str([t for t in tokens[2:] if t != 0])
        jsonschema.validate(json.loads(text), SCHEMA)


def test_sampled_tokens_are_all_allowed_and_eos_only_at_the_end(compiler):
    rng = np.random.default_rng(0)
    state = _state(compiler, grammars.regex("[ab]{2,4}"), temperature=1.0, seed=1)
    for _ in range(10):
        token = sample(rng.normal(size=(1, VOCAB)).astype(np.float32) * 5, [state])[0][0]
        state.accept(token)
        if token == 0:
            break
    text = compiler.tokenizer.decode_str(state.token_ids[2:-1])
    assert state.token_ids[-1] == 0 and 2 <= len(text) <= 4 and set(text) <= {"a", "b"}


def test_a_complete_grammar_ends_before_min_tokens(compiler):
    state = _state(compiler, grammars.choice(["ab"]), temperature=0, min_tokens=5)
    for token in compiler.tokenizer.tokenize_str("ab"):
        state.accept(token)
    logits = np.zeros((1, VOCAB), dtype=np.float32)
    assert sample(logits, [state])[0] == [0]


def test_a_broken_matcher_allows_only_eos(compiler):
    state = _state(compiler, grammars.choice(["ab"]), temperature=0)
    state.accept(compiler.tokenizer.tokenize_str("x")[0])  # not allowed: the matcher breaks
    logits = np.zeros((1, VOCAB), dtype=np.float32)
    assert sample(logits, [state])[0] == [0]


def test_a_matcher_resumes_past_tokens_sampled_elsewhere(compiler):
    grammar = grammars.choice(["abc"])
    first = compiler.tokenizer.tokenize_str("abc")[:1]
    resumed = compiler.matcher(grammar, first)
    fresh = compiler.matcher(grammar)
    fresh.accept(first[0])
    np.testing.assert_array_equal(resumed.allowed(), fresh.allowed())
    broken = compiler.matcher(grammar, compiler.tokenizer.tokenize_str("x"))
    assert "break the grammar" in (broken.ready() or "")


# ---- through the engine ----


@pytest.fixture(scope="module")
def random_path(checkpoint) -> Path:
    return checkpoint("llama")


def test_constrained_greedy_is_exact_under_chunking_and_preemption(random_path):
    grammar = grammars.json_schema(SCHEMA)
    prompts = [[(11 * i + 7 * j) % 250 + 3 for j in range(20 + 9 * i)] for i in range(10)]
    params = SamplingParams(temperature=0, max_tokens=60, grammar=grammar)
    alone = [LLM(str(random_path), block_size=16).generate([p], params)[0] for p in prompts[:3]]
    llm = LLM(
        str(random_path), block_size=16, max_num_batched_tokens=32, max_num_seqs=8,
        num_kv_blocks=24, max_model_len=256,
    )  # fmt: skip
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=60, grammar=grammar)
    outputs = llm.generate(prompts, [params if i % 2 else sampled for i in range(len(prompts))])
    assert llm.engine.scheduler.stats.num_preemptions > 0, "the pool should preempt"
    for i, out in enumerate(outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (i, completion.text)
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    batched = llm.generate(prompts[:3], params)
    for want, got in zip(alone, batched, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_an_offline_bad_grammar_fails_that_request_only(random_path):
    llm = LLM(str(random_path), block_size=16)
    bad = SamplingParams(temperature=0, max_tokens=4, grammar=grammars.regex("(ab"))
    good = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(Exception, match="grammar"):
        llm.generate([[5, 6, 7]], bad)
    assert llm.generate([[5, 6, 7]], good)[0].outputs[0].finish_reason == "length"
