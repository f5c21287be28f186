"""What a client asks the output to be, as one llguidance grammar text.

Every builder returns the text ``SamplingParams.grammar`` carries, or raises ``ValueError``
saying what is wrong with the input. Nothing here needs the model: whether the grammar compiles
against a vocabulary is ``GrammarCompiler.check``'s business.

JSON is generated compact (``,`` and ``:`` with no whitespace around them): a model is never
allowed to pad a document with whitespace until it runs out of tokens.
"""

from __future__ import annotations

import functools
import json
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


def json_schema(schema: Any, strict: bool = False) -> str:
    """A document valid against ``schema`` (a dict, or its JSON text). ``strict`` (OpenAI's
    ``json_schema.strict``): objects that do not say ``additionalProperties`` get none."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError("a JSON schema must be an object")
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    try:
        text = json.dumps(schema, ensure_ascii=False)  # key order kept: it orders the output
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the JSON schema is not JSON: {exc}") from None
    return _schema_grammar(text, strict)


@functools.lru_cache(maxsize=SCHEMA_CACHE_SIZE)
def _schema_grammar(text: str, strict: bool) -> str:
    """``json_schema`` of a schema's JSON text, cached: checking a schema against its
    meta-schema costs about 2 ms, on the API server's event loop, for every request that sends
    it (clients send the same few schemas again and again). Only what compiled is cached."""
    schema = json.loads(text)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ValueError(
            f"invalid JSON schema{f' at {where}' if where else ''}: {exc.message}"
        ) from None
    if strict:
        schema = _closed(schema)
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def json_object() -> str:
    """Any JSON object (``response_format: {"type": "json_object"}``)."""
    return json_schema({"type": "object"})


def regex(pattern: Any) -> str:
    """Text matching ``pattern`` as a whole (Rust ``regex`` syntax, as vLLM's backends)."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("the regex must be a non-empty string")
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice(options: Any) -> str:
    """Exactly one of ``options`` (a non-empty list of non-empty strings)."""
    if not isinstance(options, list) or not options:
        raise ValueError("the choices must be a non-empty list of strings")
    if len(options) > MAX_CHOICES:
        raise ValueError(f"at most {MAX_CHOICES} choices are allowed, got {len(options)}")
    if not all(isinstance(o, str) and o for o in options):
        raise ValueError("every choice must be a non-empty string")
    alternatives = " | ".join(json.dumps(o, ensure_ascii=False) for o in dict.fromkeys(options))
    return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")


def grammar(source: Any) -> str:
    """A context-free grammar: Lark (llguidance's dialect, rule ``start``) or GBNF (``::=``
    rules with ``root``, as llama.cpp and vLLM's EBNF), converted to Lark."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError("the grammar must be a non-empty string")
    if "::=" in source:
        try:
            source = gbnf_to_lark(source)
        except Exception as exc:  # the converter raises whatever its parser hit
            raise ValueError(f"the GBNF grammar does not parse: {exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(source)


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
