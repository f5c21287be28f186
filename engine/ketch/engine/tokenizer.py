"""Tokenizer (Hugging Face ``tokenizer.json``, or a SentencePiece ``tokenizer.model`` converted
at load by ``ketch.engine.sentencepiece``) and chat template (jinja2, sandboxed)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from ketch.engine.errors import ModelLoadError
from ketch.engine.models.paths import read_json_object
from ketch.engine.sentencepiece import tokenizer_from_model_file

Message = dict[str, Any]
RELEASE_GIL_CHARS = 2048
"""Texts longer than this are encoded with ``encode_batch``, which releases the GIL."""
RELEASE_GIL_TOKENS = 2048
"""Token lists longer than this are decoded with ``decode_batch``, which releases the GIL."""
TEMPLATE_VARIABLES = (
    "messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
    "raise_exception", "strftime_now",
)  # fmt: skip
"""The names a chat template sees from the renderer itself (``apply_chat_template``'s and the
API server's ``tools``): a request's ``chat_template_kwargs`` may not set them."""
# What rendering a template can raise when messages (whose extra fields reach the template)
# have a shape it does not expect: a 400 for the request, never a 500 with a traceback.
_RENDER_ERRORS = (
    TypeError, AttributeError, KeyError, IndexError, ValueError, ArithmeticError,
    RecursionError, UnicodeError,
)  # fmt: skip


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template."""

    def __init__(self, path: Path) -> None:
        self._tok = load_tokenizer(path)
        self._config = tokenizer_config(path)
        self.path = path
        # decode_token's, by skip_special_tokens (at most 2 a token)
        self._token_texts: dict[bool, dict[int, str]] = {False: {}, True: {}}

    @cached_property
    def byte_level(self) -> bool:
        """Whether the text of token ids is the UTF-8 of their bytes one after another (a
        byte-level BPE's ``ByteLevel`` decoder; an added token's text stands for its bytes):
        then ``decode(a + b) == decode(a) + decode(b)`` whenever ``decode(a)`` is whole (no
        U+FFFD), as the UTF-8 of ``b``'s bytes starts afresh after a complete character."""
        return type(self._tok.decoder) is decoders.ByteLevel

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _special(self, key: str) -> str | None:
        value = self._config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else None

    @cached_property
    def eos_token(self) -> str | None:
        return self._special("eos_token")

    @cached_property
    def bos_token(self) -> str | None:
        return self._special("bos_token")

    @cached_property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._tok.token_to_id(self.eos_token)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def is_special(self, token: str) -> bool:
        """Whether ``token`` is an added token marked special (``skip_special_tokens`` drops
        those from decoded text)."""
        added = self._tok.get_added_tokens_decoder().values()
        return any(t.content == token and t.special for t in added)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. A long text goes through ``encode_batch``, which releases
        the GIL while it works (``encode`` holds it: about a second per MiB), so a thread
        tokenising it leaves the others, and an event loop, running."""
        if len(text) > RELEASE_GIL_CHARS:
            # ``encode_batch_fast`` (tokenizers >= 0.20) skips offsets, which nothing here
            # reads: about twice as fast, and it holds the GIL a third as long at the end.
            batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
            return batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode_token(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """``decode([token_id])``, remembered: the incremental detokenizer asks for one token's
        text alone at almost every token it adds."""
        texts = self._token_texts[skip_special_tokens]
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = self._tok.decode(
                [token_id], skip_special_tokens=skip_special_tokens
            )
        return text

    def token_texts(self, skip_special_tokens: bool) -> dict[int, str]:
        """``decode_token``'s memory: the texts of the tokens decoded alone so far."""
        return self._token_texts[skip_special_tokens]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``; many of them through ``decode_batch`` (GIL released)."""
        if len(token_ids) > RELEASE_GIL_TOKENS:
            return self._tok.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def chat_template_source(self) -> str | None:
        """The chat template's jinja text (tokenizer_config.json or chat_template.jinja)."""
        source = self._config.get("chat_template")
        if isinstance(source, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not source:
            jinja_file = self.path / "chat_template.jinja"
            source = jinja_file.read_text() if jinja_file.is_file() else None
        return source if isinstance(source, str) and source else None

    @cached_property
    def chat_template(self) -> jinja2.Template | None:
        source = self.chat_template_source
        if not source:
            return None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ModelLoadError(f"{self.path}: chat template does not parse: {exc}") from exc

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Renders messages to the prompt text the model was trained on."""
        template = self.chat_template
        if template is None:
            raise ValueError(
                "this model has no chat template (tokenizer_config.json 'chat_template'); "
                "use plain completions instead"
            )
        normalised = [_normalise(m, i) for i, m in enumerate(_check_list(messages))]
        try:
            return template.render(
                messages=normalised,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template rejected these messages: {exc}") from None
        except _RENDER_ERRORS as exc:  # the template met a shape it does not expect
            raise ValueError(
                f"the chat template cannot render these messages: {type(exc).__name__}: "
                f"{_short(exc)}"
            ) from None


def load_tokenizer(path: Path) -> HFTokenizer:
    """The model directory's ``tokenizer.json``, else its SentencePiece ``tokenizer.model``
    converted (``ketch.engine.sentencepiece``)."""
    file = path / "tokenizer.json"
    if not file.is_file():
        spm = path / "tokenizer.model"
        if spm.is_file():
            return tokenizer_from_model_file(spm, tokenizer_config(path))
        raise ModelLoadError(
            f"{path} has no tokenizer.json (a Hugging Face fast tokenizer) and no "
            "tokenizer.model (SentencePiece)"
        )
    try:
        return HFTokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception subclass
        raise ModelLoadError(f"{file}: cannot load tokenizer: {exc}") from exc


def tokenizer_config(path: Path) -> dict[str, Any]:
    """The model directory's tokenizer_config.json ({} without one)."""
    file = path / "tokenizer_config.json"
    return read_json_object(file) if file.is_file() else {}


def tokenizer_json(tokenizer_file: Path) -> str:
    """The text of ``tokenizer_file`` (a model's tokenizer.json), or, where the model ships only
    a SentencePiece ``tokenizer.model`` beside it, the JSON of its conversion (what the grammar
    engine reads)."""
    if tokenizer_file.is_file():
        return tokenizer_file.read_text()
    return load_tokenizer(tokenizer_file.parent).to_str()


def _check_list(messages: Any) -> list[Any]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    return messages


def _normalise(message: Any, index: int) -> Message:
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be an object with 'role' and 'content'")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"messages[{index}].role must be a non-empty string")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError(f"messages[{index}].content: only text parts are supported")
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts")
    return {**message, "role": role, "content": content}


def _short(exc: BaseException, limit: int = 300) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "..."


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)
