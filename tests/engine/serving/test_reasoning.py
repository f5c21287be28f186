"""Reasoning output, offline: the ``<think>`` splitter on whole texts and on every way a stream
can cut them, where a prompt leaves the output, how it composes with tool calls, the
``chat_template_kwargs`` checks and the ``--reasoning-parser`` setting.

``test_serve_reasoning`` runs the same against a real ``ketch serve`` with the openai client.
"""

from __future__ import annotations

import itertools
import json

import pytest

from ketch.engine.choices import Choice
from ketch.engine.cli import build_parser
from ketch.engine.cli_args import parse_config_text
from ketch.engine.outputs import RequestDelta
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.serving.config import ServerConfig
from ketch.engine.serving.protocol import (
    ChatCompletionRequest,
    ProtocolError,
    parse_request,
)
from ketch.engine.serving.reasoning import (
    BEFORE,
    CONTENT,
    LAYOUT,
    REASONING,
    ThinkSplitter,
    choose,
    output_start,
    split,
    split_messages,
)
from ketch.engine.serving.template_kwargs import (
    MAX_TEMPLATE_KWARGS_CHARS,
    MAX_TEMPLATE_KWARGS_DEPTH,
    MAX_TEMPLATE_KWARGS_VALUES,
)
from ketch.engine.serving.tools import ToolPlan, apply_plan, chat_delta
from ketch.engine.tokenizer import TEMPLATE_VARIABLES

# (output, where it starts) -> (reasoning_content, content)
CASES = [
    (("<think>\nLet me see.\n</think>\n\nParis.", BEFORE), ("Let me see.", "Paris.")),
    (("  <think>a</think>b", BEFORE), ("a", "b")),
    (("Let me see.\n</think>\n\nParis.", REASONING), ("Let me see.", "Paris.")),
    (
        ("<think>\nstill thinking when max_tokens hit", BEFORE),
        ("still thinking when max_tokens hit", None),
    ),
    (("still thinking", REASONING), ("still thinking", None)),
    (("<think>a</think>", BEFORE), ("a", None)),
    (("<think></think>Paris.", BEFORE), (None, "Paris.")),
    (("Paris.", BEFORE), (None, "Paris.")),  # thinking off: no tags, all content
    (("Paris.", CONTENT), (None, "Paris.")),
    (("x</think>y", CONTENT), (None, "x</think>y")),  # closed in the prompt: tags are text
    (("Paris <think>a</think>", BEFORE), (None, "Paris <think>a</think>")),  # not at the start
    (("<thinking>", BEFORE), (None, "<thinking>")),
    (("<thi", BEFORE), (None, "<thi")),
    (("a </thi", REASONING), ("a </thi", None)),  # a partial tag at the end is text
    (("a\n\n", REASONING), ("a", None)),
    (("", BEFORE), (None, "")),
    (("\n", BEFORE), (None, "\n")),
    (("<think>a<think>b</think>c</think>d", BEFORE), ("a<think>b", "c</think>d")),
    (("<think>\n\n</think>\n\n  ", BEFORE), (None, None)),
    (("é</think>ü", REASONING), ("é", "ü")),
    # Whitespace past LAYOUT is the model's text, kept (and never held back longer)
    ((f"a{' ' * LAYOUT}</think>b", REASONING), ("a", "b")),
    ((f"a{' ' * (LAYOUT + 1)}</think>b", REASONING), (f"a{' ' * (LAYOUT + 1)}", "b")),
    ((f"a{' ' * (LAYOUT + 1)}", REASONING), (f"a{' ' * (LAYOUT + 1)}", None)),
    ((f"{' ' * LAYOUT}<think>a", BEFORE), ("a", None)),
    ((f"{' ' * (LAYOUT + 1)}<think>a", BEFORE), (None, f"{' ' * (LAYOUT + 1)}<think>a")),
]


