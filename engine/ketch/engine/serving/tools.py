"""Tool calling on chat completions: ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

The tools are rendered by the model's chat template (passed as ``tools``, as Hugging Face
templates expect). ``tool_choice`` decides what the output may be:

- ``"none"``: plain text, no parsing;
- ``"auto"`` (the default when tools are given): the model's text, with tool calls found by
  the parser of the format its chat template writes (``tool_parsers``: Hermes/Qwen
  ``<tool_call>`` JSON, Llama 3 JSON, Mistral ``[TOOL_CALLS]``);
- ``"required"`` or a named function: the output is constrained with the structured-output
  machinery, as vLLM does: a named function's output is its arguments (a document valid against
  its ``parameters``), ``required``'s a JSON list of ``{"name", "parameters"}`` of the given
  tools (one item unless ``parallel_tool_calls``, at most ``MAX_PARALLEL_CALLS``), so the
  arguments always parse.

A response with calls has ``message.tool_calls``, ``content`` null unless the model wrote text
beside them, and ``finish_reason: "tool_calls"``. Streamed, a named function's arguments come
as they are generated (``delta.tool_calls[0].function.arguments`` fragments); other modes'
calls (or the text, if there are none) come whole in the choice's last chunk: whether text is
a call is known only at its end.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import PrivateAttr

from ketch.engine.choices import Choice
from ketch.engine.outputs import RequestDelta
from ketch.engine.serving.guided import GuidedError, GuidedFields, Recipe
from ketch.engine.serving.reasoning import ThinkSplitter, split
from ketch.engine.serving.tool_parsers import PARSERS, ToolCall

logger = logging.getLogger(__name__)

MAX_TOOLS = 128
"""The most tools one request may offer."""
MAX_PARALLEL_CALLS = 4
"""The most calls ``required`` with ``parallel_tool_calls`` lets one response make: an open
list lets a model that never closes it run to max_tokens, with nothing parseable."""


@dataclass
class ToolPlan:
    """What a request's tools mean for its output: ``mode`` is none, auto, required or named."""

    tools: list[dict[str, Any]]  # OpenAI's {"type": "function", "function": {...}} entries
    mode: str
    name: str | None = None  # the named function
    parallel: bool = True
    parser: str = "hermes"

    @property
    def streams_whole(self) -> bool:
        """Whether a streamed choice's calls are known only from its whole text, at its end."""
        return self.mode in ("auto", "required")

    def functions(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    def recipe(self) -> Recipe | None:
        """How to build the grammar that enforces ``required`` or a named function; None
        otherwise. Built like any structured output (``guided``), off the event loop."""
        params = {n: f.get("parameters") or {"type": "object"} for n, f in self.functions().items()}
        # strict: an object schema that does not say additionalProperties gets none, so the
        # model writes only the properties a function declares (as xgrammar and vLLM do)
        if self.mode == "named":
            return Recipe("tools", "json", params[self.name or ""], strict=True)
        if self.mode == "required":
            items = [_call_schema(n, p) for n, p in params.items()]
            schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}}
            schema.update(minItems=1, maxItems=MAX_PARALLEL_CALLS if self.parallel else 1)
            return Recipe("tools", "json", schema, strict=True)
        return None

    def grammar(self) -> str | None:
        """The grammar that enforces ``required`` or a named function, built in this thread;
        None otherwise."""
        recipe = self.recipe()
        return None if recipe is None else recipe.build()

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished choice's text. The text is the model's, which a
        prompt can steer: whatever it holds (nesting past the parser's recursion limit, the
        wrong shapes), it is never an error; what does not parse stays plain content."""
        try:
            return self._calls(text)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            logger.debug("tool-call text did not parse (%s); kept as content", type(exc).__name__)
            return text, []

    def _calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            return None, [(self.name or "", text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []  # cut short by max_tokens: no call to report
            return None, [(i["name"], json.dumps(i["parameters"])) for i in items]
        return PARSERS[self.parser](text)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The chat ``message`` (or last delta) for a choice's text, and its finish reason."""
        content, calls = self.calls(text)
        if not calls:
            return {"role": "assistant", "content": content}, finish_reason
        tool_calls = [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": arguments}}
            for name, arguments in calls
        ]  # fmt: skip
        message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
        return message, "tool_calls" if finish_reason == "stop" else finish_reason


def _call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "parameters": parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


