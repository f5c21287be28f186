"""A SentencePiece ``tokenizer.model`` turned into a Hugging Face ``tokenizers`` tokenizer.

Some checkpoints ship only the SentencePiece model (Llama 2, Mistral v0.1, Gemma, ERNIE 4.5 have
``tokenizer.model`` and, in older uploads, no ``tokenizer.json``). Ketch tokenizes with
``tokenizers`` everywhere (the server, the incremental detokenizer, the grammar engine, which
reads the tokenizer's JSON), so the SentencePiece model is converted once at load into the same
pipeline, the way transformers' slow-to-fast conversion does it:

- the file is a serialized ``ModelProto``, read here with a small protobuf wire-format reader
  (no ``sentencepiece`` or ``protobuf`` package at run time): its pieces (text, score, type),
  trainer spec (model type, byte fallback, digit splitting, special ids) and normalizer spec;
- normalizer: the precompiled character map (NFKC-like rules) when there is one, then the
  whitespace clean-up ``remove_extra_whitespaces`` asks for; pre-tokenizer: spaces become ``▁``
  with one prepended to the text (``add_dummy_prefix``), digits split when ``split_digits``;
- model: ``Unigram`` (pieces with their log-probabilities) or ``BPE`` (merges recovered from the
  vocabulary: a piece that splits into two pieces is their merge, ranked by the piece's score,
  as SentencePiece's BPE always merges the pair whose result scores highest), with byte
  fallback (``<0xNN>`` pieces) when the model was trained with it;
- control pieces (``<s>``, ``</s>``) and the unknown piece become special added tokens,
  user-defined pieces plain added tokens (SentencePiece matches those in text); BOS/EOS are
  added as ``tokenizer_config.json`` says (``add_bos_token``, default true; ``add_eos_token``).

Anything this conversion cannot reproduce (whitespace as a suffix, unescaped whitespace, WORD or
CHAR models) is refused naming the field. ``tests/engine/test_sentencepiece.py`` checks the
result against the ``sentencepiece`` library itself on models it trains.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from ketch.engine.errors import ModelLoadError

SPACE = "\u2581"  # SentencePiece's visible space
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2
MAX_MODEL_BYTES = 64 << 20  # the largest vocabularies' models are a few MiB


@dataclass
class Piece:
    text: str
    score: float = 0.0
    type: int = NORMAL


@dataclass
class SentencePieceModel:
    """The parts of a ``ModelProto`` the conversion reads, with the proto's defaults."""

    pieces: list[Piece] = field(default_factory=list)
    model_type: int = UNIGRAM
    byte_fallback: bool = False
    split_digits: bool = False
    treat_whitespace_as_suffix: bool = False
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True

    @classmethod
    def parse(cls, data: bytes) -> SentencePieceModel:
        model = cls()
        for number, value in _fields(data):
            if number == 1:
                model.pieces.append(_piece(value))
            elif number == 2:
                model._trainer(value)
            elif number == 3:
                model._normalizer(value)
        return model

    def _trainer(self, data: bytes) -> None:
        for number, value in _fields(data):
            if number == 3:
                self.model_type = value
            elif number == 24:
                self.treat_whitespace_as_suffix = bool(value)
            elif number == 25:
                self.split_digits = bool(value)
            elif number == 35:
                self.byte_fallback = bool(value)
            elif number in (40, 41, 42):
                setattr(self, {40: "unk_id", 41: "bos_id", 42: "eos_id"}[number], _int32(value))

    def _normalizer(self, data: bytes) -> None:
        for number, value in _fields(data):
            if number == 2:
                self.precompiled_charsmap = bytes(value)
            elif number in (3, 4, 5):
                name = {3: "add_dummy_prefix", 4: "remove_extra_whitespaces"}.get(number)
                setattr(self, name or "escape_whitespaces", bool(value))

    def piece(self, index: int) -> str | None:
        return self.pieces[index].text if 0 <= index < len(self.pieces) else None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, Any]]:
    """(field number, value) of each field of one message: an int for varints, bytes for
    length-delimited fields, a float for 32-bit ones (the only fixed-width kind used)."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                raise ValueError(f"field {number} runs past the end")
            value, pos = data[pos : pos + size], pos + size
        elif wire == 5:
            if pos + 4 > len(data):
                raise ValueError(f"field {number} runs past the end")
            value, pos = struct.unpack_from("<f", data, pos)[0], pos + 4
        elif wire == 1:
            pos += 8
            value = None
        else:
            raise ValueError(f"field {number} has wire type {wire}, not one SentencePiece uses")
        yield number, value


def _int32(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _piece(data: bytes) -> Piece:
    piece = Piece("")
    for number, value in _fields(data):
        if number == 1:
            piece.text = bytes(value).decode("utf-8")
        elif number == 2:
            piece.score = float(value)
        elif number == 3:
            piece.type = value
    return piece


def read_model(path: Path) -> SentencePieceModel:
    size = path.stat().st_size
    if size > MAX_MODEL_BYTES:
        raise ModelLoadError(f"{path}: {size} bytes, more than a SentencePiece model has")
    try:
        model = SentencePieceModel.parse(path.read_bytes())
    except (ValueError, UnicodeDecodeError, struct.error) as exc:
        raise ModelLoadError(f"{path} is not a SentencePiece model: {exc}") from None
    if not model.pieces:
        raise ModelLoadError(f"{path} is not a SentencePiece model: it has no pieces")
    _refuse_unsupported(model, path)
    return model


def _refuse_unsupported(model: SentencePieceModel, path: Path) -> None:
    if model.model_type not in (UNIGRAM, BPE):
        raise ModelLoadError(
            f"{path}: trainer_spec.model_type={model.model_type}: only UNIGRAM (1) and BPE (2) "
            "SentencePiece models are supported"
        )
    if model.treat_whitespace_as_suffix:
        raise ModelLoadError(f"{path}: trainer_spec.treat_whitespace_as_suffix is not supported")
    if not model.escape_whitespaces:
        raise ModelLoadError(f"{path}: normalizer_spec.escape_whitespaces=false is not supported")
    if model.piece(model.unk_id) is None:
        raise ModelLoadError(f"{path}: trainer_spec.unk_id={model.unk_id} names no piece")


def convert(model: SentencePieceModel, config: dict[str, Any] | None = None) -> Tokenizer:
    """The ``tokenizers`` equivalent of ``model``; ``config``: tokenizer_config.json."""
    config = config or {}
    tokenizer = Tokenizer(_model(model))
    tokenizer.normalizer = _normalizer(model)
    if model.split_digits:
        tokenizer.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    tokenizer.decoder = _decoder(model)
    tokenizer.add_special_tokens(
        [
            AddedToken(p.text, special=True, normalized=False)
            for p in model.pieces
            if p.type in (CONTROL, UNKNOWN)
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(p.text, special=False, normalized=False)
            for p in model.pieces
            if p.type == USER_DEFINED
        ]
    )
    processor = _post_processor(model, config)
    if processor is not None:
        tokenizer.post_processor = processor
    return tokenizer


def _model(model: SentencePieceModel) -> Any:
    unk = model.piece(model.unk_id)
    if model.model_type == UNIGRAM:
        vocab = [(p.text, p.score) for p in model.pieces]
        return models.Unigram(vocab, model.unk_id, model.byte_fallback)
    vocab = {p.text: i for i, p in enumerate(model.pieces)}
    return models.BPE(
        vocab, _merges(model), unk_token=unk, fuse_unk=True, byte_fallback=model.byte_fallback
    )


def _merges(model: SentencePieceModel) -> list[tuple[str, str]]:
    """Every way a normal piece splits into two normal pieces, best-scoring result first
    (ties: the split whose parts come earlier in the vocabulary first)."""
    ids = {p.text: i for i, p in enumerate(model.pieces) if p.type == NORMAL}
    ranked = []
    for text, index in ids.items():
        score = model.pieces[index].score
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in ids and right in ids:
                ranked.append((-score, index, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _normalizer(model: SentencePieceModel) -> Any:
    steps: list[Any] = []
    if model.precompiled_charsmap:
        steps.append(normalizers.Precompiled(model.precompiled_charsmap))
    if model.remove_extra_whitespaces:
        # SentencePiece drops leading and trailing spaces and keeps one of each run.
        steps += [
            normalizers.Strip(left=True, right=True),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    if model.add_dummy_prefix:
        steps.append(normalizers.Prepend(SPACE))
    steps.append(normalizers.Replace(" ", SPACE))
    return normalizers.Sequence(steps)


def _decoder(model: SentencePieceModel) -> Any:
    steps: list[Any] = [decoders.Replace(SPACE, " ")]
    if model.byte_fallback:
        steps.append(decoders.ByteFallback())
    steps.append(decoders.Fuse())
    if model.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    return decoders.Sequence(steps)


def _post_processor(model: SentencePieceModel, config: dict[str, Any]) -> Any:
    single, special = ["$A"], []
    for key, index, where, default in (
        ("add_bos_token", model.bos_id, 0, True),
        ("add_eos_token", model.eos_id, None, False),
    ):
        text = model.piece(index)
        wanted = config.get(key, default)
        if text is None or not wanted:
            continue
        if where == 0:
            single.insert(0, text)
        else:
            single.append(text)
        special.append((text, index))
    if not special:
        return None
    pair = single + ["$B" if s == "$A" else s for s in single]
    return processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=special
    )


def tokenizer_from_model_file(path: Path, config: dict[str, Any] | None = None) -> Tokenizer:
    """``path``: a ``tokenizer.model``; ``config``: the model's tokenizer_config.json, which
    says whether BOS/EOS are added."""
    return convert(read_model(path), config)