@pytest.mark.parametrize(("given", "want"), CASES)
def test_split_a_whole_output(given: tuple[str, str], want: tuple[str | None, str | None]):
    assert split(*given) == want


def _streamed(pieces: list[str], start: str) -> tuple[str | None, str | None, bool]:
    splitter = ThinkSplitter(start)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        delta = splitter.delta(piece, finished=i == len(pieces) - 1)
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
    return reasoning, content, splitter.reasoned


@pytest.mark.parametrize(("given", "want"), CASES)
def test_a_stream_cut_anywhere_adds_up_to_the_whole(given: tuple[str, str], want):
    """Every cut into two and three pieces (a tag split at each of its characters among them),
    and one character at a time, give the pieces ``split`` gives for the whole text."""
    text, start = given
    cuts = [[*c] for n in (1, 2) for c in itertools.combinations(range(1, len(text)), n)]
    for positions in [*cuts, list(range(1, len(text)))]:
        bounds = [0, *positions, len(text)]
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
        reasoning, content, reasoned = _streamed(pieces, start)
        if not reasoned:
            assert (None, content) == (want[0], text), pieces
        else:
            assert (reasoning or None, content or None) == want, pieces


def test_what_a_stream_holds_back_is_bounded():
    splitter = ThinkSplitter(REASONING)
    splitter.delta("a", False)
    for _ in range(1000):
        splitter.delta("\n", False)
        assert len(splitter.held) <= LAYOUT
    before = ThinkSplitter(BEFORE)
    for _ in range(1000):
        before.delta(" ", False)
        assert len(before.held) <= LAYOUT


def test_nothing_is_held_longer_than_a_tag_could_need():
    splitter = ThinkSplitter(BEFORE)
    assert splitter.delta("<th", False) == {}
    assert splitter.delta("ink>\nI", False) == {"reasoning_content": "I"}
    assert splitter.delta(" think </", False) == {"reasoning_content": " think"}
    assert splitter.delta("think>\n\n", False) == {}
    assert splitter.delta("So", False) == {"content": "So"}
    assert splitter.delta(" </think> <think>", True) == {"content": " </think> <think>"}
    plain = ThinkSplitter(BEFORE)
    assert plain.delta("Hi", False) == {"content": "Hi"}  # no tag can start: sent at once


@pytest.mark.parametrize(
    ("tail", "start"),
    [
        ("<|im_start|>assistant\n", BEFORE),
        ("<|im_start|>assistant\n<think>\n", REASONING),
        ("<｜Assistant｜><think>\n", REASONING),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", CONTENT),
        ("user: what is <think>?<|im_end|>\n<|im_start|>assistant\n", BEFORE),
    ],
)
def test_where_the_output_starts_comes_from_the_end_of_the_prompt(tail: str, start: str):
    assert output_start(tail) == start


def test_auto_picks_the_think_parser_from_the_template():
    assert choose("auto", "{% if x %}<think>\n{% endif %}")[0] == "think"
    assert choose("auto", "{{ messages }}") == (None, "auto: the chat template has no <think>")
    assert choose("auto", None)[0] is None
    assert choose("none", "<think>")[0] is None
    assert choose("qwen3", None)[0] == choose("deepseek_r1", None)[0] == "think"


def test_tool_calls_are_found_in_the_content_left_after_the_reasoning():
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    text = f"<think>I could call <tool_call>g</tool_call>.</think>\n{call}"
    body = {
        "choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]
    }
    plan = ToolPlan([{"type": "function", "function": {"name": "f"}}], "auto")
    choice = apply_plan(split_messages(body, BEFORE), plan)["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == "I could call <tool_call>g</tool_call>."
    assert message["content"] is None and choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 1}


