"""The built-in ``tiny-copy`` model: Ketch loads it, decodes it greedily as transformers does, and
it copies a passage it was never trained on when asked to repeat it (which is what n-gram
speculative decoding needs from a model)."""

from __future__ import annotations

import difflib
import fnmatch
import tomllib
from pathlib import Path

import pytest

from hf_models import greedy_of, hf_model
from ketch.engine import SamplingParams
from ketch.engine.llm import LLM
from ketch.engine.models.paths import TINY_COPY_MODEL_DIR, resolve_model_path

END_ID = 4  # <|end|>

REPO = Path(__file__).resolve().parents[2]
HELD_BACK = REPO / "tests" / "data" / "alice_held_back.txt"
INSTRUCTION = "Repeat the following passage:\n"


def held_back_passage(start: int, words: int = 110) -> str:
    return " ".join(HELD_BACK.read_text(encoding="utf-8").split()[start : start + words])


def copy_messages(passage: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": INSTRUCTION + passage}]


@pytest.fixture(scope="module")
def llm():
    llm = LLM("tiny-copy", block_size=16, kv_cache_memory="64MiB", max_model_len=1024)
    yield llm
    llm.engine.close()


def test_tiny_copy_resolves_to_the_built_in_directory() -> None:
    assert resolve_model_path("tiny-copy") == TINY_COPY_MODEL_DIR
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (TINY_COPY_MODEL_DIR / name).is_file(), name
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["package-data"]["ketch.engine.models"]
    for file in TINY_COPY_MODEL_DIR.iterdir():
        if file.suffix != ".py":
            assert any(fnmatch.fnmatch(f"tiny_copy/{file.name}", p) for p in patterns), file.name


def test_greedy_matches_transformers(llm: LLM) -> None:
    tokenizer = llm.tokenizer
    chat = tokenizer.apply_chat_template(copy_messages(held_back_passage(40, 30)), True)
    prompts = [
        tokenizer.encode(chat, add_special_tokens=False),
        tokenizer.encode(
            "Alice was beginning to get very tired\n\nAlice was", add_special_tokens=False
        ),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ours = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    assert ours == greedy_of(hf_model(TINY_COPY_MODEL_DIR), prompts, 24)


def copy_of(llm: LLM, passage: str) -> tuple[list[int], list[int]]:
    """(the passage's tokens, Ketch's greedy answer to the copy prompt, ``<|end|>`` dropped)."""
    want = llm.tokenizer.encode(passage, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=len(want) + 16)
    [out] = llm.chat(copy_messages(passage), params)
    got = [t for t in out.outputs[0].token_ids if t != END_ID]
    return want, got


# Measured with the shipped weights (train.py prints the same from transformers): both passages
# are copied exactly (ratio 1.0, every token), as are all 20 held-back windows train.py reports.
def test_copies_a_held_back_passage(llm: LLM) -> None:
    want, got = copy_of(llm, held_back_passage(110))
    ratio = difflib.SequenceMatcher(a=got, b=want, autojunk=False).ratio()
    assert ratio >= 0.9, (ratio, llm.tokenizer.decode(got))


def test_copies_a_long_stretch_before_a_repeated_phrase(llm: LLM) -> None:
    want, got = copy_of(llm, held_back_passage(0))
    matcher = difflib.SequenceMatcher(a=got, b=want, autojunk=False)
    longest = matcher.find_longest_match(0, len(got), 0, len(want)).size
    assert longest >= 50, (longest, llm.tokenizer.decode(got))
