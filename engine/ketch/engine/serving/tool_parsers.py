"""Parsers that find tool calls in a model's text, one per output format, by name.

A parser takes the whole generated text and returns the text that is not a call (or None) and
the calls found, each ``(function name, arguments as JSON text)``. Adding a format is one
function here, one registry entry and the marker its chat templates contain
(``parser_for_template`` picks the parser of the served model from its template).

The text is the model's, and a prompt can steer it: a parser never raises on it (JSON nested
past the recursion limit is not a call) and takes time linear in it.
"""

from __future__ import annotations

import json
from collections.abc import Callable

ToolCall = tuple[str, str]
Parser = Callable[[str], tuple[str | None, list[ToolCall]]]

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; a
    block that is not such JSON stays in the content. (Each opening tag pairs with the first
    closing tag after it; scanned with ``str.find``, linear in the text whatever it holds.)"""
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = position = 0
    while (start := text.find(_OPEN, position)) >= 0:
        end = text.find(_CLOSE, start + len(_OPEN))
        if end < 0:
            break
        position = end + len(_CLOSE)
        call = _call(text[start + len(_OPEN) : end].strip())
        if call is None:
            continue
        kept.append(text[last:start])
        last = position
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None), calls


def llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """Llama 3.1+: the whole output is ``{"name": ..., "parameters": {...}}`` (after an optional
    ``<|python_tag|>``), several separated by ``;``; anything else is content."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    parts = [p for p in body.split(";") if p.strip()] if body.startswith("{") else []
    calls = [_call(p) for p in parts]
    if not calls or None in calls:
        return text, []
    return None, [c for c in calls if c is not None]


def mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    """Mistral: content, then ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}``."""
    head, marker, tail = text.partition("[TOOL_CALLS]")
    if not marker:
        return text, []
    try:
        items = json.loads(tail.strip())
    except (ValueError, RecursionError):
        return text, []
    items = items if isinstance(items, list) else [items]
    try:
        calls = [_call(json.dumps(i)) if isinstance(i, dict) else None for i in items]
    except (ValueError, RecursionError):
        return text, []
    if not calls or None in calls:
        return text, []
    return head.strip() or None, [c for c in calls if c is not None]


def _call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text already
            return value["name"], arguments
        return value["name"], json.dumps(arguments, ensure_ascii=False)
    except (ValueError, RecursionError):  # not JSON, or nested past the recursion limit
        return None


PARSERS: dict[str, Parser] = {"hermes": hermes, "llama3_json": llama3_json, "mistral": mistral}
"""Tool-call parsers by name (vLLM's ``--tool-call-parser`` names)."""
_MARKERS = (("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
            ("ipython", "llama3_json"), ("<tool_call>", "hermes"))  # fmt: skip


def parser_for_template(source: str | None) -> str:
    """The parser for a model whose chat template is ``source``: the format the template
    writes tool calls in; Hermes (the most common, Qwen's) when it shows none."""
    for marker, name in _MARKERS:
        if source and marker in source:
            return name
    return "hermes"
