"""Tool calling against a real ``ketch serve --model tiny``, with the official ``openai`` client.

A named ``tool_choice`` always yields one call whose arguments validate against the tool's
schema; ``required`` yields calls of the given tools (one unless ``parallel_tool_calls``);
``none`` and ``auto`` leave a model that writes no call with plain content; streamed and
non-streamed agree; a conversation with a tool result is accepted; bad tool fields are 400s
naming them. The Hermes parser and the template's ``tools`` are checked offline.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest
from serve_harness import running_server

from hf_models import make_checkpoint, make_tokenizer
from ketch.engine.serving.tool_parsers import (
    PARSERS,
    hermes,
    llama3_json,
    mistral,
    parser_for_template,
)
from ketch.engine.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 8}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "description": "now", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, **fields):
    fields = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 300, **fields}
    return client.chat.completions.create(**fields)


def _streamed(client: openai.OpenAI, **fields) -> tuple[str | None, list[dict], str | None]:
    content, calls, reason = None, [], None
    for chunk in _chat(client, stream=True, **fields):
        for c in chunk.choices:
            if c.delta.content:
                content = (content or "") + c.delta.content
            for call in c.delta.tool_calls or []:  # a call's first delta has its id and name
                if call.id is not None:
                    assert call.index == len(calls) and call.type == "function"
                    calls.append({"name": call.function.name, "arguments": ""})
                calls[call.index]["arguments"] += call.function.arguments or ""
            reason = c.finish_reason or reason
    return content, calls, reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_named_tool_choice_always_calls_it_with_valid_arguments(client, temperature: float):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = _chat(client, tool_choice=choice, temperature=temperature, seed=4, n=3)
    for c in out.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        [call] = c.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_arguments_hold_only_the_declared_properties(client):
    """A schema that leaves additionalProperties unsaid gets no others (issue 29): the tiny
    model, sampling, would otherwise write keys of its own until max_tokens."""
    two = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 6}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    }
    tools = [{"type": "function", "function": {"name": "pair", "parameters": two}}]
    for choice in ({"type": "function", "function": {"name": "pair"}}, "required"):
        out = _chat(client, tools=tools, tool_choice=choice, temperature=1.0, seed=7, n=8)
        for c in out.choices:
            assert c.finish_reason == "tool_calls", c
            assert c.message.tool_calls  # one, or with "required" maybe parallel calls
            for call in c.message.tool_calls:
                arguments = json.loads(call.function.arguments)
                assert set(arguments) == {"a", "b"}, arguments
                jsonschema.validate(arguments, two)


def test_streamed_and_whole_agree(client):
    """A named function's arguments stream in fragments; required's calls come whole."""
    named = {"type": "function", "function": {"name": "get_time"}}
    fragments = [
        c.delta.tool_calls[0].function.arguments
        for chunk in _chat(client, stream=True, tool_choice=named, temperature=0)
        for c in chunk.choices
        if c.delta.tool_calls
    ]
    assert len(fragments) > 2
    for choice in (named, "required"):
        whole = _chat(client, tool_choice=choice, temperature=0).choices[0]
        content, calls, reason = _streamed(client, tool_choice=choice, temperature=0)
        want = [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in whole.message.tool_calls
        ]
        assert (content, calls, reason) == (None, want, "tool_calls")


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_given_tools(client, parallel: bool):
    for seed in range(3):
        out = _chat(
            client, tool_choice="required", parallel_tool_calls=parallel, temperature=1.0,
            seed=seed,
        )  # fmt: skip
        c = out.choices[0]
        assert c.finish_reason == "tool_calls"
        assert len(c.message.tool_calls) >= 1 and (parallel or len(c.message.tool_calls) == 1)
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("tool_choice", ["none", "auto", None])
def test_none_and_auto_leave_plain_text(client, tool_choice):
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    plain = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0
    ).choices[0]
    out = _chat(client, max_tokens=12, temperature=0, **extra).choices[0]
    # The tiny model's template does not render tools, so the output is the plain one.
    assert out.message.content == plain.message.content and out.message.tool_calls is None
    assert out.finish_reason == plain.finish_reason
    content, calls, reason = _streamed(client, max_tokens=12, temperature=0, **extra)
    assert (content, calls, reason) == (plain.message.content, [], plain.finish_reason)


def test_a_tool_result_round_trips(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    first = _chat(client, tool_choice=choice, temperature=0).choices[0].message
    call = first.tool_calls[0]
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    out = _chat(client, messages=messages, max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "not in tools"),
        ({"tool_choice": "sometimes"}, "tool_choice", "must be 'none'"),
        ({"tools": [{"type": "function"}]}, "tools[0]", "type: function"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "unique"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
         "cannot be combined"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
          "tool_choice": "required"}, "tools", "invalid JSON schema"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_400_naming_them(client, fields: dict, param: str, words: str):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, **fields)
    body = info.value.body
    assert body["param"] == param and words in body["message"], body


# ---- offline: the parser and the template ----


def test_hermes_finds_calls_and_keeps_the_rest():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
        '</tool_call>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
        "<tool_call>not json</tool_call>"
    )
    content, calls = hermes(text)
    assert calls == [("get_time", '{"zone": "UTC"}'), ("f", "{}")]
    assert content == "Let me check.\n\n<tool_call>not json</tool_call>"
    assert hermes("no calls") == ("no calls", [])
    assert hermes('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>') == (
        None, [("f", '{"a": 1}')],
    )  # fmt: skip


def test_the_chat_template_renders_tools(tmp_path: Path):
    make_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if tools %}tools: {{ tools | map(attribute='function.name') | join(',') }}\n"
        "{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    text = Tokenizer(tmp_path).apply_chat_template(MESSAGES, tools=TOOLS)
    assert text.startswith("tools: get_weather,get_time\nuser: What is the weather")


def test_llama3_and_mistral_formats():
    calls = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
    assert llama3_json(calls) == (None, [("f", '{"a": 1}'), ("g", "{}")])
    assert llama3_json("Hello {there}") == ("Hello {there}", [])
    assert llama3_json('{"name": "f", "parameters": {}} and more') == (
        '{"name": "f", "parameters": {}} and more', [],
    )  # fmt: skip
    text = 'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"x": "y"}}, '
    text += '{"name": "g", "arguments": "{}"}]'
    assert mistral(text) == ("Sure.", [("f", '{"x": "y"}'), ("g", "{}")])
    assert mistral("[TOOL_CALLS] not json") == ("[TOOL_CALLS] not json", [])
    assert mistral("no calls") == ("no calls", [])


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("{{ '[TOOL_CALLS]' }}", "mistral"),
        ("{% if m.role == 'ipython' %}", "llama3_json"),
        ("<tool_call>\n{{ tool_call | tojson }}\n</tool_call>", "hermes"),
        ("{{ m.content }}", "hermes"),
        (None, "hermes"),
    ],
)
def test_the_parser_follows_the_template(template, parser: str):
    assert parser_for_template(template) == parser
    assert parser in PARSERS


CALL_TEXT = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_a_call_the_model_writes(client, stream: bool):
    """The tiny model never writes a call by itself; a regex makes it write one, which the
    Hermes parser (the tiny template shows no format) turns into tool_calls."""
    fields = {"temperature": 0, "extra_body": {"guided_regex": re.escape(CALL_TEXT)}}
    if stream:
        content, calls, reason = _streamed(client, **fields)
    else:
        c = _chat(client, **fields).choices[0]
        content, reason = c.message.content, c.finish_reason
        calls = [{"name": t.function.name, "arguments": t.function.arguments}
                 for t in c.message.tool_calls]  # fmt: skip
    assert (content, reason) == (None, "tool_calls")
    assert calls == [{"name": "get_time", "arguments": '{"zone": "UTC"}'}]


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>"
    "{% else %}{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_tools_renders_calls_and_results(tmp_path: Path):
    """A Hermes-style template: the prompt the server runs is the tools, the earlier call and
    its result rendered (its token count equals the offline rendering's), and auto parses."""
    # The test tokenizer's 300 tokens make long prompts of tool JSON: a longer context.
    model = make_checkpoint(tmp_path / "hermes", "qwen2", max_position_embeddings=2048)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}  # fmt: skip
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    tokenizer = Tokenizer(model)
    # One short tool: the test tokenizer's 300 tokens make long prompts of JSON.
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
    text = tokenizer.apply_chat_template(messages, tools=tools)
    assert "<tools>" in text and "<tool_call>" in text and "<tool_response>12:00" in text
    with running_server("--model", str(model), "--served-model-name", "hermes") as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        fields = {"model": "hermes", "messages": messages, "tools": tools, "temperature": 0}
        out = client.chat.completions.create(
            max_tokens=150, extra_body={"guided_regex": re.escape(CALL_TEXT)}, **fields
        )
        assert out.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
        assert out.choices[0].finish_reason == "tool_calls"
        assert out.choices[0].message.tool_calls[0].function.name == "get_time"
        named = {"type": "function", "function": {"name": "get_time"}}
        out = client.chat.completions.create(max_tokens=100, tool_choice=named, **fields)
        arguments = out.choices[0].message.tool_calls[0].function.arguments
        jsonschema.validate(json.loads(arguments), TIME)
