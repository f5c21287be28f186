"""Measures the grammar engines Ketch could use for structured outputs, on this machine.

For each engine (llguidance, xgrammar) and each tokenizer: the one-off tokenizer set-up, the
compile time of a typical JSON schema (cold, then a second distinct schema), and the per-token
cost of computing the mask and advancing the matcher along a valid document. Then what the
mask adds to Ketch's sampler: one greedy step of 8 requests, unconstrained vs constrained
(mask, -inf fill, argmax, matcher advance), and constrained with the masks computed ahead, off
the step (what a served worker does while the engine schedules the next step). Prints tables.

    python benchmarks/bench_grammar.py [--tokenizer DIR ...]

Each DIR holds a Hugging Face tokenizer.json. Without one the tiny model's tokenizer is used.
xgrammar is optional (it needs torch and transformers); it is skipped when it cannot be imported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.com",
    "tags": ["math", "engines", "poetry"],
    "role": "admin",
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
    "score": 0.97,
}


def _variant(i: int) -> dict:
    schema = json.loads(json.dumps(SCHEMA))
    schema["properties"][f"extra{i}"] = {"type": "integer"}
    return schema


def bench_llguidance(tokenizer_json: str, vocab: int, text_ids: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.numpy as lln

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=0)
    setup = time.perf_counter() - t0
    options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    compiles = []
    for i in range(2):
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_variant(i), overrides=options)
        matcher = llguidance.LLMatcher(tok, grammar)
        compiles.append(time.perf_counter() - t0)
        assert not matcher.is_error(), matcher.get_error()
    mask = lln.allocate_token_bitmask(1, vocab)
    per_token = []
    for token in text_ids:
        t0 = time.perf_counter()
        lln.fill_next_token_bitmask(matcher, mask)
        ok = matcher.consume_token(token)
        per_token.append(time.perf_counter() - t0)
        assert ok, matcher.get_error()
    return {
        "setup": setup,
        "compile": compiles[0],
        "compile2": compiles[1],
        "mask": _mean(per_token),
    }


def bench_xgrammar(tokenizer_dir: Path, vocab: int, text_ids: list[int]) -> dict[str, float]:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[0])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    setup = time.perf_counter() - t0
    compiles = []
    for i in range(2):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(
            json.dumps(_variant(i)), any_whitespace=False, separators=(",", ":")
        )
        compiles.append(time.perf_counter() - t0)
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, vocab)
    per_token = []
    for token in text_ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        ok = matcher.accept_token(token)
        per_token.append(time.perf_counter() - t0)
        assert ok
    return {
        "setup": setup,
        "compile": compiles[0],
        "compile2": compiles[1],
        "mask": _mean(per_token),
    }


def bench_sampler(tokenizer_dir: Path, vocab: int, batch: int = 8, steps: int = 100) -> tuple:
    """ms per sampler step of ``batch`` greedy requests: (unconstrained, constrained,
    constrained with the masks computed ahead and not timed)."""
    import numpy as np

    from ketch.engine import SamplingParams
    from ketch.engine.structured import grammars
    from ketch.engine.structured.compiler import GrammarCompiler, precompute_masks
    from ketch.engine.worker.sampler import SamplingState, sample

    compiler = GrammarCompiler(tokenizer_dir / "tokenizer.json", vocab, [0])
    grammar = grammars.json_schema(SCHEMA)
    rng = np.random.default_rng(0)
    results = []
    for constrained, ahead in ((False, False), (True, False), (True, True)):
        states = []
        for i in range(batch):
            params = SamplingParams(temperature=0, grammar=grammar if constrained else None)
            state = SamplingState.create(params, [1, 2], 2, i, (0,))
            if constrained:
                state.grammar = compiler.matcher(grammar)
                state.grammar.ready()
            states.append(state)
        total = 0.0
        for _ in range(steps):
            logits = rng.normal(size=(batch, vocab)).astype(np.float32)
            t0 = time.perf_counter()
            tokens, _ = sample(logits, states)
            for state, token in zip(states, tokens, strict=True):
                state.accept(token)
            total += time.perf_counter() - t0
            if ahead:
                precompute_masks([s.grammar for s in states if s.grammar is not None])
        results.append(total / steps)
    return tuple(results)


def _mean(values: list[float]) -> float:
    return statistics.fmean(values[1:]) if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = Path(__file__).resolve().parents[1] / "engine/ketch/engine/models/tiny"
    parser.add_argument("--tokenizer", type=Path, action="append", default=[])
    args = parser.parse_args()
    from tokenizers import Tokenizer

    print(
        f"{'engine':<11} {'vocab':>6} {'setup ms':>9} {'compile ms':>11} {'2nd ms':>8} "
        f"{'mask+advance us/token':>22}"
    )
    for directory in args.tokenizer or [default]:
        text = (directory / "tokenizer.json").read_text()
        hf = Tokenizer.from_str(text)
        vocab = hf.get_vocab_size(with_added_tokens=True)
        ids = hf.encode(json.dumps(DOCUMENT, separators=(",", ":"))).ids
        results = {"llguidance": bench_llguidance(text, vocab, ids)}
        try:
            results["xgrammar"] = bench_xgrammar(directory, vocab, ids)
        except ImportError as exc:
            print(f"xgrammar skipped: {exc}")
        for name, r in results.items():
            print(
                f"{name:<11} {vocab:>6} {r['setup'] * 1e3:>9.1f} {r['compile'] * 1e3:>11.2f} "
                f"{r['compile2'] * 1e3:>8.2f} {r['mask'] * 1e6:>22.1f}"
            )
    print(
        f"\n{'vocab':>6} {'sampler step, 8 plain ms':>25} {'8 constrained ms':>17} "
        f"{'8 constrained, masks ahead ms':>30}"
    )
    for directory in args.tokenizer or [default]:
        vocab = Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size(True)
        plain, constrained, ahead = bench_sampler(directory, vocab)
        print(f"{vocab:>6} {plain * 1e3:>25.3f} {constrained * 1e3:>17.3f} {ahead * 1e3:>30.3f}")


if __name__ == "__main__":
    main()
