"""The incremental detokenizer's byte-level shortcut gives the text the window decoding gives.

For a byte-level BPE (``Tokenizer.byte_level``), a token after a whole character is not
decoded together with the one before it: its text, decoded alone once, is appended. Here a
reference, the window algorithm as it was (every window decoded by ``tokenizers`` itself), runs
beside it on every tokenizer the tests use and on one with added tokens of every kind, over
random token ids (special, added and unknown ones, bytes that split multi-byte characters)
and over encoded emoji and CJK text: each delta must be the same, and so the whole text.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from hf_models import make_tokenizer
from ketch.engine.detokenizer import IncrementalDetokenizer
from ketch.engine.models.paths import TINY_COPY_MODEL_DIR, TINY_MODEL_DIR
from ketch.engine.tokenizer import Tokenizer

TEXTS = ["héllo wörld 😀 naïve 🎉 日本語 — “quotes” 🇫🇷 👩‍👩‍👧", "中文字符，한국어 ✓ ∑ 𝔘 x\n\t"]
ADDED = [
    AddedToken("<|special|>", special=True),
    AddedToken("<|plain|>", special=False),
    AddedToken("ĠĠgrave", special=False),  # byte-level alphabet characters
    AddedToken("ü—🙂", special=False),  # outside it
    AddedToken("<|ü|>", special=True),
]


class WindowDetokenizer:
    """The reference: every window decoded by ``tokenizers`` (no remembered token texts)."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int], skip: bool) -> None:
        self.decode = lambda ids: tokenizer._tok.decode(ids, skip_special_tokens=skip)
        self.tokens = list(prompt[-5:])
        self.prefix_offset, self.read_offset = 0, len(self.tokens)
        self.text = ""

    def add_token(self, token_id: int) -> None:
        self.tokens.append(token_id)
        prefix = self.decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self.decode(self.tokens[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)

    def finish(self) -> None:
        if self.read_offset < len(self.tokens):
            prefix = self.decode(self.tokens[self.prefix_offset : self.read_offset])
            self.text += self.decode(self.tokens[self.prefix_offset :])[len(prefix) :]


def _with_added_tokens(out: Path) -> Path:
    make_tokenizer(out)
    tok = HFTokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens([t for t in ADDED if not t.special])
    tok.add_special_tokens([t for t in ADDED if t.special])
    tok.save(str(out / "tokenizer.json"))
    return out


def _metaspace(out: Path) -> Path:
    """A SentencePiece-style tokenizer (Metaspace decoder): not byte-level, never shortcut."""
    make_tokenizer(out)
    tok = HFTokenizer.from_file(str(out / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    vocab = {"<unk>": 0, "▁": 1, "▁a": 2, "b": 3, "▁日本": 4, "語": 5, "😀": 6, "▁é": 7}
    tok.model = models.WordLevel(vocab, unk_token="<unk>")
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module", params=["tiny", "tiny-copy", "made", "added", "metaspace"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory) -> Tokenizer:
    if request.param in ("tiny", "tiny-copy"):
        path = TINY_MODEL_DIR if request.param == "tiny" else TINY_COPY_MODEL_DIR
        if not (path / "tokenizer.json").exists():
            pytest.skip(f"the built-in {request.param} model has no tokenizer")
        return Tokenizer(path)
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "made":
        make_tokenizer(out)  # the Llama / Qwen test checkpoints' tokenizer (hf_models)
    build = {"added": _with_added_tokens, "metaspace": _metaspace}.get(request.param)
    return Tokenizer(build(out) if build else out)


def _sequences(tokenizer: Tokenizer, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    specials = [i for i in range(vocab) if tokenizer.is_special(tokenizer.id_to_token(i) or "")]
    # Single bytes 0x80-0xff: the pieces of every multi-byte character.
    bytes_ = [tokenizer.token_to_id(c) for c in pre_tokenizers.ByteLevel.alphabet()]
    pieces = [i for i in bytes_ if i is not None] or list(range(vocab))
    sequences = [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
    for _ in range(40):
        pool = rng.choice([range(vocab), pieces, [*pieces, *specials, vocab + 3]])
        sequences.append([rng.choice(pool) for _ in range(rng.randrange(1, 40))])
    encoded = [t for text in TEXTS for t in tokenizer.encode(text, add_special_tokens=False)]
    for _ in range(10):  # real text, special tokens dropped in
        mixed = list(encoded)
        for _ in range(3):
            mixed.insert(rng.randrange(len(mixed) + 1), rng.choice(specials or [0]))
        sequences.append(mixed)
    return sequences


@pytest.mark.parametrize("skip", [True, False])
def test_each_delta_is_the_window_decodings(tokenizer: Tokenizer, skip: bool) -> None:
    expected_shortcut = type(tokenizer._tok.decoder) is decoders.ByteLevel
    assert tokenizer.byte_level == expected_shortcut
    prompts = [[], tokenizer.encode("a prompt", add_special_tokens=False), [1, 2, 3, 4, 5, 6]]
    for n, output in enumerate(_sequences(tokenizer, seed=hash(skip) & 0xFF)):
        prompt = prompts[n % len(prompts)]
        detok = IncrementalDetokenizer(tokenizer, prompt, [], skip)
        reference = WindowDetokenizer(tokenizer, prompt, skip)
        shown = 0
        for i, token in enumerate(output):
            detok.add_token(token)
            reference.add_token(token)
            assert detok.take_delta(False) == reference.text[shown:], (output[: i + 1], prompt)
            shown = len(reference.text)
        detok.finish()
        reference.finish()
        assert detok.text == reference.text, (output, prompt)


def test_encoded_text_comes_back_whole(tokenizer: Tokenizer) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer, [], [])
        deltas = []
        for token in ids:
            detok.add_token(token)
            deltas.append(detok.take_delta(False))
        detok.finish()
        deltas.append(detok.take_delta(True))
        assert "".join(deltas) == tokenizer.decode(ids)
        assert all("\ufffd" not in d for d in deltas) or "\ufffd" in tokenizer.decode(ids)
