"""Parsers that find tool calls in a model's text, one per output format, by name.

A parser takes the whole generated text and returns the text that is not a call (or None) and
the calls found, each ``(function name, arguments as JSON text)``. Adding a format is one
function here, one registry entry and the marker its chat templates contain
(``parser_for_template`` picks the parser of the served model from its template).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

ToolCall = tuple[str, str]
Parser = Callable[[str], tuple[str | None, list[ToolCall]]]

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; a
    block that is not such JSON stays in the content."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _HERMES.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
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
    except ValueError:
        return text, []
    items = items if isinstance(items, list) else [items]
    calls = [_call(json.dumps(i)) if isinstance(i, dict) else None for i in items]
    if not calls or None in calls:
        return text, []
    return head.strip() or None, [c for c in calls if c is not None]


def _call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


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
