"""Parsers that find tool calls in a model's text, one per output format, by name.

A parser takes the whole generated text and returns the text that is not a call (or None) and
the calls found, each ``(function name, arguments as JSON text)``. Adding a format is one
function here and one registry entry.
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


def _call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return value["name"], json.dumps(arguments, ensure_ascii=False)


PARSERS: dict[str, Parser] = {"hermes": hermes}
"""Tool-call parsers by name (``--tool-call-parser`` in vLLM's terms); Ketch uses hermes."""
