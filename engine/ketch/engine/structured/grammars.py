"""What a client asks the output to be, as one llguidance grammar text.

Every builder returns the text ``SamplingParams.grammar`` carries, or raises ``ValueError``
saying what is wrong with the input. Nothing here needs the model: whether the grammar compiles
against a vocabulary is ``GrammarCompiler.check``'s business.

JSON is generated compact (``,`` and ``:`` with no whitespace around them): a model is never
allowed to pad a document with whitespace until it runs out of tokens.

Inputs are bounded before any work (``Limits``: the text's size, a schema's nesting depth and
node count), because the work is not linear: GBNF conversion is quadratic in the grammar's
length and JSON Schema meta-validation costs about 7 s per MiB. The API server runs the
builders in a worker process under a time budget (``ketch.engine.serving.guided``).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
"""How JSON is laid out: compact, one way only."""
MAX_CHOICES = 1024
"""The most alternatives a choice grammar may list."""
SCHEMA_CACHE_SIZE = 256
"""JSON schemas whose grammar text is kept (least recently used dropped first)."""


@dataclass(frozen=True)
class Limits:
    """What one structured-output input may be, checked before any work (the flags of
    ``ketch serve`` that set each, named in the refusal)."""

    max_bytes: int = 64 * 1024
    """A grammar's, a regex's, the choices' or a JSON schema's text, UTF-8 bytes."""
    max_schema_depth: int = 64
    """How deep a JSON schema's objects and arrays may nest (the document's depth)."""
    max_schema_nodes: int = 20_000
    """Values (objects, arrays, strings, numbers...) in a JSON schema."""


DEFAULT_LIMITS = Limits()


def check_size(what: str, text: str, limits: Limits = DEFAULT_LIMITS) -> None:
    """ValueError if ``text`` is longer than ``limits.max_bytes`` (UTF-8)."""
    if len(text) <= limits.max_bytes // 4:  # no character is more than 4 bytes
        return
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise ValueError(
            f"the {what} is {size} bytes; this server accepts at most {limits.max_bytes} "
            "(--max-grammar-bytes)"
        )


def schema_text(schema: Any, limits: Limits = DEFAULT_LIMITS) -> str:
    """A JSON schema (a dict, a bool, or its JSON text) as compact JSON text, within
    ``limits``: ValueError naming the limit otherwise. Cheap (linear, and bounded by the
    limits), so it may run where the expensive builders may not."""
    if isinstance(schema, str):
        check_size("JSON schema", schema, limits)
        try:
            schema = json.loads(schema)
        except RecursionError:
            _too_deep(_text_depth(schema), limits)
        except ValueError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError("a JSON schema must be an object")
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    check_shape(schema, limits)
    try:
        text = json.dumps(schema, ensure_ascii=False)  # key order kept: it orders the output
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"the JSON schema is not JSON: {exc}") from None
    check_size("JSON schema", text, limits)
    return text


def check_shape(value: Any, limits: Limits = DEFAULT_LIMITS) -> None:
    """ValueError if ``value`` (decoded JSON) nests deeper or holds more values than
    ``limits`` allow. Level by level, iterative, and stops at the first limit passed: a few
    milliseconds for the largest schema allowed, whatever it is sent with."""
    level = [value]
    depth = nodes = 0
    while level:
        depth += 1
        nodes += len(level)
        if nodes > limits.max_schema_nodes:
            raise ValueError(
                f"the JSON schema has more than {limits.max_schema_nodes} values; this server "
                f"accepts at most {limits.max_schema_nodes} (--max-schema-nodes)"
            )
        below: list[Any] = []
        for node in level:
            if isinstance(node, dict):
                below.extend(node.values())
            elif isinstance(node, list):
                below.extend(node)
        if below and depth >= limits.max_schema_depth:  # containers at the deepest level
            _too_deep(None, limits)
        level = below


def _too_deep(depth: int | None, limits: Limits) -> None:
    limit = limits.max_schema_depth
    if depth is not None and depth <= limit:  # too deep for the parser, not for the limit
        raise ValueError(f"the JSON schema nests too deeply to be parsed ({depth} levels)")
    said = f"{depth} levels deep" if depth is not None else f"deeper than {limit} levels"
    raise ValueError(
        f"the JSON schema nests {said}; this server accepts at most {limit} (--max-schema-depth)"
    )


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def _text_depth(text: str) -> int:
    """How deep the brackets of JSON ``text`` nest (strings skipped)."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_JSON_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def json_schema(schema: Any, strict: bool = False, limits: Limits = DEFAULT_LIMITS) -> str:
    """A document valid against ``schema`` (a dict, or its JSON text). ``strict`` (OpenAI's
    ``json_schema.strict``): objects that do not say ``additionalProperties`` get none."""
    return _schema_grammar(schema_text(schema, limits), strict)


