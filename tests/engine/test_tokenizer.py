"""Tokenizer, incremental detokeniser and chat template.

The incremental detokeniser decodes only a short window of recent tokens, so its text is
compared with a one-shot ``decode`` of the whole output: on random token sequences (which are
full of partial UTF-8), on text with emoji and accents, and around stop strings.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ketch.engine import LLM, SamplingParams
from ketch.engine.detokenizer import IncrementalDetokenizer
from ketch.engine.models.loader import TINY_MODEL_DIR
from ketch.engine.tokenizer import Tokenizer

HAVE_TINY = (TINY_MODEL_DIR / "config.json").exists()
needs_tiny = pytest.mark.skipif(not HAVE_TINY, reason="the built-in tiny model is not trained yet")
MULTIBYTE = "héllo wörld 😀 naïve café 🎉 日本語 — Zoë’s “quotes” ñ 🇫🇷"
PROMPT_TEXT = "Once upon a time"


@pytest.fixture(scope="module", params=["checkpoint", pytest.param("tiny", marks=needs_tiny)])
def tokenizer(request: pytest.FixtureRequest, checkpoint: Callable[..., Path]) -> Tokenizer:
    path = TINY_MODEL_DIR if request.param == "tiny" else checkpoint("llama")
    return Tokenizer(path)


def detokenize(
    tokenizer: Tokenizer, prompt: list[int], output: list[int], stop: list[str] | None = None
) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tokenizer, prompt, stop or [])
    for token in output:
        if detok.add_token(token):
            break
    return detok


def complete(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """Drops trailing tokens until the sequence does not end inside a UTF-8 character."""
    ids = list(ids)
    while ids and tokenizer.decode(ids).endswith("\ufffd"):
        ids.pop()
    return ids


def prompt_ids(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)


# ---- incremental detokenisation ----


def test_incremental_text_equals_decode_on_random_sequences(tokenizer: Tokenizer) -> None:
    rng = np.random.default_rng(0)
    prompt = prompt_ids(tokenizer)
    for _ in range(300):
        output = complete(tokenizer, rng.integers(0, tokenizer.vocab_size, 40).tolist())
        detok = detokenize(tokenizer, prompt, output)
        assert detok.text == tokenizer.decode(output), output


def test_incremental_text_equals_decode_on_multibyte_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    assert len(ids) > len(MULTIBYTE.split())  # multi-byte characters span several tokens
    for prompt in ([], prompt_ids(tokenizer)):
        detok = detokenize(tokenizer, prompt, ids)
        assert detok.text == MULTIBYTE == tokenizer.decode(ids)
    # Random mixes of those tokens: partial characters, repeated and out of order.
    rng = np.random.default_rng(1)
    pool = np.array(ids)
    for _ in range(200):
        output = complete(tokenizer, rng.choice(pool, 30).tolist())
        assert detokenize(tokenizer, [], output).text == tokenizer.decode(output), output


def test_streamed_deltas_add_up_to_the_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], [])
    streamed = ""
    for token in ids:
        detok.add_token(token)
        streamed += detok.take_delta(finished=False)
        assert "\ufffd" not in streamed  # no half characters are shown
    assert streamed == MULTIBYTE  # with no stop strings nothing is held back
    assert detok.take_delta(finished=True) == ""


def stream(tokenizer: Tokenizer, text: str, stop: list[str]) -> tuple[list[str], str, str]:
    """Feeds ``text`` token by token; returns what was streamed after each token, and the end."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), stop)
    streamed, seen = "", []
    for token in tokenizer.encode(text, add_special_tokens=False):
        stopped = detok.add_token(token)
        streamed += detok.take_delta(finished=stopped)
        seen.append(streamed)
        if stopped:
            break
    streamed += detok.take_delta(finished=True)
    return seen, streamed, detok.text


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("a STAR is not a STOP sign", ["STOP"], "a STAR is not a "),
        ("The quick brown fox jumps over the lazy dog", ["lazy", "fox jumps"], "The quick brown "),
        ("no stop string here at all", ["STOP"], "no stop string here at all"),
        ("over the lazy dog", ["he", " t"], "over"),  # the earliest stop wins, not the first
        ("café 😀 done", ["😀"], "café "),
    ],
)
def test_streaming_never_shows_a_stop_string_prefix(
    tokenizer: Tokenizer, text: str, stop: list[str], expected: str
) -> None:
    seen, streamed, final = stream(tokenizer, text, stop)
    assert final == streamed == expected
    for partial in seen:
        assert expected.startswith(partial), f"streamed {partial!r} before the stop"


def test_a_stop_string_spanning_two_tokens_is_caught(tokenizer: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert "".join(pieces) == text
    # The last char of one token and the first two of the next (a stop no single token holds).
    i = next(k for k in range(3, len(ids) - 1) if pieces[k].strip() and len(pieces[k + 1]) >= 2)
    stop = pieces[i][-1] + pieces[i + 1][:2]
    at = len("".join(pieces[: i + 1])) - 1
    assert text.find(stop) == at
    detok = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), [stop])
    results = [detok.add_token(t) for t in ids[: i + 2]]
    assert results == [False] * (i + 1) + [True]
    assert detok.text == text[:at]
    assert detok.stop_string == stop