def test_streamed_tool_calls_come_whole_at_the_end_after_streamed_reasoning():
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    pieces = ["<think>", "hm", "</think>", call[:9], call[9:]]
    plan = ToolPlan([{"type": "function", "function": {"name": "f"}}], "auto")
    choice = Choice(0, 0, 0, [1], SamplingParams())
    splitter = ThinkSplitter(BEFORE)
    sent = []
    for i, piece in enumerate(pieces):
        delta = RequestDelta("r", [i], piece, "stop" if i == len(pieces) - 1 else None)
        choice.add(delta)
        sent.append(chat_delta(plan, splitter, choice, delta))
    assert sent[:4] == [None, ({"reasoning_content": "hm"}, None), None, None]
    last, finish = sent[4]
    assert finish == "tool_calls" and "content" not in last
    assert [c["function"]["name"] for c in last["tool_calls"]] == ["f"]


def _chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_request(ChatCompletionRequest, body)


def _refusal(kwargs) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        _chat(chat_template_kwargs=kwargs)
    assert caught.value.status_code == 400
    assert caught.value.param == "chat_template_kwargs"
    return caught.value


def test_chat_template_kwargs_are_checked():
    allowed = {"enable_thinking": False, "options": {"depth": [1, {"x": None}]}}
    assert _chat(chat_template_kwargs=allowed).chat_template_kwargs == allowed
    assert _chat().chat_template_kwargs is None
    for wrong in ([1], "enable_thinking", 1, True):
        assert "dictionary" in _refusal(wrong).message
    for name in TEMPLATE_VARIABLES:
        assert repr(name) in _refusal({name: 1}).message
    assert "identifiers" in _refusal({"not a name": 1}).message
    deep: dict = {"x": 1}
    for _ in range(MAX_TEMPLATE_KWARGS_DEPTH):
        deep = {"x": deep}
    assert "nest" in _refusal(deep).message
    many = {f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS_VALUES)}
    assert "values" in _refusal(many).message
    assert "characters" in _refusal({"long": "x" * (MAX_TEMPLATE_KWARGS_CHARS + 1)}).message
    assert "values" in _refusal({"list": [0] * 100_000}).message


def test_chat_template_kwargs_nested_at_the_limit_are_accepted():
    value: dict | list = {"x": 1}
    for _ in range(MAX_TEMPLATE_KWARGS_DEPTH - 1):
        value = {"x": value}
    _chat(chat_template_kwargs=value)


def test_reasoning_parser_setting(capsys):
    args = build_parser().parse_args(["serve", "--reasoning-parser", "none"])
    assert args.reasoning_parser == "none"
    assert ServerConfig().reasoning_parser == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "r1"])
    error = capsys.readouterr().err
    assert "invalid choice: 'r1'" in error and "'auto', 'none', 'think', 'qwen3'" in error
    values = parse_config_text('{"reasoning-parser": "qwen3"}', "c.json", ServerConfig)
    assert ServerConfig(**values).reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match=r"reasoning_parser must be one of \['auto'"):
        ServerConfig(reasoning_parser="r1")


@pytest.mark.parametrize("special", [False, True])
def test_the_startup_log_names_the_parser_and_warns_of_special_tags(tmp_path, caplog, special):
    """Tags the tokenizer marks special vanish from text under skip_special_tokens."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from hf_models import make_tokenizer
    from ketch.engine.serving.serve import _reasoning_parser
    from ketch.engine.tokenizer import Tokenizer

    make_tokenizer(tmp_path)
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    hf.add_tokens([AddedToken(t, special=special) for t in ("<think>", "</think>")])
    hf.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] += "{% if add_generation_prompt %}<think>\n{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.is_special("<think>") == special
    caplog.set_level("INFO", logger="ketch.serve")
    assert _reasoning_parser(ServerConfig(), tokenizer) == "think"
    assert _reasoning_parser(ServerConfig(reasoning_parser="none"), tokenizer) is None
    logged = caplog.text
    assert "reasoning parser: think (auto: the chat template writes <think>)" in logged
    assert "reasoning parser: none (--reasoning-parser none)" in logged
    assert ("marks <think> and </think> as special tokens" in logged) == special