@functools.lru_cache(maxsize=SCHEMA_CACHE_SIZE)
def _schema_grammar(text: str, strict: bool) -> str:
    """``json_schema`` of a schema's JSON text, cached: checking a schema against its
    meta-schema costs about 2 ms, on the API server's event loop, for every request that sends
    it (clients send the same few schemas again and again). Only what compiled is cached."""
    schema = json.loads(text)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
        if strict:
            schema = _closed(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ValueError(
            f"invalid JSON schema{f' at {where}' if where else ''}: {exc.message}"
        ) from None
    except RecursionError:  # within --max-schema-depth, but a checker went deeper still
        raise ValueError("the JSON schema nests too deeply to be checked") from None
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def json_object() -> str:
    """Any JSON object (``response_format: {"type": "json_object"}``)."""
    return json_schema({"type": "object"})


def regex(pattern: Any, limits: Limits = DEFAULT_LIMITS) -> str:
    """Text matching ``pattern`` as a whole (Rust ``regex`` syntax, as vLLM's backends)."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("the regex must be a non-empty string")
    check_size("regex", pattern, limits)
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice(options: Any, limits: Limits = DEFAULT_LIMITS) -> str:
    """Exactly one of ``options`` (a non-empty list of non-empty strings)."""
    choice_options(options)
    alternatives = " | ".join(json.dumps(o, ensure_ascii=False) for o in dict.fromkeys(options))
    check_size("list of choices", alternatives, limits)
    return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")


def choice_options(options: Any) -> list[str]:
    """``options`` if they are a non-empty list of at most ``MAX_CHOICES`` non-empty strings;
    ValueError saying what is wrong otherwise."""
    if not isinstance(options, list) or not options:
        raise ValueError("the choices must be a non-empty list of strings")
    if len(options) > MAX_CHOICES:
        raise ValueError(f"at most {MAX_CHOICES} choices are allowed, got {len(options)}")
    if not all(isinstance(o, str) and o for o in options):
        raise ValueError("every choice must be a non-empty string")
    return options


def grammar(source: Any, limits: Limits = DEFAULT_LIMITS) -> str:
    """A context-free grammar: Lark (llguidance's dialect, rule ``start``) or GBNF (``::=``
    rules with ``root``, as llama.cpp and vLLM's EBNF), converted to Lark."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError("the grammar must be a non-empty string")
    check_size("grammar", source, limits)
    if "::=" in source:
        try:
            source = gbnf_to_lark(source)
        except Exception as exc:  # the converter raises whatever its parser hit
            raise ValueError(f"the GBNF grammar does not parse: {_short(exc)}") from None
    return llguidance.LLMatcher.grammar_from_lark(source)


def _short(exc: BaseException, limit: int = 300) -> str:
    text = str(exc) if not isinstance(exc, RecursionError) else "it nests too deeply"
    return text if len(text) <= limit else text[:limit] + "..."


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that leaves it
    unsaid (OpenAI's strict mode), in every nested place a schema may be."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) if k in _NESTED else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: _closed(s) for name, s in schema[key].items()}
    if (schema.get("type") == "object" or "properties" in schema) and (
        "additionalProperties" not in schema
    ):
        out["additionalProperties"] = False
    return out


_NESTED = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "if", "then", "else")