# ---- through the engine ----


@pytest.fixture(scope="module")
def llm(checkpoint: Callable[..., Path]) -> Iterator[LLM]:
    yield LLM(str(checkpoint("llama")), block_size=16, num_kv_blocks=64, max_model_len=256)


def test_output_text_equals_decode_when_output_ends_mid_character(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    tokens = llm.generate(PROMPT_TEXT, greedy)[0].outputs[0].token_ids
    decode = llm.tokenizer.decode
    cut = next(k for k in range(1, len(tokens)) if decode(tokens[:k]).endswith("\ufffd"))
    params = SamplingParams(temperature=0.0, max_tokens=cut, ignore_eos=True)
    completion = llm.generate(PROMPT_TEXT, params)[0].outputs[0]
    assert completion.token_ids == tokens[:cut]
    assert completion.text == decode(completion.token_ids)


def test_output_text_equals_decode_of_output_tokens(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=32)
    prompts: list[str | list[int]] = [PROMPT_TEXT, "To be", prompt_ids(llm.tokenizer)]
    for output in llm.generate(prompts, params):
        completion = output.outputs[0]
        ids = complete(llm.tokenizer, completion.token_ids)
        assert completion.text.startswith(llm.tokenizer.decode(ids))


# ---- chat template ----

USER = {"role": "user", "content": "hi there"}


def test_chat_template_renders_messages(checkpoint: Callable[..., Path]) -> None:
    tokenizer = Tokenizer(checkpoint("llama"))
    system = {"role": "system", "content": "be brief"}
    assert tokenizer.apply_chat_template([system, USER]) == (
        "system: be brief\nuser: hi there\nassistant:"
    )
    assert tokenizer.apply_chat_template([USER], add_generation_prompt=False) == "user: hi there\n"
    text_parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    parts = {"role": "user", "content": text_parts}
    assert tokenizer.apply_chat_template([parts], add_generation_prompt=False) == "user: ab\n"
    empty = {"role": "assistant", "content": None}
    assert tokenizer.apply_chat_template([empty], add_generation_prompt=False) == "assistant: \n"


@needs_tiny
def test_tiny_chat_template_renders_messages() -> None:
    tokenizer = Tokenizer(TINY_MODEL_DIR)
    text = tokenizer.apply_chat_template([USER])
    assert "hi there" in text and text != "hi there"
    assert tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ("hello", "messages must be a non-empty list"),
        ({"role": "user", "content": "x"}, "messages must be a non-empty list"),
        ([], "messages must be a non-empty list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([USER, {"content": "no role"}], r"messages\[1\]\.role"),
        ([{"role": "", "content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "text parts"),
        ([{"role": "user", "content": ["plain string part"]}], "text parts"),
        ([{"role": "user", "content": 42}], r"messages\[0\]\.content"),
    ],
    ids=[
        "string",
        "dict",
        "empty",
        "not-an-object",
        "missing-role",
        "empty-role",
        "image-part",
        "bare-part",
        "int-content",
    ],
)
def test_bad_messages_raise_value_error_naming_the_problem(
    checkpoint: Callable[..., Path], messages: Any, message: str
) -> None:
    tokenizer = Tokenizer(checkpoint("llama"))
    with pytest.raises(ValueError, match=message):
        tokenizer.apply_chat_template(messages)


def with_template(source: Path, dest: Path, template: str | None) -> Tokenizer:
    shutil.copytree(source, dest)
    config_file = dest / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template")
    if template is not None:
        config["chat_template"] = template
    config_file.write_text(json.dumps(config))
    return Tokenizer(dest)


def test_missing_or_rejecting_template(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    source = checkpoint("llama")
    with pytest.raises(ValueError, match="no chat template"):
        with_template(source, tmp_path / "none", None).apply_chat_template([USER])
    strict = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    )
    with pytest.raises(ValueError, match="system first"):
        with_template(source, tmp_path / "strict", strict).apply_chat_template([USER])


def test_llm_chat_returns_text(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.chat([USER], params)
    assert len(outputs) == 1
    completion = outputs[0].outputs[0]
    assert isinstance(completion.text, str) and len(completion.token_ids) == 6
    rendered = llm.tokenizer.apply_chat_template([USER])
    assert outputs[0].prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    both = llm.chat([[USER], [{"role": "user", "content": "bye"}]], params)
    assert len(both) == 2 and both[0].outputs[0].token_ids == completion.token_ids


def test_llm_chat_with_bad_messages_loses_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="role"):
        llm.chat([[USER], [{"content": "no role"}]])
    assert not llm.engine.has_unfinished_requests()
