"""The structured-output fields of a request, and the check that their grammar compiles.

Clients spell "constrain the output" several ways; all of them end as one grammar text in
``SamplingParams.grammar``:

- OpenAI's ``response_format``: ``{"type": "json_object"}``, or ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` (``{"type": "text"}`` changes nothing);
- vLLM's extras ``guided_json`` (a schema, or its JSON text), ``guided_regex``,
  ``guided_choice`` (a list of strings) and ``guided_grammar`` (Lark or GBNF);
- vLLM's newer ``structured_outputs`` object with one of ``json``, ``regex``, ``choice``,
  ``grammar`` or ``json_object: true``.

A request gives at most one of them. Every problem is a ``GuidedError`` naming the field; the
grammar is compiled against the model's vocabulary (``check_grammar``) before the request is
sent, on a thread, so a bad one is a 400 here and never reaches the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr

from ketch.engine.structured import grammars
from ketch.engine.structured.compiler import GrammarCompiler, GrammarError

_VLLM_FIELDS: dict[str, Callable[[Any], str]] = {
    "json": grammars.json_schema,
    "regex": grammars.regex,
    "choice": grammars.choice,
    "grammar": grammars.grammar,
}
_IGNORED_KEYS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                 "whitespace_pattern", "backend", "structural_tag"}  # fmt: skip


class GuidedError(ValueError):
    """A structured-output field that is wrong; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class GuidedFields(BaseModel):
    """The structured-output fields both generation endpoints accept."""

    model_config = ConfigDict(strict=True, extra="ignore")

    response_format: dict[str, Any] | None = None
    guided_json: Any = None  # a schema or its JSON text: checked by grammars.json_schema
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    _source: tuple[tuple[str, str] | None] | None = PrivateAttr(None)

    def grammar_source(self) -> tuple[str, str] | None:
        """(the grammar text, the field it came from), or None; GuidedError if wrong."""
        if self._source is None:
            self._source = (self._grammar_source(),)
        return self._source[0]

    def _grammar_source(self) -> tuple[str, str] | None:
        given = [
            (name, value)
            for name in ("response_format", "structured_outputs", *_GUIDED)
            if (value := getattr(self, name)) is not None
            and not (name == "response_format" and value.get("type") == "text")
        ]
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise GuidedError(given[1][0], f"give one way of constraining the output, not {names}")
        name, value = given[0]
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            return _structured_outputs(value)
        return _build(name, _VLLM_FIELDS[name.removeprefix("guided_")], value), name


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _build(param: str, builder: Callable[..., str], *args: Any) -> str:
    try:
        return builder(*args)
    except ValueError as exc:
        raise GuidedError(param, f"{param}: {exc}") from None


def _response_format(value: dict[str, Any]) -> tuple[str, str]:
    kind = value.get("type")
    if kind == "json_object":
        return grammars.json_object(), "response_format"
    if kind != "json_schema":
        raise GuidedError(
            "response_format",
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise GuidedError(
            "response_format", "response_format.json_schema must be an object with a 'schema'"
        )
    strict = spec.get("strict")
    if not isinstance(strict, bool | None):
        raise GuidedError("response_format", "response_format.json_schema.strict must be a bool")
    param = "response_format.json_schema.schema"
    return _build(param, grammars.json_schema, spec["schema"], bool(strict)), param


def _structured_outputs(value: dict[str, Any]) -> tuple[str, str]:
    kinds = [k for k in (*_VLLM_FIELDS, "json_object") if value.get(k) not in (None, False)]
    unknown = sorted(set(value) - set(_VLLM_FIELDS) - {"json_object"} - _IGNORED_KEYS)
    if unknown:
        raise GuidedError("structured_outputs", f"structured_outputs: unknown key {unknown[0]!r}")
    if len(kinds) != 1:
        raise GuidedError(
            "structured_outputs",
            "structured_outputs must give exactly one of json, regex, choice, grammar, "
            f"json_object (got {', '.join(kinds) or 'none'})",
        )
    kind = kinds[0]
    if kind == "json_object":
        if value[kind] is not True:
            raise GuidedError("structured_outputs", "structured_outputs.json_object must be true")
        return grammars.json_object(), "structured_outputs.json_object"
    param = f"structured_outputs.{kind}"
    return _build(param, _VLLM_FIELDS[kind], value[kind]), param


async def check_grammar(compiler: GrammarCompiler, grammar: str, param: str) -> None:
    """Compiles a request's grammar on a thread (kept in the compiler's cache); GuidedError
    naming ``param``, the field it came from, if it does not compile against this model."""
    try:
        await asyncio.to_thread(compiler.check, grammar)
    except GrammarError as exc:
        raise GuidedError(param, f"{param}: {exc}") from None