class ToolFields(GuidedFields):
    """The tool-calling fields of a chat request; its grammar is the tools' when
    ``tool_choice`` is ``required`` or named."""

    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    _plan: tuple[ToolPlan | None] | None = PrivateAttr(None)

    def _make_recipe(self) -> Recipe | None:
        return tool_recipe(self.tool_plan(), super()._make_recipe())

    def tool_plan(self) -> ToolPlan | None:
        """The request's ToolPlan (None without tools); GuidedError naming a bad field."""
        if self._plan is None:
            self._plan = (self._tool_plan(),)
        return self._plan[0]

    def _tool_plan(self) -> ToolPlan | None:
        tools = [_check_tool(t, i) for i, t in enumerate(self.tools or [])]
        if len(tools) > MAX_TOOLS:
            raise GuidedError("tools", f"at most {MAX_TOOLS} tools are allowed")
        choice = self.tool_choice
        if not tools:
            if choice not in (None, "none"):
                raise GuidedError("tool_choice", "tool_choice needs tools")
            return None
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise GuidedError("tools", "tools: function names must be unique")
        parallel = self.parallel_tool_calls is not False
        if choice is None or choice in ("none", "auto", "required"):
            return ToolPlan(tools, choice or "auto", parallel=parallel)
        name = _named(choice)
        if name not in names:
            raise GuidedError("tool_choice", f"tool_choice names {name!r}, which is not in tools")
        return ToolPlan(tools, "named", name=name, parallel=parallel)


def _check_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    function = tool.get("function")
    if tool.get("type") != "function" or not isinstance(function, dict):
        raise GuidedError(f"tools[{index}]", f"tools[{index}] must be {{type: function, function}}")
    name = function.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise GuidedError(f"tools[{index}]", f"tools[{index}].function.name must be a name")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise GuidedError(f"tools[{index}]", f"tools[{index}].function.parameters: an object")
    return tool


def _named(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and name):
        raise GuidedError(
            "tool_choice",
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
        )
    return name


def apply_plan(body: dict[str, Any], plan: ToolPlan | None) -> dict[str, Any]:
    """A ``chat.completion`` body with each choice's content turned into its tool calls (the
    message's other fields, ``reasoning_content``, stay)."""
    if plan is None or plan.mode == "none":
        return body
    for choice in body["choices"]:
        text = choice["message"]["content"] or ""
        message, choice["finish_reason"] = plan.message(text, choice["finish_reason"])
        choice["message"] = choice["message"] | message
    return body


def chat_delta(
    plan: ToolPlan | None, splitter: ThinkSplitter | None, choice: Choice, delta: RequestDelta
) -> tuple[dict, str | None] | None:
    """A streamed chat choice's next delta and finish reason, or None to send nothing yet,
    with its reasoning split off (``splitter``, when it is) and its tool calls found in the
    content that is left (``plan``)."""
    finish = delta.finish_reason
    pieces = {"content": delta.new_text}
    if splitter is not None:
        pieces = splitter.delta(delta.new_text, finish is not None)
    if plan is None or plan.mode == "none":
        if pieces or finish is not None or delta.logprobs:
            return pieces, finish
        return None  # all held back (a tag may be starting): nothing to say yet
    thought = {k: v for k, v in pieces.items() if k == "reasoning_content"}
    content = None
    if splitter is not None and finish is not None:
        content = split(choice.output().text, splitter.start)[1] or ""
    tool = stream_delta(plan, choice, delta, content)
    if tool is None:
        return (thought, None) if thought else None
    return thought | tool[0], tool[1]


def stream_delta(
    plan: ToolPlan, choice: Choice, delta: RequestDelta, content: str | None = None
) -> tuple[dict, str | None] | None:
    """A streamed choice's next delta and finish reason, or None to send nothing yet. A named
    function's output is its arguments, so they stream as generated (the first delta also has
    the call's id and name); other modes' calls are known at the end, from the choice's whole
    text (it accumulates: ``streams_whole``) or, when its reasoning was split off, from its
    ``content``, and come whole then."""
    finish = delta.finish_reason
    if plan.mode != "named":
        if finish is None:
            return None
        return _last_delta(plan, choice.output().text if content is None else content, finish)
    first = choice.first
    if not (first or delta.new_text or finish):
        return None
    call: dict[str, Any] = {"index": 0, "function": {"arguments": delta.new_text}}
    if first:
        call.update(id=f"call_{uuid.uuid4().hex[:24]}", type="function")
        call["function"] = {"name": plan.name, "arguments": delta.new_text}
    return {"tool_calls": [call]}, "tool_calls" if finish == "stop" else finish


def _last_delta(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """A streamed choice's last delta: its calls (each with its ``index``) or its text."""
    message, finish_reason = plan.message(text, finish_reason)
    delta = {k: v for k, v in message.items() if k != "role" and v is not None}
    for i, call in enumerate(delta.get("tool_calls", [])):
        call["index"] = i
    return delta, finish_reason


def tool_recipe(plan: ToolPlan | None, guided: Recipe | None) -> Recipe | None:
    """What the request's output is constrained with: the tools' recipe or response_format's
    (and the others'); GuidedError when both ask."""
    tools = plan.recipe() if plan is not None else None
    if plan is None or tools is None:
        return guided
    if guided is not None:
        message = f"tool_choice '{plan.mode}' cannot be combined with {guided.param}"
        raise GuidedError("tool_choice", message)
    return tools
