"""Reasoning output: a thinking model's ``<think>…</think>`` text, split from its answer.

Models such as Qwen3 and DeepSeek-R1 write their reasoning between ``<think>`` and
``</think>`` before the answer. With a reasoning parser on (``--reasoning-parser``; ``auto``
picks it when the chat template mentions ``<think>``), a chat completion's message carries that
text as ``reasoning_content`` and only the answer as ``content`` (vLLM's and DeepSeek's
convention); streamed, as ``delta.reasoning_content`` and ``delta.content``.

Where the output begins is read from the end of the rendered prompt (``output_start``): a
generation prompt that opens ``<think>`` (Qwen3-Thinking, DeepSeek-R1) makes the output
reasoning until ``</think>``; one that closes it (Qwen3 with ``enable_thinking: false``) makes
it all content; otherwise a ``<think>`` at the very start of the output (whitespace aside)
opens the reasoning, and output that does not begin with one is all content (vLLM's qwen3
parser takes such output for reasoning unless ``enable_thinking`` is false; a model that wrote
no ``<think>`` has answered, and its answer belongs in ``content``). As in vLLM's
qwen3 parser, reasoning that never closes (cut by ``max_tokens``) is all reasoning, content
null. Whitespace around the tags (up to ``LAYOUT``) is the template's layout, not text: it is
dropped.

The split works on text, so the tags must reach it: they do when they are ordinary text or
added tokens not marked special (Qwen3's); ``serve`` warns when they are special tokens, which
``skip_special_tokens`` (on by default) removes. This module imports nothing of Ketch's: the
server config takes its names from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<think>", "</think>"
THINK = "think"
PARSER_NAMES = (THINK, "qwen3", "deepseek_r1")
"""The reasoning parsers (vLLM's names for the ``<think>`` format are aliases of ``think``)."""
CHOICES = ("auto", "none", *PARSER_NAMES)
"""What ``--reasoning-parser`` accepts."""

BEFORE, REASONING, CONTENT = "before", "reasoning", "content"
"""Where a splitter is: not yet known (a ``<think>`` may open the output), in the reasoning,
or in the content."""
LAYOUT = 256
"""The most whitespace around a tag that is taken for the template's layout and dropped (or,
before a ``<think>`` that may follow, waited on): a longer run is the model's own text. It
bounds what a stream holds back."""
_PROMPT_TAIL_TOKENS = 16
"""How many of the prompt's last tokens ``output_start`` reads: a generation prompt's
``<think>\\n`` or ``</think>\\n\\n`` is a few tokens even where the tags are not one token."""


def choose(setting: str, template: str | None) -> tuple[str | None, str]:
    """The parser for ``--reasoning-parser setting`` on a model whose chat template is
    ``template`` (None: no parsing), and why, for the startup log."""
    if setting == "none":
        return None, "--reasoning-parser none"
    if setting != "auto":
        return THINK, f"--reasoning-parser {setting}"
    if template and OPEN in template:
        return THINK, f"auto: the chat template writes {OPEN}"
    return None, f"auto: the chat template has no {OPEN}"


def prompt_tail(prompt: list[int]) -> list[int]:
    """The last prompt tokens ``output_start`` needs decoded."""
    return prompt[-_PROMPT_TAIL_TOKENS:]


def output_start(tail: str) -> str:
    """Where the output of a prompt ending in ``tail`` (its last tokens' text, special tokens
    kept) begins: in the reasoning if the generation prompt opened ``<think>``, in the content
    if it closed it, else not known yet. Only the very end counts: a user's message that
    mentions a tag is followed by the template's own markers."""
    tail = tail.rstrip()
    if tail.endswith(OPEN):
        return REASONING
    if tail.endswith(CLOSE):
        return CONTENT
    return BEFORE


@dataclass
class ThinkSplitter:
    """Splits one choice's output, fed a piece at a time, into reasoning and content.

    ``feed`` returns what can be told apart so far; text that may yet turn out to be part of a
    tag (``</thi``), or whitespace that may turn out to precede one, waits in ``held`` for the
    next piece (or the end). So a tag split between tokens anywhere is still found, and the
    pieces of a stream add up to what ``split`` gives for the whole text."""

    start: str = BEFORE  # where the output begins (``output_start``)
    state: str = field(init=False)
    held: str = field(init=False, default="")
    reasoned: bool = field(init=False)  # whether the output had a reasoning part, even empty
    _trim: bool = field(init=False)  # drop the whitespace before the next text
    _sent_run: int = field(init=False, default=0)  # a long run of whitespace, sent, going on

    def __post_init__(self) -> None:
        self.state = self.start
        self._trim = self.reasoned = self.start == REASONING

    def delta(self, text: str, finished: bool) -> dict[str, str]:
        """A streamed chat delta's ``reasoning_content`` and ``content`` for ``text``, each
        only when it has some."""
        reasoning, content = self.feed(text, finished)
        pieces = {"reasoning_content": reasoning, "content": content}
        return {k: v for k, v in pieces.items() if v}

    def feed(self, text: str, finished: bool = False) -> tuple[str, str]:
        """(reasoning, content) of ``text`` (either may be empty), after what was held; at the
        end of the output (``finished``) what is still held goes too: a partial tag is text."""
        text, self.held = self.held + text, ""
        reasoning = content = ""
        while text:
            if self.state == BEFORE:
                text = self._open(text)
            elif self.state == REASONING:
                piece, text = self._reason(text)
                reasoning += piece
            else:
                content += text.lstrip() if self._trim else text
                self._trim = self._trim and not content
                text = ""
        if finished:
            held, self.held = self.held, ""
            if self.state == REASONING:
                reasoning += held.rstrip()
            elif self.state == BEFORE:
                content += held
        return reasoning, content

    def _open(self, text: str) -> str:
        """Before anything: a leading ``<think>`` opens the reasoning; text that cannot begin
        one makes the whole output content."""
        start = text.lstrip()
        layout = len(text) - len(start) <= LAYOUT  # more whitespace is the model's own text
        if layout and start.startswith(OPEN):
            self.state, self._trim, self.reasoned = REASONING, True, True
            return start[len(OPEN) :]
        if layout and OPEN.startswith(start):  # whitespace, or a tag begun: wait for more
            self.held = text
            return ""
        self.state = CONTENT
        return text

    def _reason(self, text: str) -> tuple[str, str]:
        """(reasoning, the text after ``</think>``). Trailing whitespace waits (dropped if a
        tag or the end follows) unless the run passes ``LAYOUT``: then it is text, sent on."""
        if self._trim:
            text = text.lstrip()
            self._trim = not text
        end = text.find(CLOSE)
        stop = end if end >= 0 else len(text) - _partial_tag(text)
        body = text[:stop].rstrip()
        run = stop - len(body) + (0 if body else self._sent_run)
        keep = stop if run > LAYOUT else len(body)
        self._sent_run = run if run > LAYOUT else 0
        if end >= 0:
            self.state, self._trim = CONTENT, True
            return text[:keep], text[end + len(CLOSE) :]
        self.held = text[keep:]
        return text[:keep], ""


def _partial_tag(text: str) -> int:
    """The length of the longest end of ``text`` that begins ``</think>``."""
    for size in range(min(len(CLOSE) - 1, len(text)), 0, -1):
        if CLOSE.startswith(text[-size:]):
            return size
    return 0


def split(text: str, start: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output beginning at ``start``: reasoning None
    when there was none (or it was empty); content None when reasoning took it all, else the
    text as it was when no reasoning was found."""
    splitter = ThinkSplitter(start)
    reasoning, content = splitter.feed(text, finished=True)
    if not splitter.reasoned:
        return None, text
    return reasoning or None, content or None


def split_messages(body: dict[str, Any], start: str) -> dict[str, Any]:
    """A ``chat.completion`` body whose messages have their reasoning split off (before tool
    calls are looked for in what is left)."""
    for choice in body["choices"]:
        message = choice["message"]
        message["reasoning_content"], message["content"] = split(message["content"] or "", start)
    return body
