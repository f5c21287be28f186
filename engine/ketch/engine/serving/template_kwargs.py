"""vLLM's ``chat_template_kwargs``: more variables for a request's chat template (e.g.
``{"enable_thinking": false}``), checked where the request is parsed (``protocol``,
``tokenization``): names that are identifiers and never the renderer's own variables, JSON
values within bounds on depth, count and characters, each checked in one bounded walk."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator

from ketch.engine.tokenizer import TEMPLATE_VARIABLES

MAX_TEMPLATE_KWARGS_DEPTH = 8
"""How deep ``chat_template_kwargs``' objects and arrays may nest: a switch or a few options
need one or two levels; a template walks what it is given, recursively."""
MAX_TEMPLATE_KWARGS_VALUES = 256
"""Most values (keys' too) ``chat_template_kwargs`` may hold."""
MAX_TEMPLATE_KWARGS_CHARS = 16 * 1024
"""Most characters its keys and strings may hold together: it is rendered into the prompt, so
it is bounded as the rest of the request is, but tighter (it is options, not content)."""


def _template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's ``chat_template_kwargs``: more variables for the chat template, e.g.
    ``{"enable_thinking": false}``. JSON values within bounds; never the renderer's own."""
    for key in value or {}:
        if not (key.isidentifier() and len(key) <= 64):
            shown = repr(key) if len(key) <= 20 else repr(key[:20]) + "..."
            raise ValueError(f"keys must be names (identifiers, at most 64 long), got {shown}")
        if key in TEMPLATE_VARIABLES:
            raise ValueError(
                f"{key!r} is set by the server when it renders the chat; it cannot be overridden"
            )
    _check_json_size(value)
    return value


def _check_json_size(value: Any) -> None:
    """Walks a parsed JSON value a level at a time, stopping at the first bound it passes (so
    its cost is bounded whatever it holds)."""
    values = chars = 0
    level: list[Any] = [value]
    for depth in range(MAX_TEMPLATE_KWARGS_DEPTH + 1):
        below: list[Any] = []
        for item in level:
            values += 1
            if isinstance(item, dict | list) and depth == MAX_TEMPLATE_KWARGS_DEPTH:
                raise ValueError(
                    f"objects and arrays may nest at most {MAX_TEMPLATE_KWARGS_DEPTH} deep"
                )
            if isinstance(item, str):
                chars += len(item)
            elif isinstance(item, dict):
                chars += sum(len(k) for k in item)
                values += len(item)
                below += item.values()
            elif isinstance(item, list):
                below += item
            if values > MAX_TEMPLATE_KWARGS_VALUES:
                raise ValueError(f"at most {MAX_TEMPLATE_KWARGS_VALUES} values are allowed")
            if chars > MAX_TEMPLATE_KWARGS_CHARS:
                raise ValueError(f"at most {MAX_TEMPLATE_KWARGS_CHARS} characters are allowed")
        if not below:
            return
        level = below


TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs)]
